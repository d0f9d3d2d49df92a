"""The batched LoRA op against a dense per-token reference, alone and on a 1x2 mesh."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from models.lora.ops import (MIN_CPU_WINDOW, SPLIT_IN, SPLIT_OUT, _windows, cpu_window,
                             dense_reference, group_by_slot, lora_delta, sharded_lora_delta)
from sharding.mesh import MODEL, make_mesh

T, I, O, R, S = 13, 32, 48, 8, 4   # 3 adapters + slot 0


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((T, I), np.float32)
    a = rng.standard_normal((S, R, I), np.float32)
    b = rng.standard_normal((S, R, O), np.float32)
    a[0], b[0] = 0, 0                  # slot 0: no adapter
    a[2, 5:], b[2, 5:] = 0, 0          # slot 2: a rank-5 adapter padded to R
    scales = np.array([0.0, 2.0, 0.5, 1.25], np.float32)
    # Mixed and unsorted, slot 3 absent from neither, slot 0 among them.
    slots = np.array([2, 0, 1, 1, 3, 0, 2, 2, 1, 0, 3, 1, 0], np.int32)
    return x, slots, a, b, scales


def test_grouped_delta_matches_per_token_reference(case):
    x, slots, a, b, scales = case
    got = jax.jit(lambda x, s, a, b, c: lora_delta(x, group_by_slot(s, S), a, b, c))(
        x, slots, a, b, scales)
    want = dense_reference(x, slots, a, b, scales)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(got)[slots == 0]), "slot 0 tokens must get no delta"
    assert np.all(np.abs(np.asarray(got)[slots != 0]).sum(-1) > 0)


def test_grouped_delta_absent_slots_and_one_adapter(case):
    x, _, a, b, scales = case
    slots = np.full(T, 3, np.int32)     # every token one adapter; slots 0-2 empty groups
    got = lora_delta(jnp.asarray(x), group_by_slot(jnp.asarray(slots), S), a, b, scales)
    np.testing.assert_allclose(got, scales[3] * (x @ a[3].T) @ b[3], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split", [SPLIT_OUT, SPLIT_IN])
def test_sharded_delta_on_1x2_mesh(case, split):
    """Column-parallel (B split on O: delta split on O) and row-parallel (x and A split
    on I: delta replicated) on a 1x2 mesh of the fake CPU devices, same numbers."""
    x, slots, a, b, scales = case
    mesh = make_mesh("1x2", jax.devices()[:2])
    put = lambda v, *spec: jax.device_put(v, NamedSharding(mesh, PartitionSpec(*spec)))
    if split == SPLIT_OUT:
        args = put(x), put(a), put(b, None, None, MODEL)
        want_spec = PartitionSpec(None, MODEL)
    else:
        args = put(x, None, MODEL), put(a, None, None, MODEL), put(b)
        want_spec = PartitionSpec()
    xs, as_, bs = args
    with jax.set_mesh(mesh):
        fn = jax.jit(lambda x, s, a, b, c: sharded_lora_delta(x, group_by_slot(s, S), a, b, c, split))
        got = fn(xs, put(slots), as_, bs, put(scales))
    assert got.sharding.is_equivalent_to(NamedSharding(mesh, want_spec), 2), got.sharding
    np.testing.assert_allclose(got, dense_reference(x, slots, a, b, scales), rtol=1e-5, atol=1e-5)


def test_bad_split_is_refused(case):
    x, slots, a, b, scales = case
    with pytest.raises(ValueError, match="split"):
        sharded_lora_delta(x, group_by_slot(slots, S), a, b, scales, "rows")


@pytest.mark.parametrize("num_tokens,num_slots,seed", [(64, 17, 0), (5, 17, 1), (256, 2, 2),
                                                       (33, 5, 3)])
def test_cpu_tiles_and_ragged_dot_agree_with_the_gather(num_tokens, num_slots, seed):
    """Every form (platform_dependent picks the ragged dot or the CPU's two, _cpu_add one
    of those per step), each adding the delta into the base projection's output, against
    the per-token gather, for skewed slot mixes: many slots for few tokens, one adapter,
    empty slots."""
    from models.lora.ops import _all_slots_add, _cpu_add, _ragged_add, _windowed_add
    rng = np.random.default_rng(seed)
    i, o, r = 24, 40, 4
    x = jnp.asarray(rng.standard_normal((num_tokens, i)), jnp.float32)
    a = jnp.asarray(rng.standard_normal((num_slots, r, i)), jnp.float32).at[0].set(0)
    b = jnp.asarray(rng.standard_normal((num_slots, r, o)), jnp.float32).at[0].set(0)
    scales = jnp.asarray(rng.uniform(0.5, 2, num_slots), jnp.float32)
    slots = jnp.asarray(rng.integers(0, num_slots, num_tokens) * (rng.random(num_tokens) < 0.8),
                        jnp.int32)
    y = jnp.asarray(rng.standard_normal((num_tokens, o)), jnp.float32)   # the base's output
    want = y + dense_reference(x, slots, a, b, scales)
    groups = group_by_slot(slots, num_slots)
    for form in (_windowed_add, _all_slots_add, _cpu_add, _ragged_add):
        np.testing.assert_allclose(jax.jit(form)(y, x, groups, a, b, scales), want, rtol=1e-4,
                                   atol=1e-4, err_msg=form.__name__)


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("num_contract", [1, 2])
def test_einsum_adds_the_float_delta_to_a_quantized_base(method, num_contract):
    """models/layers.Einsum with an int8 / fp8 kernel and float LoRA stacks: its output
    is the quantized base's plus the grouped delta of its (merged) input."""
    from models.layers import Einsum
    from models.lora.ops import LORA, LORA_STEP
    from models.quant_config import WeightQuant
    rng = np.random.default_rng(4)
    shape, eq = ((8, 4, 16), "TNH,NHE->TE") if num_contract == 2 else ((32, 4, 6), "TE,ENH->TNH")
    in_dim, out_dim = int(np.prod(shape[:num_contract])), int(np.prod(shape[num_contract:]))
    mod = Einsum(eq, shape, (None,) * 3, num_contract, quant=WeightQuant(method))
    x = jnp.asarray(rng.standard_normal((7, *shape[:num_contract])), jnp.float32)
    import flax.linen as nn
    params = nn.unbox(mod.init(jax.random.key(0), x)["params"])
    params = {**params, "kernel": jnp.asarray(rng.integers(-100, 100, shape)).astype(
        params["kernel"].dtype), "kernel_scale": params["kernel_scale"] * 0.01}
    s, r = 3, 4
    a = jnp.asarray(rng.standard_normal((s, r, in_dim)), jnp.float32).at[0].set(0)
    b = jnp.asarray(rng.standard_normal((s, r, out_dim)), jnp.float32).at[0].set(0)
    scales = jnp.asarray([1.0, 0.5, 2.0], jnp.float32)
    slots = jnp.asarray([2, 0, 1, 1, 2, 0, 2], jnp.int32)
    groups = group_by_slot(slots, s)
    base = mod.apply({"params": params}, x)
    got = mod.apply({"params": params, LORA: {"a": a, "b": b},
                     LORA_STEP: {**groups._asdict(), "scales": scales}}, x)
    want = dense_reference(x.reshape(7, -1), slots, a, b, scales).reshape(base.shape)
    np.testing.assert_allclose(got - base, want, rtol=1e-4, atol=1e-4)
    assert np.abs(np.asarray(want)).max() > 1e-2


