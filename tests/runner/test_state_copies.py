"""Recurrent-state slot copies (prefix caching of hybrids): the device function on small
arrays, the runner's batch padding and checks, a tiny Qwen3.5 runner whose saved and
restored snapshot gives what recomputing gives with nothing compiled after warmup, and
the forward with copies compiled for TPU v6e with the state updated in place."""
from __future__ import annotations

import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from jaxserve.runner.compile_counter import num_compilations
from jaxserve.runner.input_batch import InputBatch
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.runner_config import RunnerConfig
from jaxserve.runner.programs import FORWARD
from models.config import ModelConfig
from models.layer_stack import CONV, KV, RECURRENT
from models.state_copies import copy_state_slots
from tests.checkpoints import make_tiny_checkpoint

LAYERS, SLOTS, K = 3, 5, 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def small_caches() -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    return {CONV: jnp.asarray(rng.normal(size=(LAYERS * SLOTS, 6)), jnp.float32),
            RECURRENT: jnp.asarray(rng.normal(size=(LAYERS * SLOTS, 2, 3, 3)), jnp.float32),
            KV: jnp.asarray(rng.normal(size=(7, 2, 4, 8)), jnp.float32)}


def reference_copies(caches: dict, pairs: list[tuple[int, int]]) -> dict[str, np.ndarray]:
    """The copies one by one on host arrays, row d * SLOTS + s per layer."""
    out = {k: np.array(v) for k, v in caches.items()}
    for src, dst in pairs:
        for kind in (CONV, RECURRENT):
            for d in range(LAYERS):
                out[kind][d * SLOTS + dst] = out[kind][d * SLOTS + src]
    return out


def padded(pairs: list[tuple[int, int]]) -> np.ndarray:
    a = np.zeros((K, 2), np.int32)
    a[:len(pairs)] = pairs
    return a


def test_copies_every_layer_in_order_and_only_count_pairs():
    caches = small_caches()
    before = {k: np.array(v) for k, v in caches.items()}
    # A chain (1 -> 3 -> 4: 4 gets 1's state), an overwrite of the chain's source, and a
    # fourth pair past the count that would overwrite slot 2.
    pairs = [(1, 3), (3, 4), (2, 1), (4, 2)]
    fn = jax.jit(copy_state_slots, static_argnums=(3,), donate_argnums=(0,))
    out = fn(caches, jnp.asarray(padded(pairs)), jnp.array([3], jnp.int32), SLOTS)
    want = reference_copies(before, pairs[:3])
    for kind in (CONV, RECURRENT, KV):
        np.testing.assert_array_equal(np.asarray(out[kind]), want[kind], err_msg=kind)
    for kind in (CONV, RECURRENT):
        got = np.asarray(out[kind])
        for d in range(LAYERS):
            r = lambda s: d * SLOTS + s   # noqa: E731
            np.testing.assert_array_equal(got[r(4)], before[kind][r(1)])   # via the chain
            np.testing.assert_array_equal(got[r(3)], before[kind][r(1)])
            np.testing.assert_array_equal(got[r(1)], before[kind][r(2)])
            np.testing.assert_array_equal(got[r(2)], before[kind][r(2)])   # pair 4 ignored
            np.testing.assert_array_equal(got[r(0)], before[kind][r(0)])   # the null slot
    np.testing.assert_array_equal(np.asarray(out[KV]), before[KV])


def test_copies_on_state_split_by_heads():
    """As the runner's caches are placed: split over the model axis by heads (axis 1)."""
    from jax.sharding import NamedSharding, PartitionSpec
    from sharding import make_mesh
    mesh = make_mesh("1x2", jax.devices()[:2])
    split = NamedSharding(mesh, PartitionSpec(None, "model"))
    caches = {k: jax.device_put(v, split) for k, v in small_caches().items() if k != KV}
    before = {k: np.array(v) for k, v in caches.items()}
    pairs = [(1, 3), (3, 4)]
    out = jax.jit(copy_state_slots, static_argnums=(3,), donate_argnums=(0,))(
        caches, jnp.asarray(padded(pairs)), jnp.array([2], jnp.int32), SLOTS)
    want = reference_copies(before, pairs)
    for kind in (CONV, RECURRENT):
        assert out[kind].sharding.is_equivalent_to(split, out[kind].ndim)
        np.testing.assert_array_equal(np.asarray(out[kind]), want[kind])


