"""Ragged paged attention: the reference and both Pallas kernels (in interpret mode on
CPU) against an independent float64 numpy oracle.

Each configuration compiles once (fixed T = 128 tokens, R = 8 rows) and runs the
decode / prefill / mixed scenarios of tests/kernels/rpa_cases.py: kv lengths 1,
S-1, S, S+1 and long, padded rows and tokens, pages in random order, everything
unlisted NaN. Small block sizes are forced where the defaults would fit a whole
request in one block, so multi-step and multi-item paths run, and small page-index
windows (idx_window) so the TPU kernel's window crossings run too.
Sliding windows (Gemma 4) have their own scenarios (rpa_cases.window_scenarios),
with everything before each request's window poisoned, for every impl, head dims
128 / 256 / 512, G 2 / 4 / 8, and an fp8 cache.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention import gpu, paged_loop, reference, tpu
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from tests.kernels.rpa_cases import (make_batch, oracle, scenarios, tolerance, window_scenarios,
                                     window_start)

T, R = 128, 8


def _cfg(name, dtype, kv_heads, group, head_dim, page_size, window=None, soft_cap=None,
         tpu_config=None, gpu_config=None, long=300, window_cases=False):
    """window_cases: run rpa_cases.window_scenarios instead of scenarios."""
    return pytest.param(dict(dtype=dtype, kv_heads=kv_heads, group=group, head_dim=head_dim,
                             page_size=page_size, window=window, soft_cap=soft_cap,
                             tpu_config=tpu_config, gpu_config=gpu_config, long=long,
                             window_cases=window_cases), id=name)


CONFIGS = [
    _cfg("f32-g1-h128-s16", jnp.float32, 2, 1, 128, 16,
         tpu_config=tpu.TpuConfig(block_q=8, rows=8, pages_per_step=2, kv_step=32,
                                  idx_window=4, idx_align=2)),
    _cfg("bf16-g4-h128-s16", jnp.bfloat16, 2, 4, 128, 16),
    _cfg("f32-g8-h256-s32", jnp.float32, 1, 8, 256, 32,
         tpu_config=tpu.TpuConfig(block_q=2, rows=16, pages_per_step=1, kv_step=32,
                                  idx_window=3, idx_align=1)),
    _cfg("f32-g3-h64-s64-window-softcap", jnp.float32, 2, 3, 64, 64, window=24, soft_cap=5.0,
         tpu_config=tpu.TpuConfig(block_q=4, rows=16, pages_per_step=1, kv_step=64,
                                  idx_window=4, idx_align=2)),
    _cfg("bf16-g2-h256-s256-window", jnp.bfloat16, 1, 2, 256, 256, window=100, long=700),
    _cfg("f32-g2-h512-s16", jnp.float32, 1, 2, 512, 16,
         tpu_config=tpu.TpuConfig(block_q=4, rows=8, pages_per_step=4, kv_step=64)),
]

GPU_CONFIGS = [
    _cfg("bf16-g4-h128-s16", jnp.bfloat16, 2, 4, 128, 16),
    _cfg("bf16-g1-h256-s128-window-softcap", jnp.bfloat16, 1, 1, 256, 128, window=50,
         soft_cap=5.0),
    _cfg("bf16-g8-h64-s32", jnp.bfloat16, 2, 8, 64, 32,
         gpu_config=gpu.GpuConfig(block_q=8, kv_step=32, piece=32, stages=2, num_ctas=2)),
    # head_dim 512: two column-block units per (item, kv head); 32-token steps, two per page
    _cfg("bf16-g2-h512-s64", jnp.bfloat16, 2, 2, 512, 64),
]


@functools.lru_cache(maxsize=None)
def _case(key: tuple, scenario: str):
    c = dict(key)
    reqs = (window_scenarios(c["page_size"], c["window"]) if c["window_cases"]
            else scenarios(c["page_size"], c["long"]))[scenario]
    pages_per_req = max(-(-kv // c["page_size"]) for _, kv in reqs) + 2
    batch = make_batch(reqs, page_size=c["page_size"], num_kv_heads=c["kv_heads"],
                       group=c["group"], head_dim=c["head_dim"], dtype=c["dtype"],
                       num_tokens=T, num_rows=R, pages_per_req=pages_per_req,
                       seed=("decode", "prefill", "mixed").index(scenario),
                       sliding_window=c["window"])
    want = oracle(batch, sm_scale=c["head_dim"] ** -0.5, sliding_window=c["window"],
                  soft_cap=c["soft_cap"])
    return batch, want


def _key(c: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in c.items() if not k.endswith("_config")))


def _check(fn, c: dict, names=("decode", "prefill", "mixed")):
    for name in names:
        batch, want = _case(_key(c), name)
        got = np.asarray(fn(*batch.args()).astype(jnp.float32))
        assert np.isfinite(got).all(), name
        np.testing.assert_allclose(got, want, **tolerance(c["dtype"]), err_msg=name)


def _kw(c: dict) -> dict:
    return dict(sm_scale=c["head_dim"] ** -0.5, sliding_window=c["window"], soft_cap=c["soft_cap"])


@pytest.mark.parametrize("c", CONFIGS)
def test_reference(c):
    _check(jax.jit(functools.partial(reference.ragged_paged_attention, **_kw(c))), c)


# One-query blocks for every configuration, and multi-query blocks of 4 or 16 in turn:
# each of 4 and 16 runs with both dtypes, a window and without one.
@pytest.mark.parametrize("c, block_q", [
    pytest.param(c.values[0], block_q, id=f"{c.id}-{block_q}")
    for i, c in enumerate(CONFIGS) for block_q in (1, (4, 16)[i % 2])])
def test_xla_page_loop(c, block_q):
    fn = functools.partial(paged_loop.ragged_paged_attention, **_kw(c), block_q=block_q)
    _check(jax.jit(fn), c)


@pytest.mark.parametrize("c", CONFIGS)
def test_tpu_kernel_interpret(c):
    fn = functools.partial(tpu.ragged_paged_attention_tpu, **_kw(c),
                           interpret=pltpu.InterpretParams(), config=c["tpu_config"])
    _check(jax.jit(fn), c)


@pytest.mark.parametrize("c", GPU_CONFIGS)
def test_gpu_kernel_interpret(c):
    # GPU interpret mode compiles every CTA on every call (seconds each): the first
    # configuration runs all scenarios, the others the mixed batch.
    fn = functools.partial(gpu.ragged_paged_attention_gpu, **_kw(c),
                           interpret=gpu.interpret_params(), config=c["gpu_config"])
    names = ("decode", "prefill", "mixed") if c is GPU_CONFIGS[0].values[0] else ("mixed",)
    _check(jax.jit(fn), c, names)


def test_public_entry_point():
    """impl="pallas" with interpret=True runs the TPU body; without interpret on CPU it
    falls back to the reference; interpret="gpu" runs the GPU body."""
    c = CONFIGS[1].values[0]
    batch, want = _case(_key(c), "mixed")
    tol = tolerance(c["dtype"])
    for impl, interpret in (("reference", False), ("xla", False), ("pallas", False),
                            ("pallas", True)):
        f = jax.jit(functools.partial(ragged_paged_attention, **_kw(c), impl=impl,
                                      interpret=interpret))
        got = np.asarray(f(*batch.args()).astype(jnp.float32))
        np.testing.assert_allclose(got, want, **tol, err_msg=f"{impl} {interpret}")


def test_bad_arguments():
    c = CONFIGS[0].values[0]
    batch, _ = _case(_key(c), "decode")
    args = batch.args()
    with pytest.raises(ValueError, match="impl"):
        ragged_paged_attention(*args, sm_scale=1.0, impl="triton")
    with pytest.raises(ValueError, match="interpret"):
        ragged_paged_attention(*args, sm_scale=1.0, interpret="cpu")
    with pytest.raises(ValueError, match="sliding_window"):
        ragged_paged_attention(*args, sm_scale=1.0, sliding_window=0)
    with pytest.raises(ValueError, match="query heads"):
        ragged_paged_attention(jnp.zeros((T, 3, c["head_dim"])), *args[1:], sm_scale=1.0)
    with pytest.raises(ValueError, match="Mosaic GPU kernel does not support"):
        ragged_paged_attention(*args, sm_scale=1.0, interpret="gpu")   # float32


def test_plan_items_cuts_requests_into_query_blocks():
    from pallas_kernels.ragged_paged_attention import blocks
    qsl = jnp.array([0, 1, 21, 21], jnp.int32)             # a decode, a 20-token chunk, a padding row
    meta, token_item, token_row, valid = blocks.plan_items(
        qsl, jnp.array([5, 30, 7], jnp.int32), jnp.array([2], jnp.int32), num_tokens=24,
        block_q=8, kv_step=16, page_size=16, sliding_window=None)
    meta = np.asarray(meta)
    assert meta.shape == (6, blocks.NUM_FIELDS)             # min(24, cdiv(24, 8) + 3)
    assert (meta[:, blocks.NUM_ITEMS] == 4).all()
    np.testing.assert_array_equal(meta[:4, blocks.REQ], [0, 1, 1, 1])
    np.testing.assert_array_equal(meta[:4, blocks.Q_START], [0, 1, 9, 17])
    np.testing.assert_array_equal(meta[:4, blocks.Q_COUNT], [1, 8, 8, 4])
    np.testing.assert_array_equal(meta[:4, blocks.Q_POS], [4, 10, 18, 26])
    np.testing.assert_array_equal(meta[:, blocks.NUM_STEPS], [1, 2, 2, 2, 0, 0])
    np.testing.assert_array_equal(meta[:4, blocks.NUM_PAGES], [1, 2, 2, 2])
    np.testing.assert_array_equal(np.asarray(token_item)[:21], [0] + [1] * 8 + [2] * 8 + [3] * 4)
    np.testing.assert_array_equal(np.asarray(token_row)[1:10], list(range(8)) + [0])
    assert not np.asarray(valid)[21:].any()
    # A window moves the first KV step up: the last block's first query sits at 26.
    meta_w, *_ = blocks.plan_items(
        qsl, jnp.array([5, 30, 7], jnp.int32), jnp.array([2], jnp.int32), num_tokens=24,
        block_q=8, kv_step=16, page_size=16, sliding_window=4)
    # KV_LO: the page of the window start (26 - 4 + 1 = 23 -> 16); the other blocks' 0.
    np.testing.assert_array_equal(np.asarray(meta_w)[:4, blocks.KV_LO], [0, 0, 0, 16])


# ---- sliding windows (Gemma 4: W = 512 / 1024, head dims 256 and 512) -------------------
# rpa_cases.window_scenarios against the oracle, with everything before each request's
# window start poisoned (stale page ids -- out of range, the null page, NaN pages,
# other requests' pages -- and NaN slots). Windows smaller than a page, not a multiple
# of it and a multiple of it; KV steps of several pages that the window start cuts.

WINDOW_CONFIGS = [
    _cfg("bf16-g2-h256-s16-w5", jnp.bfloat16, 2, 2, 256, 16, window=5, window_cases=True,
         tpu_config=tpu.TpuConfig(block_q=8, rows=16, pages_per_step=4, kv_step=64,
                                  idx_window=8, idx_align=2)),
    _cfg("f32-g4-h512-s16-w24", jnp.float32, 1, 4, 512, 16, window=24, window_cases=True,
         tpu_config=tpu.TpuConfig(block_q=4, rows=16, pages_per_step=2, kv_step=32,
                                  idx_window=4, idx_align=2)),
    _cfg("bf16-g8-h128-s32-w40", jnp.bfloat16, 2, 8, 128, 32, window=40, window_cases=True),
    _cfg("bf16-g4-h512-s16-w32", jnp.bfloat16, 1, 4, 512, 16, window=32, window_cases=True),
]


@pytest.mark.parametrize("c", WINDOW_CONFIGS)
def test_window_reference(c):
    _check(jax.jit(functools.partial(reference.ragged_paged_attention, **_kw(c))), c)


@pytest.mark.parametrize("block_q", [None, 4])
@pytest.mark.parametrize("c", WINDOW_CONFIGS)
def test_window_xla_page_loop(c, block_q):
    fn = functools.partial(paged_loop.ragged_paged_attention, **_kw(c), block_q=block_q)
    _check(jax.jit(fn), c)


@pytest.mark.parametrize("c", WINDOW_CONFIGS)
def test_window_tpu_kernel_interpret(c):
    """TPU interpret mode refuses an out-of-bounds DMA, so the stale out-of-range page
    ids before the window prove that no page before it is fetched."""
    fn = functools.partial(tpu.ragged_paged_attention_tpu, **_kw(c),
                           interpret=pltpu.InterpretParams(), config=c["tpu_config"])
    _check(jax.jit(fn), c)


def _gpu_supports(c: dict) -> bool:
    return gpu.supports(c["dtype"], c["head_dim"], c["kv_heads"] * c["group"], c["kv_heads"],
                        c["page_size"])


@pytest.mark.parametrize("c", [c for c in WINDOW_CONFIGS if _gpu_supports(c.values[0])])
def test_window_gpu_kernel_interpret(c):
    """The mixed batch only (GPU interpret mode compiles each CTA on each call)."""
    fn = functools.partial(gpu.ragged_paged_attention_gpu, **_kw(c),
                           interpret=gpu.interpret_params(), config=c["gpu_config"])
    _check(jax.jit(fn), c, ("mixed",))


FP8_WINDOW = dict(dtype=jnp.float32, kv_heads=2, group=2, head_dim=256, page_size=16, window=24,
                  soft_cap=None, long=300, window_cases=True)


@functools.lru_cache(maxsize=None)
def _fp8_case(scenario: str):
    """A window batch with its cache stored as float8_e4m3fn (per-entry scales, NaN
    poison kept: e4m3 has NaN) and the oracle on the dequantized values."""
    from pallas_kernels.ragged_paged_attention import dequantize, quantize
    batch, _ = _case(_key(FP8_WINDOW), scenario)
    kv_scale = jnp.array([[1 / 64, 1 / 32], [1 / 16, 1 / 128]], jnp.float32)
    per_entry = kv_scale.reshape(-1)[None, :, None, None]
    cache_q = quantize(jnp.asarray(batch.cache), per_entry, jnp.float8_e4m3fn)
    deq = dataclasses.replace(batch, cache=np.asarray(dequantize(cache_q, per_entry)))
    want = oracle(deq, sm_scale=FP8_WINDOW["head_dim"] ** -0.5, sliding_window=FP8_WINDOW["window"])
    q, _, *rest = batch.args()
    return (q, cache_q, *rest), kv_scale, want


@pytest.mark.parametrize("path", ["reference", "xla", "tpu", "gpu"])
def test_window_fp8_cache(path):
    """An fp8 cache through the public entry point (scales folded, tiles cast in the
    kernels): the TPU body computes in q's float32 here, the GPU body in f16 (bf16 q)."""
    impl, interpret = {"reference": ("reference", False), "xla": ("xla", False),
                       "tpu": ("pallas", "tpu"), "gpu": ("pallas", "gpu")}[path]
    q_dtype, tol = (jnp.bfloat16, dict(atol=3e-2, rtol=3e-2)) if path == "gpu" else \
        (jnp.float32, dict(atol=1e-5, rtol=1e-5))
    fn = jax.jit(functools.partial(ragged_paged_attention, sm_scale=FP8_WINDOW["head_dim"] ** -0.5,
                                   sliding_window=FP8_WINDOW["window"], impl=impl,
                                   interpret=interpret))
    for name in ("mixed",) if path == "gpu" else ("decode", "prefill", "mixed"):
        (q, *args), kv_scale, want = _fp8_case(name)
        got = np.asarray(fn(q.astype(q_dtype), *args, kv_scale=kv_scale).astype(jnp.float32))
        assert np.isfinite(got).all(), name
        np.testing.assert_allclose(got, want, **tol, err_msg=name)