def test_cpu_form_reads_each_slot_once_and_copies_no_stack():
    """The CPU form's work follows the adapter rows: its temporaries hold a few [T, I+O]
    rows, never a gathered copy of the stacks (the earlier tiled form gathered one A and
    B per tile: 32 tiles of [I, R] and [R, O] for 16 tokens over 17 slots); and a step
    with only base rows gives zeros."""
    t, s, i, o, r = 16, 17, 256, 256, 16
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((t, i)), jnp.float32)
    a = jnp.asarray(rng.standard_normal((s, r, i)), jnp.float32).at[0].set(0)
    b = jnp.asarray(rng.standard_normal((s, r, o)), jnp.float32).at[0].set(0)
    scales = jnp.ones(s, jnp.float32)
    fn = jax.jit(lambda x, ids, a, b, c: lora_delta(x, group_by_slot(ids, s), a, b, c))
    ids = jnp.asarray(np.arange(t) % (s - 1) + 1, jnp.int32)   # 16 adapters, one row each
    temp = fn.lower(x, ids, a, b, scales).compile().memory_analysis().temp_size_in_bytes
    assert temp < a.nbytes // 2, (temp, a.nbytes)
    np.testing.assert_allclose(fn(x, ids, a, b, scales), dense_reference(x, ids, a, b, scales),
                               rtol=1e-4, atol=1e-4)
    assert not np.any(np.asarray(fn(x, jnp.zeros(t, jnp.int32), a, b, scales)))