def test_count_zero_and_a_scalar_count():
    caches = small_caches()
    before = {k: np.array(v) for k, v in caches.items()}
    out = copy_state_slots(caches, jnp.asarray(padded([(1, 2)])), jnp.int32(0), SLOTS)
    for kind in before:
        np.testing.assert_array_equal(np.asarray(out[kind]), before[kind])
    out = copy_state_slots(caches, jnp.asarray(padded([(1, 2)])), jnp.int32(1), SLOTS)
    np.testing.assert_array_equal(np.asarray(out[RECURRENT]),
                                  reference_copies(before, [(1, 2)])[RECURRENT])
    # A model without linear attention: nothing to copy.
    kv_only = {KV: caches[KV]}
    assert copy_state_slots(kv_only, jnp.asarray(padded([(1, 2)])), jnp.int32(1), SLOTS) \
        is kv_only


# ---- the runner's batch ------------------------------------------------------------------
def new_req(req_id: str, prompt: list[int], slot: int, pages: list[int], computed: int,
            new: int) -> NewRequestData:
    return NewRequestData(req_id, prompt, [], GREEDY, (pages,), computed, new, slot)


def step(new=(), cached=None, restores=(), saves=(), finished=()) -> SchedulerOutput:
    cached = cached or CachedRequestData.empty()
    n = sum(r.num_new_tokens for r in new) + sum(cached.num_new_tokens)
    return SchedulerOutput(list(new), cached, n, [], list(finished),
                           state_restores=list(restores), state_saves=list(saves))


def batch(num_state_slots: int) -> InputBatch:
    return InputBatch(max_num_seqs=K, max_model_len=64, page_size=16, token_buckets=(16, 32),
                      vocab_size=64, num_state_slots=num_state_slots)


def test_batch_pads_the_pairs_to_max_num_seqs():
    b = batch(6)
    rows = b.update(step([new_req("a", [5] * 20, 1, [1, 2], 0, 20)], restores=[(5, 1)],
                         saves=[(1, 4), (1, 3)]), ())
    inputs = b.build(rows).inputs
    np.testing.assert_array_equal(inputs.state_restores, padded([(5, 1)]))
    np.testing.assert_array_equal(inputs.num_state_restores, [1])
    np.testing.assert_array_equal(inputs.state_saves, padded([(1, 4), (1, 3)]))
    np.testing.assert_array_equal(inputs.num_state_saves, [2])
    assert inputs.state_saves.dtype == np.int32 and inputs.num_state_saves.dtype == np.int32
    # The next step has none: count 0, same shapes.
    inputs = b.build(b.update(step(cached=CachedRequestData(["a"], [20], [0], [([],)])),
                              ())).inputs
    assert inputs.state_restores.shape == (K, 2) and inputs.num_state_restores.tolist() == [0]
    # Not a hybrid: no such inputs.
    plain = batch(0)
    inputs = plain.build(plain.update(step([new_req("a", [5] * 20, 0, [1, 2], 0, 20)]), ())).inputs
    assert inputs.state_restores is None and inputs.num_state_saves is None


@pytest.mark.parametrize("num_slots,kw,match", [
    (6, dict(saves=[(1, 2)] * (K + 1)), f"at most {K}"),
    (6, dict(restores=[(6, 1)]), "outside"),
    (6, dict(saves=[(1, 0)]), "outside"),        # the null slot
    (0, dict(saves=[(1, 2)]), "no recurrent state"),
])
def test_batch_refuses_pairs_it_cannot_carry(num_slots, kw, match):
    b = batch(num_slots)
    with pytest.raises(ValueError, match=match):
        b.update(step([new_req("a", [5] * 20, 1, [1, 2], 0, 20)], **kw), ())
    assert b.num_rows == 0   # refused before the batch changed
    with pytest.raises(ValueError, match="no rows"):
        batch(6).update(step(saves=[(1, 2)]), ())