def test_kv_steps_never_start_before_the_window():
    """Every kernel fetches the pages of steps KV_LO .. (blocks.py): KV_LO never lies a
    whole page (or, for steps shorter than a page, a whole step) before the window
    start of the item's first query, and no step is past its last query."""
    from pallas_kernels.ragged_paged_attention import blocks
    rng = np.random.default_rng(0)
    for page_size, kv_step, window in ((16, 64, 1), (16, 64, 24), (16, 16, 5), (128, 64, 1024),
                                       (128, 64, 100), (32, 256, 16)):
        plan = jax.jit(functools.partial(blocks.plan_items, num_tokens=256, block_q=8,
                                         kv_step=kv_step, page_size=page_size,
                                         sliding_window=window))
        for _ in range(4):
            q_len = rng.integers(1, 40, 6)
            kv_len = q_len + rng.integers(0, 3000, 6)
            qsl = np.concatenate([[0], np.cumsum(q_len)]).astype(np.int32)
            meta, *_ = plan(jnp.asarray(qsl), jnp.asarray(kv_len, jnp.int32),
                            jnp.array([6], jnp.int32))
            m = np.asarray(meta)[:int(np.asarray(meta)[0, blocks.NUM_ITEMS])]
            lo = np.maximum(m[:, blocks.Q_POS] - window + 1, 0)
            grain = min(page_size, kv_step)
            np.testing.assert_array_equal(m[:, blocks.KV_LO], lo // grain * grain)
            last = m[:, blocks.Q_POS] + m[:, blocks.Q_COUNT] - 1
            steps = m[:, blocks.NUM_STEPS]
            assert (m[:, blocks.KV_LO] + (steps - 1) * kv_step <= last).all()
            assert (m[:, blocks.KV_LO] + steps * kv_step > last).all()


def test_window_cost_bounds_the_pages_a_step_reads():
    """cost.pages_read with a window: no batch of T tokens over at most R rows covers
    more pages (brute force over random batches), and a decode batch whose windows
    start on the last slot of a page reaches it."""
    from pallas_kernels.ragged_paged_attention import cost
    rng = np.random.default_rng(1)
    for _ in range(300):
        S, W = int(rng.choice([1, 4, 16])), int(rng.integers(1, 70))
        R, T, P = int(rng.integers(1, 9)), int(rng.integers(1, 80)), 200
        n = int(rng.integers(1, min(R, T) + 1))
        cuts = np.sort(rng.choice(np.arange(1, T), n - 1, replace=False)) if n > 1 else []
        q = np.diff(np.concatenate([[0], cuts, [T]])).astype(int)
        pages = 0
        for q_r in q:
            kv = int(q_r + rng.integers(0, 100))          # <= P * S
            lo = max(kv - q_r - W + 1, 0)
            pages += (kv - 1) // S - lo // S + 1
        bound = cost.pages_read(num_tokens=T, num_rows=R, pages_per_req=P, page_size=S,
                                num_pages=10 ** 6, sliding_window=W)
        assert pages <= bound, (S, W, R, T, q)
    # Decodes whose window starts on a page's last slot: cdiv(W - 1, S) + 1 pages each.
    assert cost.pages_read(num_tokens=8, num_rows=8, pages_per_req=4096, page_size=16,
                           num_pages=10 ** 6, sliding_window=1024) == 8 * 65
    assert cost.pages_read(num_tokens=8, num_rows=8, pages_per_req=4096, page_size=16,
                           num_pages=100, sliding_window=1024) == 100


# On a machine with an accelerator: the compiled kernel (not interpret mode) against the
# oracle. Skipped on CPU; a GPU or TPU session runs them with the rest of this file.
_ON = jax.default_backend()


@pytest.mark.skipif(_ON not in ("gpu", "tpu"), reason="needs a GPU or TPU")
@pytest.mark.parametrize("c", CONFIGS + GPU_CONFIGS + WINDOW_CONFIGS)
def test_compiled_kernel_on_device(c):
    fn = functools.partial(ragged_paged_attention, **_kw(c), impl="pallas")
    tol = tolerance(c["dtype"])      # (f32 on GPU takes the XLA reference, same tolerance)
    for name in ("decode", "prefill", "mixed"):
        batch, want = _case(_key(c), name)
        got = np.asarray(jax.jit(fn)(*batch.args()).astype(jnp.float32))
        np.testing.assert_allclose(got, want, **tol, err_msg=name)


@pytest.mark.skipif(_ON not in ("gpu", "tpu"), reason="needs a GPU or TPU")
def test_compiled_kernel_on_device_fp8_cache():
    """The fp8 window batches through the compiled kernel (GPU: tiles cast to f16)."""
    fn = jax.jit(functools.partial(ragged_paged_attention, sm_scale=FP8_WINDOW["head_dim"] ** -0.5,
                                   sliding_window=FP8_WINDOW["window"], impl="pallas"))
    for name in ("decode", "prefill", "mixed"):
        (q, *args), kv_scale, want = _fp8_case(name)
        got = np.asarray(fn(q.astype(jnp.bfloat16), *args, kv_scale=kv_scale).astype(jnp.float32))
        np.testing.assert_allclose(got, want, atol=3e-2, rtol=3e-2, err_msg=name)
