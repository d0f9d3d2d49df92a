"""The gated delta decode step (one token per row) for Hopper, written with Pallas Mosaic GPU.

Work unit = (decode row, value head, column block of CB state columns): the
update of S[:, cols] only needs kv[cols] = sum_k S[k, cols] k[k], so column
blocks are independent. Units are dealt round-robin to persistent CTAs (one
warpgroup each); the unit count n * Hv * (Dv / CB) is read on device, so rows
that are not decode rows cost nothing and their slots are never touched.

Per unit, registers only (a [Dk, CB] float32 tile in the WGMMA register layout,
Dk along rows): S is loaded straight from the slot in global memory, then
    S = exp(g) S;  kv = sum_k S[k, :] k[k];  delta = beta (v - kv)
    S = S + k[:, None] delta[None, :];  o = sum_k S[k, :] q[k]
k and q arrive in the row-vector layout (broadcast along columns), v / delta /
o in the column-vector layout; the reduction over Dk crosses warps (Mosaic GPU
reduces through shared-memory scratch). S is stored back to the same slot: the
states buffer is a Ref operand, so the kernel updates it in place (the custom
call aliases it to its output).

Verified on CPU: GPU interpret mode (the same body, except that the loads are
plain ref reads: layouts only matter when lowering) and the export for "cuda"
(the full Pallas -> Mosaic GPU lowering: layouts, broadcasts, cross-warp
reductions). Unverified without a GPU: PTX compilation, performance (global
loads are synchronous and not pipelined through TMA; CTAS_PER_SM untuned).
Why not Pallas-Triton: Mosaic GPU is the project's choice, and its lowering and
interpret mode both run on CPU, so CPU CI checks this kernel.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mosaic_gpu_params import compiler_params

if TYPE_CHECKING:   # for hints only: jax keeps the class private (see interpret_params)
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

COL_BLOCK = 32          # [Dk, 32] f32 tile: 32 registers per thread at Dk = 128
# Persistent CTAs per SM (one warpgroup each, few registers and little shared
# memory, so several fit): untuned, no GPU has run this kernel yet.
CTAS_PER_SM = 4


def supports(head_k: int, head_v: int) -> bool:
    """WGMMA register layout: rows a multiple of 64, columns of 8."""
    return head_k % 64 == 0 and head_v % COL_BLOCK == 0


def default_num_ctas() -> int:
    """CTAS_PER_SM x the local GPU's SMs; an H100 SXM's 132 SMs when there is none."""
    dev = jax.devices()[0]
    sms = int(getattr(dev, "core_count", 0) or 132) if dev.platform == "gpu" else 132
    return CTAS_PER_SM * sms


def _kernel(n_ref, order_ref, slot_ref, init_ref, decay_ref, beta_ref, q_ref, k_ref, v_ref,
            s_ref, o_ref, *, num_ctas: int, num_heads: int, col_blocks: int, interpreted: bool):
    cta = lax.axis_index("cta")
    per_row = num_heads * col_blocks
    units = n_ref[0] * per_row
    head_k = s_ref.shape[-2]
    tile = plgpu.Layout.WGMMA
    rows_l, cols_l = tile.reduce(1), tile.reduce(0)
    load = ((lambda ref, layout: ref[...]) if interpreted
            else (lambda ref, layout: plgpu.load(ref, (), layout=layout, optimized=False)))

    @pl.loop(cta, units, step=num_ctas)
    def _unit(u):
        i = lax.div(u, per_row)
        h = lax.div(lax.rem(u, per_row), col_blocks)
        cols = pl.ds(lax.rem(u, col_blocks) * COL_BLOCK, COL_BLOCK)
        row = order_ref[i]
        flat = row * num_heads + h
        state = s_ref.at[slot_ref[row], h, :, cols]
        s = load(state, tile)
        s = jnp.where(init_ref[row] != 0, s, 0.0) * decay_ref[flat]
        k = lax.broadcast_in_dim(load(k_ref.at[row, h], rows_l), (head_k, COL_BLOCK), [0])
        q = lax.broadcast_in_dim(load(q_ref.at[row, h], rows_l), (head_k, COL_BLOCK), [0])
        kv = jnp.sum(s * k, axis=0)
        delta = (load(v_ref.at[row, h, cols], cols_l) - kv) * beta_ref[flat]
        s = s + k * lax.broadcast_in_dim(delta, (head_k, COL_BLOCK), [1])
        state[...] = s
        o_ref.at[row, h, cols][...] = jnp.sum(s * q, axis=0)


def decode_step_gpu(states: jax.Array, slots: jax.Array, write: jax.Array, qd: jax.Array,
                    kd: jax.Array, vd: jax.Array, gd: jax.Array, bd: jax.Array,
                    has_initial_state: jax.Array, *,
                    interpret: bool | InterpretGPUParams = False, num_ctas: int | None = None
                    ) -> tuple[jax.Array, jax.Array]:
    """ragged.DecodeStep for Hopper. interpret: False or GPU interpret-mode params."""
    num_rows, num_heads, head_k = qd.shape
    head_v = vd.shape[-1]
    if not supports(head_k, head_v):
        raise ValueError(f"the Mosaic GPU decode step needs Dk % 64 == 0 and Dv % {COL_BLOCK} "
                         f"== 0, got Dk={head_k}, Dv={head_v}")
    col_blocks = head_v // COL_BLOCK
    # Interpret mode runs every CTA separately: keep it to two.
    num_ctas = num_ctas or (2 if interpret else default_num_ctas())
    order = jnp.argsort(jnp.logical_not(write), stable=True).astype(jnp.int32)
    n = jnp.sum(write, dtype=jnp.int32).reshape(1)
    states_ref = jax.new_ref(states, memory_space=plgpu.GMEM)
    kernel = functools.partial(_kernel, num_ctas=num_ctas, num_heads=num_heads,
                               col_blocks=col_blocks, interpreted=bool(interpret))
    # pl.kernel, not plgpu.kernel: the latter's custom_vmap wrapper rejects Ref operands.
    o = pl.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((num_rows, num_heads, head_v), jnp.float32),
        mesh=plgpu.Mesh(grid=(num_ctas,), grid_names=("cta",)),
        compiler_params=compiler_params(),
        interpret=interpret,
    )(n, order, slots.astype(jnp.int32), has_initial_state.astype(jnp.int32),
      jnp.exp(gd).reshape(-1), bd.reshape(-1), qd, kd, vd, states_ref)
    return o, jax.freeze(states_ref)


def interpret_params() -> InterpretGPUParams:
    """Parameters for Pallas GPU interpret mode (private in jax 0.10.2)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()