def test_cpu_form_widens_narrow_stacks_instead_of_rounding_the_activations():
    """--lora-dtype bfloat16 under a float32 model on CPU: the adapters are stored in
    bfloat16 (as asked) and the delta is that of those very weights on the float32
    activations (XLA:CPU has no bf16 arithmetic: widening is exact; the earlier form
    rounded the activations and the low-rank products to bf16 too: errors up to 1 % of
    the largest delta)."""
    rng = np.random.default_rng(6)
    t, s, i, o, r = 24, 4, 64, 48, 8
    x = jnp.asarray(rng.standard_normal((t, i)), jnp.float32)
    a = jnp.asarray(rng.standard_normal((s, r, i)), jnp.bfloat16).at[0].set(0)
    b = jnp.asarray(rng.standard_normal((s, r, o)), jnp.bfloat16).at[0].set(0)
    scales = jnp.asarray([0, 2.0, 0.5, 1.0], jnp.float32)
    ids = jnp.asarray(rng.integers(0, s, t), jnp.int32)
    got = jax.jit(lambda x, ids: lora_delta(x, group_by_slot(ids, s), a, b, scales))(x, ids)
    assert got.dtype == jnp.float32
    want = dense_reference(x, ids, a.astype(jnp.float32), b.astype(jnp.float32), scales)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * float(jnp.abs(want).max()))


def test_cpu_windows_hold_at_least_eight_rows():
    """One adapter's 16 decode rows among 17 slots run as two windows, not sixteen of one
    row (each window is a loop iteration of its own: docs/LORA.md, run 6); a step
    shorter than the floor is one window."""
    assert MIN_CPU_WINDOW == 8 and cpu_window(16, 17) == 8
    one_adapter = group_by_slot(jnp.ones(16, jnp.int32), 17)
    assert int(_windows(one_adapter, 16, 17).count) == 2
    spread = group_by_slot(jnp.arange(16, dtype=jnp.int32) % 16 + 1, 17)   # 16 adapters
    assert int(_windows(spread, 16, 17).count) == 16
    short = _windows(group_by_slot(jnp.ones(4, jnp.int32), 17), 4, 17)
    assert (short.rows, int(short.count)) == (4, 1)


def test_cpu_form_takes_one_pass_over_all_slots_for_many_adapters_of_few_rows():
    """Four adapters over four slots, a few decode rows each, take the all-slots pass (two
    plain dots, no loop) rather than a window iteration per adapter; one window of one
    adapter's rows keeps the windowed loop (the cond's predicate, below); base rows alone
    get nothing. Never compiled in: a float32 step over ALL_SLOTS_MAX_TOKENS, stacks
    narrower than the activations, stacks that weigh more than ALL_SLOTS_MAX_WEIGHT of
    the base kernel (read off the compiled program: the pass's [T, S * R] products).
    Each gives the per-token gather's delta."""
    from models.lora.ops import (ALL_SLOTS_MAX_TOKENS, ALL_SLOTS_MAX_WEIGHT,
                                 ALL_SLOTS_MIN_WINDOWS, _cpu_add)
    s, i, o, r = 5, 96, 96, 2
    assert s * r * (i + o) <= ALL_SLOTS_MAX_WEIGHT * i * o
    rng = np.random.default_rng(7)

    def stacks(i, o, dtype=jnp.float32):
        a = jnp.asarray(rng.standard_normal((s, r, i)), jnp.float32).at[0].set(0)
        b = jnp.asarray(rng.standard_normal((s, r, o)), jnp.float32).at[0].set(0)
        return a.astype(dtype), b.astype(dtype)

    a, b = stacks(i, o)
    scales = jnp.asarray(rng.uniform(0.5, 2, s), jnp.float32)

    def compiled(ids, a=a, b=b):
        (t,), i, o = ids.shape, a.shape[-1], b.shape[-1]
        x = jnp.asarray(rng.standard_normal((t, i)), jnp.float32)
        y = jnp.zeros((t, o), jnp.float32)
        fn = jax.jit(lambda y, x, ids: _cpu_add(y, x, group_by_slot(ids, s), a, b, scales))
        want = dense_reference(x, ids, a.astype(jnp.float32), b.astype(jnp.float32), scales)
        np.testing.assert_allclose(fn(y, x, ids), want, rtol=1e-4,
                                   atol=1e-4 * float(jnp.abs(want).max()))
        return f"f32[{t},{s * r}]" in fn.lower(y, x, ids).compile().as_text()

    many = lambda ids: bool(_windows(group_by_slot(ids, s), ids.shape[0], s).count
                            >= ALL_SLOTS_MIN_WINDOWS * s)
    spread = jnp.asarray(np.arange(16) % 4 + 1, jnp.int32)           # 4 adapters
    assert many(spread) and compiled(spread)
    few = jnp.asarray([3] * 6 + [0] * 10, jnp.int32)                  # one window's rows
    assert not many(few) and compiled(few)
    assert not np.any(np.asarray(jax.jit(lambda x, ids: _cpu_add(
        jnp.zeros((16, o)), x, group_by_slot(ids, s), a, b, scales))(
        jnp.ones((16, i)), jnp.zeros(16, jnp.int32))))                # base rows only
    big = ALL_SLOTS_MAX_TOKENS + 8
    assert not compiled(jnp.asarray(np.arange(big) % 4 + 1, jnp.int32))
    assert not compiled(spread, *stacks(i, o, jnp.bfloat16))          # narrow stacks
    assert not compiled(spread, *stacks(16, 16))                      # heavy stacks


