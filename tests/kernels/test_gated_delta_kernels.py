"""The Pallas decode-step kernels of ragged_gated_delta_rule (impl="pallas"): the TPU and
GPU bodies in interpret mode on CPU against the reference on mixed, prefill-only and
empty batches, and the lowering gate (export for "cuda" and "tpu" with the kernels'
custom calls in the module) at the Qwen3.6-27B per-device shape and a small one."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels.gated_delta import ragged_gated_delta_rule
from pallas_kernels.gated_delta.ragged import decode_step_reference
from pallas_kernels.gated_delta import tpu
from tests.kernels.test_gated_delta import Batch, make_inputs

T, R, S = 96, 8, 16
MIXED = [(1, True), (40, False), (1, False), (1, True), (2, True), (1, True)]
PREFILL_ONLY = [(20, True), (30, False)]
MARKER = {"cuda": "mosaic_gpu", "tpu": "tpu_custom_call"}


def _case(rows, seed, hk, hv, dk, dv):
    rng = np.random.default_rng(seed)
    batch = Batch(rows, num_tokens=T, num_rows=R, num_slots=S, rng=rng)
    inputs = make_inputs(rng, T, hk, hv, dk, dv)
    states = (0.3 * rng.standard_normal((S, hv, dk, dv))).astype(np.float32)
    for _, _, slot, has in batch.spans():
        if not has:
            states[slot] = np.nan             # fresh rows must ignore their slot
    return batch, inputs, states


@functools.lru_cache(maxsize=None)
def _jitted(impl: str, interpret):
    return jax.jit(functools.partial(ragged_gated_delta_rule, impl=impl, interpret=interpret),
                   donate_argnums=5)


def _call(batch, inputs, states, impl, interpret=False):
    o, out = _jitted(impl, interpret)(*inputs, jnp.asarray(states), batch.slots, batch.qsl, batch.num_seqs,
                batch.has_init)
    return np.asarray(o), np.asarray(out)


def _check_against_reference(shape, interpret, tol: dict):
    """impl="pallas" equals the reference on the mixed and prefill-only batches; every
    slot no live row owns, the null slot included, is bitwise untouched."""
    for rows, seed in ((MIXED, 0), (PREFILL_ONLY, 1)):
        batch, inputs, states = _case(rows, seed, *shape)
        want_o, want_s = _call(batch, inputs, states, impl="reference")
        got_o, got_s = _call(batch, inputs, states, impl="pallas", interpret=interpret)
        np.testing.assert_allclose(got_o, want_o, **tol, err_msg=str(rows))
        live = [slot for _, _, slot, _ in batch.spans()]
        np.testing.assert_allclose(got_s[live], want_s[live], **tol)
        others = [s for s in range(S) if s not in live]
        np.testing.assert_array_equal(got_s[others].view(np.uint32),
                                      states[others].view(np.uint32))


@pytest.mark.parametrize("interpret,shape", [
    (True, (2, 4, 16, 16)),          # TPU body
    (True, (1, 3, 32, 128)),
    ("gpu", (1, 2, 64, 64)),         # Mosaic GPU body (needs Dk % 64 == 0)
], ids=["tpu-small", "tpu-dk32-dv128", "gpu-dk64"])
def test_pallas_decode_step_interpret(interpret, shape):
    _check_against_reference(shape, interpret, dict(rtol=1e-5, atol=1e-6))
    # No live rows at all: the kernel runs zero units and changes nothing.
    batch, inputs, states = _case(MIXED, 2, *shape)
    batch.num_seqs = np.array([0], np.int32)
    got_o, got_s = _call(batch, inputs, states, impl="pallas", interpret=interpret)
    assert not got_o.any()
    np.testing.assert_array_equal(got_s.view(np.uint32), states.view(np.uint32))


@pytest.mark.skipif(jax.default_backend() not in ("gpu", "tpu"), reason="needs a GPU or TPU")
@pytest.mark.parametrize("shape", [(1, 2, 64, 64), (2, 6, 128, 128)],
                         ids=["small", "qwen3.6-27b-per-device"])
def test_compiled_decode_step_on_device(shape):
    """The compiled kernel (not interpret mode) against the reference on the device
    (passed on an H200 with jax 0.11.2)."""
    _check_against_reference(shape, False, dict(rtol=1e-4, atol=1e-5))


def test_tpu_kernel_head_blocks():
    """Several head blocks (grid axis 0) with decode rows scattered among other rows."""
    rng = np.random.default_rng(5)
    rows, hv, dk, dv = 6, 4, 8, 128
    slots = np.array([4, 2, 7, 0, 5, 1], np.int32)
    write = np.array([False, True, True, False, True, False])
    init = np.array([True, True, False, False, True, True])
    states = rng.standard_normal((9, hv, dk, dv)).astype(np.float32)
    qd = rng.standard_normal((rows, hv, dk)).astype(np.float32)
    kd = rng.standard_normal((rows, hv, dk)).astype(np.float32)
    vd = rng.standard_normal((rows, hv, dv)).astype(np.float32)
    gd = -rng.uniform(0, 2, (rows, hv)).astype(np.float32)
    bd = rng.uniform(0, 1, (rows, hv)).astype(np.float32)
    args = (slots, write, qd, kd, vd, gd, bd, init)
    want_o, want_s = jax.jit(decode_step_reference)(jnp.asarray(states), *args)
    from jax.experimental.pallas import tpu as pltpu
    tpu_step = functools.partial(tpu.decode_step_tpu, interpret=pltpu.InterpretParams())
    old = tpu.VMEM_BLOCK_BYTES
    tpu.VMEM_BLOCK_BYTES = dk * dv * 4            # one head per block: 4 head blocks
    try:
        assert tpu.heads_per_block(hv, dk, dv) == 1
        got_o, got_s = jax.jit(tpu_step)(jnp.asarray(states), *args)
    finally:
        tpu.VMEM_BLOCK_BYTES = old
    got_s, want_s = np.asarray(got_s), np.asarray(want_s)
    np.testing.assert_allclose(np.asarray(got_o)[write], np.asarray(want_o)[write], rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(got_s[slots[write]], want_s[slots[write]], rtol=1e-5, atol=1e-6)
    others = [s for s in range(states.shape[0]) if s not in slots[write]]
    np.testing.assert_array_equal(got_s[others].view(np.uint32), states[others].view(np.uint32))


def _specs(hk, hv, dk, dv, dtype=jnp.bfloat16):
    f32, i32 = jnp.float32, jnp.int32
    sds = jax.ShapeDtypeStruct
    return (sds((T, hk, dk), dtype), sds((T, hk, dk), dtype), sds((T, hv, dv), dtype),
            sds((T, hv), f32), sds((T, hv), f32), sds((S, hv, dk, dv), f32), sds((R,), i32),
            sds((R + 1,), i32), sds((1,), i32), sds((R,), bool))


def _export(platform, specs):
    fn = jax.jit(functools.partial(ragged_gated_delta_rule, impl="pallas"), donate_argnums=5)
    return export.export(fn, platforms=[platform])(*specs).mlir_module()


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("shape", [(2, 6, 128, 128), (2, 4, 64, 64)],
                         ids=["qwen3.6-27b-per-device", "small"])
def test_pallas_exports(platform, shape):
    text = _export(platform, _specs(*shape))
    assert MARKER[platform] in text
    # The kernel updates the states buffer in place: its custom call aliases it.
    assert "output_operand_aliases" in text


def test_unsupported_gpu_shape_takes_the_reference():
    """Dk = 16 has no WGMMA register layout: cuda falls back to the XLA reference; TPU
    still lowers its kernel."""
    specs = _specs(2, 4, 16, 16)
    assert "mosaic_gpu" not in _export("cuda", specs)
    assert "tpu_custom_call" in _export("tpu", specs)
    with pytest.raises(ValueError, match="does not support"):
        ragged_gated_delta_rule(*(jnp.zeros(s.shape, s.dtype) for s in specs), impl="pallas",
                                interpret="gpu")
    with pytest.raises(ValueError, match="interpret"):
        ragged_gated_delta_rule(*(jnp.zeros(s.shape, s.dtype) for s in specs), impl="pallas",
                                interpret="cpu")