def test_warmup_forwards_take_the_pairs_only_on_a_hybrid():
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64,
                      intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=4,
                      head_dim=16)
    runner = ModelRunner(RunnerConfig(vocab_size=512, num_pages=40, page_size=16,
                                      max_num_seqs=K, max_model_len=256,
                                      max_num_batched_tokens=32, kv_dtype=jnp.float32),
                         model=SimpleNamespace(config=cfg, dtype=jnp.float32), params={},
                         abstract=True)
    for prog in (p for p in runner.warmup_programs() if p.kind == FORWARD):
        assert prog.args()[2].state_restores is None and prog.args()[2].state_saves is None


# ---- a tiny Qwen3.5 runner -----------------------------------------------------------------
@pytest.fixture(scope="module")
def hybrid_engine(tmp_path_factory):
    path = make_tiny_checkpoint("qwen3_5", tmp_path_factory.mktemp("qwen3_5"))
    return LLM(path, dtype="float32", max_model_len=128, max_num_seqs=4,
               max_num_batched_tokens=64).engine


def slot_state(runner: ModelRunner, slot: int) -> dict[str, np.ndarray]:
    """Every linear-attention layer's rows of `slot` (layer d's is row d * slots + slot)."""
    n = runner.num_state_slots
    return {k: np.asarray(runner.kv_caches[k])[slot::n] for k in (CONV, RECURRENT)}


def test_saved_then_restored_state_equals_recomputing(hybrid_engine):
    runner = hybrid_engine.runner
    n = runner.num_state_slots
    assert n >= 5    # slots 1..4 used below; padding rows use slot 0
    for prog in (p for p in runner.warmup_programs() if p.kind == FORWARD):
        inputs = prog.args()[2]
        assert inputs.state_restores.shape == (runner.batch.max_num_seqs, 2)
        assert inputs.num_state_saves.tolist() == [0]
    rng = np.random.default_rng(1)
    shared = rng.integers(3, 256, 32).tolist()               # two full 16-token pages
    p_a = shared + rng.integers(3, 256, 8).tolist()
    p_b = shared + rng.integers(3, 256, 8).tolist()
    compiled = num_compilations()

    # Step 1: "a" (slot 1) computes its first 32 tokens; its state after them is saved
    # into snapshot slot 3.
    runner.execute(step([new_req("a", p_a, 1, [1, 2, 3], 0, 32)], saves=[(1, 3)]))
    after_a = slot_state(runner, 1)
    snap = slot_state(runner, 3)
    assert np.abs(after_a[RECURRENT]).max() > 0    # saved after the forward, not before
    for k in snap:
        np.testing.assert_array_equal(snap[k], after_a[k])

    # Step 2: "b" (slot 2) hits the 32-token prefix: a's first two pages and the snapshot
    # restored into its slot; "c" (slot 4) computes the same prompt from scratch; "a" goes on.
    out = runner.execute(step(
        [new_req("b", p_b, 2, [1, 2, 4], 32, 8), new_req("c", p_b, 4, [5, 6, 7], 0, 40)],
        cached=CachedRequestData(["a"], [32], [8], [([],)]), restores=[(3, 2)]))
    b, c = slot_state(runner, 2), slot_state(runner, 4)
    for k in b:
        np.testing.assert_allclose(b[k], c[k], rtol=1e-4, atol=1e-5, err_msg=k)
    assert out.sampled["b"] == out.sampled["c"]
    # The snapshot is intact (the restore copied it, "a" wrote its own slot).
    for k in snap:
        np.testing.assert_array_equal(slot_state(runner, 3)[k], snap[k])
    assert num_compilations() == compiled, "something compiled after warmup"
    runner.execute(step(finished=["a", "b", "c"]))


def test_without_the_restore_the_state_differs(hybrid_engine):
    """The comparison above can fail: a prefix hit whose snapshot is not restored
    starts from the slot's stale state, not the prefix's."""
    runner = hybrid_engine.runner
    rng = np.random.default_rng(2)
    prompt = rng.integers(3, 256, 40).tolist()
    runner.execute(step([new_req("a", prompt, 1, [1, 2, 3], 0, 32)]))
    runner.execute(step([new_req("b", prompt, 2, [1, 2, 4], 32, 8),
                         new_req("c", prompt, 4, [5, 6, 7], 0, 40)], finished=["a"]))
    b, c = slot_state(runner, 2), slot_state(runner, 4)
    assert not np.allclose(b[RECURRENT], c[RECURRENT], rtol=1e-4, atol=1e-5)
    runner.execute(step(finished=["b", "c"]))