def test_cpu_form_16bit_stacks_under_16bit_dots_take_the_pass_at_any_size():
    """bfloat16 stacks and activations (a bf16 model on a CPU with native bf16 dots:
    --lora-dtype auto, and Einsum hands the adapters the input its base dot rounded):
    the all-slots pass whatever the step's size and adapter count (its dots run as fast
    as the base's there; the bf16 windows were slower: docs/LORA.md, run 8), a single
    adapter's rows past ALL_SLOTS_MAX_TOKENS included; the delta is the per-token
    gather's on the same bf16 numbers (bf16 rounding of the low-rank products allowed);
    base rows alone still run nothing. Float32 stacks at that size keep the loop; bf16
    ones too heavy for the float32 rule still take the pass."""
    from models.lora.ops import ALL_SLOTS_MAX_TOKENS, _cpu_add
    s, i, o, r, t = 5, 96, 96, 2, ALL_SLOTS_MAX_TOKENS + 8
    rng = np.random.default_rng(9)
    a = jnp.asarray(rng.standard_normal((s, r, i)), jnp.bfloat16).at[0].set(0)
    b = jnp.asarray(rng.standard_normal((s, r, o)), jnp.bfloat16).at[0].set(0)
    scales = jnp.asarray(rng.uniform(0.5, 2, s), jnp.float32)
    x = jnp.asarray(rng.standard_normal((t, i)), jnp.bfloat16)
    y = jnp.zeros((t, o), jnp.float32)

    def run(ids, a=a, b=b, x=x):
        fn = jax.jit(lambda y, x, ids: _cpu_add(y, x, group_by_slot(ids, s), a, b, scales))
        return fn(y, x, ids), f"f32[{t},{s * r}]" in fn.lower(y, x, ids).compile().as_text()

    f32 = lambda v: v.astype(jnp.float32)
    for ids in (np.where(np.arange(t) < 40, 3, 0), np.arange(t) % 4 + 1):   # 1 and 4 adapters
        ids = jnp.asarray(ids, jnp.int32)
        got, took_pass = run(ids)
        want = dense_reference(f32(x), ids, f32(a), f32(b), scales)
        assert took_pass and got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * float(jnp.abs(want).max()))
    base_only, _ = run(jnp.zeros(t, jnp.int32))
    assert not np.any(np.asarray(base_only))
    _, took_pass = run(ids, f32(a), f32(b), f32(x))
    assert not took_pass
    # Slots heavier than ALL_SLOTS_MAX_WEIGHT of the kernel: still the pass in bf16 (its
    # dots beat the bf16 windows at every width measured: docs/LORA.md, run 8).
    heavy = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16).at[0].set(0)
    xs = jnp.asarray(rng.standard_normal((t, 16)), jnp.bfloat16)
    ah, bh = heavy(s, r, 16), heavy(s, r, 16)
    got = jax.jit(lambda x, ids: _cpu_add(jnp.zeros((t, 16)), x, group_by_slot(ids, s), ah, bh,
                                          scales))
    assert f"f32[{t},{s * r}]" in got.lower(xs, ids).compile().as_text()
    want = dense_reference(f32(xs), ids, f32(ah), f32(bh), scales)
    np.testing.assert_allclose(got(xs, ids), want, rtol=2e-2, atol=2e-2 * float(jnp.abs(want).max()))


