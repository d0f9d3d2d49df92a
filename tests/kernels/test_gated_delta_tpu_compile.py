"""ragged_gated_delta_rule(impl="pallas") compiled by the real XLA:TPU + Mosaic compilers
(libtpu's deviceless AOT compiler on this CPU), for v5e and v6e: the whole entry point,
so both the Mosaic decode-step kernel (one-token rows) and the jnp chunked prefill loop
(multi-token rows) are compiled, with the states buffer donated as the engine does.

Checked in the compiled program: the states parameter is aliased to the states output
and nothing copies the whole buffer (a copy would double the largest per-layer
array and its traffic every step), and the kernel's cost estimate reaches XLA.

Shapes: small ones, and Qwen3.6-27B's linear attention (16 key heads, 48 value heads,
Dk = Dv = 128, 257 state slots) both sharded over a 1x8 mesh as the model shards it
(2 key / 6 value heads per chip, under shard_map) and whole on 1 chip; decode buckets
of 1 and 256 rows and a prefill bucket of 2048 tokens over 16 rows (the whole-model
1x1 shape, the slowest compile, on v6e only).
"""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec

from pallas_kernels.gated_delta import ragged_gated_delta_rule, tpu
from sharding.parallel import heads_spec
from tests.tpu_compile import compile_on_tpu

SLOTS = 257
SHAPES = [  # (name, mesh, T, R, key heads, value heads, Dk, Dv, slots) at full model size
    ("small-d16", "1x1", 16, 8, 2, 4, 16, 16, 9),
    ("small-dk32-dv128", "1x1", 64, 8, 1, 3, 32, 128, 16),
    ("qwen3.6-27b-1x8-decode-256", "1x8", 256, 256, 16, 48, 128, 128, SLOTS),
    ("qwen3.6-27b-1x8-prefill-2048x16", "1x8", 2048, 16, 16, 48, 128, 128, SLOTS),
    ("qwen3.6-27b-1x8-decode-1", "1x8", 16, 1, 16, 48, 128, 128, SLOTS),
]
# The whole model on one chip (48 value heads per chip, not 6): v6e only, the kernel's
# v5e build at 256 rows is the 1x8 case's.
CASES = [(shape, target) for shape in SHAPES for target in ("tpu-v5e", "tpu-v6e")] + [
    (("qwen3.6-27b-1x1-decode-256", "1x1", 256, 256, 16, 48, 128, 128, SLOTS), "tpu-v6e")]
STATES_ARG = 5


def _args(t, r, hk, hv, dk, dv, s):
    sds, bf16, f32, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32, jnp.int32
    return (sds((t, hk, dk), bf16), sds((t, hk, dk), bf16), sds((t, hv, dv), bf16),
            sds((t, hv), f32), sds((t, hv), f32), sds((s, hv, dk, dv), f32),
            sds((r,), i32), sds((r + 1,), i32), sds((1,), i32), sds((r,), jnp.bool_))


def _entry(mesh: str):
    """The entry point as models/gated_deltanet.py runs it: on a model axis, each chip
    sees its own key-head groups (axis 1 of q, k, v, g, beta and the states)."""
    fn = functools.partial(ragged_gated_delta_rule, impl="pallas")
    if mesh == "1x1":
        return fn, None
    rep, h3, h2, h4 = PartitionSpec(), heads_spec(3, 1), heads_spec(2, 1), heads_spec(4, 1)
    specs = (h3, h3, h3, h2, h2, h4, rep, rep, rep, rep)
    return jax.shard_map(fn, in_specs=specs, out_specs=(h3, h4), check_vma=False), specs


def whole_state_copies(hlo: str, states_shape: str) -> list[str]:
    """Instructions copying an array of the states' (per-chip) shape inside HBM. XLA may
    move a small states buffer into VMEM and back (memory space S(1)): that is a
    prefetch of the same buffer, not a relayout, and is not reported."""
    found = []
    for line in hlo.splitlines():
        if not re.search(r"\s(copy|copy-start)\(", line):
            continue
        result = line.split("=", 1)[1].split(" copy")[0]
        shapes = re.findall(re.escape(states_shape) + r"\{[^}]*\}", result)
        if shapes and not any("S(" in s for s in shapes):
            found.append(line.strip()[:200])
    return found


@pytest.mark.parametrize("shape, target", CASES, ids=[f"{s[0]}-{t}" for s, t in CASES])
def test_gated_delta_compiles_for_tpu(shape, target):
    name, mesh, t, r, hk, hv, dk, dv, s = shape
    fn, specs = _entry(mesh)
    compiled = compile_on_tpu(fn, *_args(t, r, hk, hv, dk, dv, s), target=target, mesh=mesh,
                              donate_argnums=(STATES_ARG,), specs=specs)
    hlo = compiled.as_text()
    assert "tpu_custom_call" in hlo                      # the Mosaic kernel, compiled
    chips = 8 if mesh == "1x8" else 1
    hv, hk = hv // chips, hk // chips
    # Donation survived compilation: output 1 (states) aliases parameter 5 in place...
    assert re.search(r"input_output_alias=\{ \{1\}: \(%d, \{\}" % STATES_ARG, hlo), name
    # ...and no whole-buffer copy: XLA:TPU's dynamic-update-slice (prefill loop) and the
    # Mosaic kernel accept the same layout of the states.
    states_shape = f"f32[{s},{hv},{dk},{dv}]"
    assert states_shape in hlo
    assert not whole_state_copies(hlo, states_shape)
    # Nor a whole-state temporary: XLA's scratch stays far below the states' size.
    states_bytes = s * hv * dk * dv * 4
    if name.startswith("qwen"):
        assert compiled.memory_analysis().temp_size_in_bytes < states_bytes // 8
    # The kernel's cost estimate reaches XLA's cost analysis (a custom call without one
    # counts as free): at least the step's flops for every row (7 Dk Dv per row and
    # head) and the states the decode rows read and write.
    est = tpu.decode_cost(num_rows=r, num_heads=hv, head_k=dk, head_v=dv, num_slots=s)
    assert est.flops >= 7 * r * hv * dk * dv
    assert est.bytes_accessed >= 2 * min(r, s) * hv * dk * dv * 4
    cost = compiled.cost_analysis()
    assert cost["flops"] >= est.flops
    assert cost["bytes accessed"] >= est.bytes_accessed

def test_state_copy_check_sees_a_copy():
    """The copy check is live: returning the donated states both updated and as they
    were forces XLA to copy the whole buffer, and the check reports it."""
    def fn(states, x):
        return states.at[1].set(x), states
    sds = jax.ShapeDtypeStruct
    compiled = compile_on_tpu(fn, sds((SLOTS, 6, 128, 128), jnp.float32),
                              sds((6, 128, 128), jnp.float32), donate_argnums=(0,))
    assert whole_state_copies(compiled.as_text(), f"f32[{SLOTS},6,128,128]")