# ---- XLA:TPU -----------------------------------------------------------------------------
TPU_SLOTS = 257     # Qwen3.6-27B's 48 value heads of 128 x 128, 4 linear layers here


def test_copies_compile_for_tpu_in_place():
    """The copy loop alone, state donated, on one v6e chip and split over 1x4 by heads
    (as the caches are): aliased in place, no copy of a state array, no big temporary."""
    pytest.importorskip("libtpu")
    from jax.sharding import PartitionSpec as P

    from tests.kernels.test_gated_delta_tpu_compile import whole_state_copies
    from tests.tpu_compile import compile_on_tpu
    sds = jax.ShapeDtypeStruct
    layers, hv = 4, 48
    conv = sds((layers * TPU_SLOTS, 16 * 640 * 3), jnp.bfloat16)   # Hk * G * (kernel-1)
    rec = sds((layers * TPU_SLOTS, hv, 128, 128), jnp.float32)
    i32 = jnp.int32

    def fn(conv, rec, pairs, count):
        out = copy_state_slots({CONV: conv, RECURRENT: rec}, pairs, count, TPU_SLOTS)
        return out[CONV], out[RECURRENT]

    for mesh, chips in (("1x1", 1), ("1x4", 4)):
        specs = (P(None, "model"), P(None, "model"), P(), P())
        compiled = compile_on_tpu(fn, conv, rec, sds((16, 2), i32), sds((1,), i32),
                                  mesh=mesh, donate_argnums=(0, 1), specs=specs)
        hlo = compiled.as_text()
        rec_shape = f"f32[{layers * TPU_SLOTS},{hv // chips},128,128]"
        assert rec_shape in hlo
        assert not whole_state_copies(hlo, rec_shape), mesh
        assert not whole_state_copies(hlo, f"bf16[{layers * TPU_SLOTS},{conv.shape[1] // chips}]")
        ma = compiled.memory_analysis()
        state_bytes = (math.prod(rec.shape) * 4 + math.prod(conv.shape) * 2) // chips
        assert ma.alias_size_in_bytes >= state_bytes, mesh
        # One row of each (3 MiB at 1x1) at most, never a layer's or the whole state.
        assert ma.temp_size_in_bytes <= 2 * hv // chips * 128 * 128 * 4, (mesh, ma)


def test_hybrid_forward_with_copies_compiles_for_tpu(tmp_path):
    """The engine's hybrid forward (restores, layers, saves in one donated program) for
    one v6e chip: the state arrays are updated in place, never copied whole."""
    pytest.importorskip("libtpu")
    from jaxserve.config import EngineConfig
    from jaxserve.checkpoints.model_names import load_model_config
    from jaxserve.planning.plan_compile import build_abstract_engine
    from sharding.tpu_targets import abstract_tpu_mesh, tpu_target
    from tests.sharding.test_forward_tpu_hlo import CHECKPOINTS, TARGET, whole_cache_copies
    path = make_tiny_checkpoint("qwen3_5", tmp_path, **CHECKPOINTS["qwen3_5"])
    config = EngineConfig(model=path, mesh="1x1", load_format="dummy", dtype="bfloat16",
                          num_pages=4096, max_model_len=512, max_num_seqs=16,
                          max_num_batched_tokens=256, attention_backend="pallas",
                          compilation_cache_dir=None)
    eng = build_abstract_engine(config, load_model_config(path),
                                abstract_tpu_mesh(TARGET, "1x1"),
                                tpu_target(TARGET).usable_hbm_bytes)
    caches = eng.runner.kv_caches
    prog = min((p for p in eng.programs if p.kind == FORWARD), key=lambda p: (p.tokens, -p.pages))
    assert prog.args()[2].state_saves.shape == (16, 2)
    compiled = eng.runner.lower(prog).compile()
    hlo = compiled.as_text()
    shapes = {c.shape for c in caches.values()}
    assert whole_cache_copies(hlo, shapes) == []
    ma = compiled.memory_analysis()
    assert ma.alias_size_in_bytes >= sum(c.dtype.itemsize * math.prod(c.shape)
                                         for c in caches.values())
    rec = caches[RECURRENT]
    assert ma.temp_size_in_bytes < rec.dtype.itemsize * math.prod(rec.shape)