def test_einsum_gives_the_adapters_the_input_its_16bit_dot_took():
    """A float32 model's projection with a bf16 [out, in] kernel (native bf16 dots,
    models/registry.matmul_dtype) and bf16 stacks: the adapters read the input rounded to
    bf16 as the base dot did, so the CPU's all-slots pass runs (its products in the
    compiled program) and the delta is that of the rounded input."""
    from models.layers import KERNEL_OUT_IN, Einsum
    from models.lora.ops import LORA, LORA_STEP
    s, i, o, r, t = 5, 96, 96, 2, 24
    rng = np.random.default_rng(10)
    x = jnp.asarray(rng.standard_normal((t, i)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((o, i)) * 0.1, jnp.bfloat16)
    a = jnp.asarray(rng.standard_normal((s, r, i)), jnp.bfloat16).at[0].set(0)
    b = jnp.asarray(rng.standard_normal((s, r, o)), jnp.bfloat16).at[0].set(0)
    scales = jnp.asarray(rng.uniform(0.5, 2, s), jnp.float32)
    ids = jnp.asarray(np.arange(t) % 4 + 1, jnp.int32)
    module = Einsum("ti,io->to", (i, o), ("embed", "mlp"), dtype=jnp.float32)
    variables = {"params": {KERNEL_OUT_IN: w}, LORA: {"a": a, "b": b},
                 LORA_STEP: {**group_by_slot(ids, s)._asdict(), "scales": scales}}
    fn = jax.jit(module.apply)
    got = fn(variables, x)
    xr = x.astype(jnp.bfloat16).astype(jnp.float32)
    want = xr @ w.astype(jnp.float32).T + dense_reference(
        xr, ids, a.astype(jnp.float32), b.astype(jnp.float32), scales)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * float(jnp.abs(want).max()))
    assert f"f32[{t},{s * r}]" in fn.lower(variables, x).compile().as_text()


@pytest.mark.parametrize("split", [SPLIT_OUT, SPLIT_IN])
def test_all_slots_pass_on_1x2_mesh(split):
    """The all-slots pass under a model axis: B split on O (column-parallel), or x and A
    split on I with the [T, S * R] products summed across it (row-parallel); the pass is
    in the compiled program and the delta is the per-token gather's."""
    s, i, o, r, t = 5, 192, 192, 2, 16   # each device's half still light enough for the pass
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((t, i)), jnp.float32)
    a = jnp.asarray(rng.standard_normal((s, r, i)), jnp.float32).at[0].set(0)
    b = jnp.asarray(rng.standard_normal((s, r, o)), jnp.float32).at[0].set(0)
    scales = jnp.asarray(rng.uniform(0.5, 2, s), jnp.float32)
    ids = jnp.asarray(np.arange(t) % 4 + 1, jnp.int32)
    mesh = make_mesh("1x2", jax.devices()[:2])
    put = lambda v, *spec: jax.device_put(v, NamedSharding(mesh, PartitionSpec(*spec)))
    if split == SPLIT_OUT:
        args = put(x), put(a), put(b, None, None, MODEL)
    else:
        args = put(x, None, MODEL), put(a, None, None, MODEL), put(b)
    with jax.set_mesh(mesh):
        fn = jax.jit(lambda x, ids, a, b, c: sharded_lora_delta(x, group_by_slot(ids, s), a, b, c,
                                                                split))
        got = fn(args[0], put(ids), *args[1:], put(scales))
        hlo = fn.lower(args[0], put(ids), *args[1:], put(scales)).compile().as_text()
    assert f"f32[{t},{s * r}]" in hlo
    want = dense_reference(x, ids, a, b, scales)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(jnp.abs(want).max()))
