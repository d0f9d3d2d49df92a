"""The gated delta decode step (one token per row) for TPU, written with Pallas Mosaic TPU.

Memory-bound: each decode row reads its state [Hv, Dk, Dv] (float32) once and
writes it once, in place in the donated states buffer (input_output_aliases).

Grid (head blocks, R), rows innermost. Scalar prefetch puts the decode count n,
the row order (decode rows first), the slots and the has_initial_state flags in
SMEM; the index maps send grid step i to row order[min(i, n - 1)] and its state
block (slot, head block). Steps i >= n repeat the block of step n - 1: Pallas
neither re-reads nor writes back a block whose index does not change between
consecutive steps, so those steps cost nothing and non-decode rows' slots are
never touched (with n = 0, step 0 copies one row's block through unchanged:
nothing is modified). Each row's decay exp(g) and beta for the head block come
in as a small SMEM block of the pipeline, like q/k/v in VMEM.

SMEM (int32 / float32 words; R rows, Hv value heads, hb heads per block):
    n [1], order [R], slots [R], has_initial_state [R]   scalar prefetch: 12 R + 4 B
    decay/beta block [2, hb], double-buffered             16 hb B
At R = 256 that is 3 KiB whatever the model. decay and beta were whole [R * Hv]
scalar-prefetch arrays before (8 R Hv B: 96 KiB at 256 rows x 48 heads), which
libtpu rejects from R = 2048 at Hv = 64 (1.02 MiB of 1 MiB SMEM).

Per head, in float32 on the VPU (no MXU: f32 matmuls would need multi-pass
precision for what is a rank-1 update):
    S = exp(g) S;  kv = sum_k S[k, :] k[k];  delta = beta (v - kv)
    S = S + k[:, None] delta[None, :];  o = sum_k S[k, :] q[k]
The column form k[:, None] (Dk along sublanes) is built from the row form by an
eye-masked lane reduction (exact: one non-zero per sum), which avoids relying
on vector transposes of narrow tiles.

Verified without a TPU: TPU interpret mode on CPU, and compilation by libtpu's
XLA:TPU + Mosaic (deviceless AOT, tests/kernels/test_gated_delta_tpu_compile.py)
for v5e and v6e up to the Qwen3.6-27B shapes, with the donated states buffer
updated in place (no whole-buffer copy in the compiled HLO). Unverified without
a TPU: numerics on hardware, performance, and the head-block size choice
(VMEM_BLOCK_BYTES).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# One state block (in and out, double-buffered: four live) stays well inside the
# default scoped VMEM of every TPU generation.
VMEM_BLOCK_BYTES = 1024 * 1024
NUM_SCALAR_PREFETCH = 4        # n, order, slots, has_initial_state
# The scalar-prefetch arrays grow with R only (12 R bytes); stay far below the 1 MiB
# SMEM of v5e / v6e, which XLA's own scalars share.
SMEM_BUDGET_BYTES = 256 * 1024


def smem_limit_error(num_rows: int) -> str | None:
    """Why a decode step over num_rows rows would not fit its SMEM budget, with the fix;
    None when it does."""
    need = 12 * num_rows + 4
    if need <= SMEM_BUDGET_BYTES:
        return None
    return (f"{num_rows} rows: the gated-delta kernel's scalar-prefetch metadata ({need} B) "
            f"exceeds its TPU SMEM budget of {SMEM_BUDGET_BYTES} B; lower max_num_seqs to "
            f"{(SMEM_BUDGET_BYTES - 4) // 12} or fewer")


def heads_per_block(num_heads: int, head_k: int, head_v: int) -> int:
    per_head = head_k * head_v * 4
    best = 1
    for hb in range(1, num_heads + 1):
        if num_heads % hb == 0 and hb * per_head <= VMEM_BLOCK_BYTES:
            best = hb
    return best


def _kernel(n_ref, order_ref, slot_ref, init_ref, gb_ref, q_ref, k_ref, v_ref, s_ref,
            o_ref, s_out, *, block_heads: int):
    del slot_ref                                  # used by the index maps only
    i = pl.program_id(1)
    n = n_ref[0]

    @pl.when(i < n)
    def _step():
        row = order_ref[i]
        head_k, head_v = s_ref.shape[-2:]
        eye = (lax.broadcasted_iota(jnp.int32, (head_k, head_k), 0)
               == lax.broadcasted_iota(jnp.int32, (head_k, head_k), 1))
        # Fresh rows start from zeros whatever the slot holds (a select: it may be NaN).
        keep = jnp.full((head_k, head_v), init_ref[row], jnp.int32) != 0
        column = lambda r: jnp.sum(jnp.where(eye, r, 0.0), axis=1, keepdims=True)   # [1,D] -> [D,1]
        for h in range(block_heads):
            s = jnp.where(keep, s_ref[h], 0.0) * gb_ref[0, h]              # decay exp(g)
            k_col = column(k_ref[pl.ds(h, 1), :])
            q_col = column(q_ref[pl.ds(h, 1), :])
            kv = jnp.sum(s * k_col, axis=0, keepdims=True)                # [1, Dv]
            delta = (v_ref[pl.ds(h, 1), :] - kv) * gb_ref[1, h]           # beta
            s = s + k_col * delta
            s_out[h] = s
            o_ref[pl.ds(h, 1), :] = jnp.sum(s * q_col, axis=0, keepdims=True)

    @pl.when((i == 0) & (n == 0))
    def _pass_through():
        s_out[...] = s_ref[...]


def decode_cost(*, num_rows: int, num_heads: int, head_k: int, head_v: int,
                num_slots: int) -> pl.CostEstimate:
    """What one call can do at most, from the shapes (the decode count n is only known
    on device): every row a decode row. Per (row, head): the state is read and written
    once (float32), q, k, v, o once each, plus decay and beta; flops are the step's own
    arithmetic, 7 Dk Dv + 2 Dv (decay 1, S^T k 2, rank-1 update 2, S^T q 2 per state
    element; delta 2 per column), not the kernel's layout work (the eye-masked column
    sums). exp(g) is computed by XLA before the call: no transcendentals here."""
    rows_heads = num_rows * num_heads
    state = min(num_rows, num_slots) * num_heads * head_k * head_v * 4
    vectors = rows_heads * (2 * head_k + 2 * head_v + 2) * 4
    return pl.CostEstimate(flops=rows_heads * (7 * head_k * head_v + 2 * head_v),
                           transcendentals=0,
                           bytes_accessed=2 * state + vectors + (3 * num_rows + 1) * 4)


def decode_step_tpu(states: jax.Array, slots: jax.Array, write: jax.Array, qd: jax.Array,
                    kd: jax.Array, vd: jax.Array, gd: jax.Array, bd: jax.Array,
                    has_initial_state: jax.Array, *,
                    interpret: bool | pltpu.InterpretParams = False
                    ) -> tuple[jax.Array, jax.Array]:
    """ragged.DecodeStep for TPU. interpret: False or pltpu.InterpretParams()."""
    num_rows, num_heads, head_k = qd.shape
    head_v = vd.shape[-1]
    why = smem_limit_error(num_rows)
    if why:
        raise ValueError(why)
    hb = heads_per_block(num_heads, head_k, head_v)
    nb = num_heads // hb
    order = jnp.argsort(jnp.logical_not(write), stable=True).astype(jnp.int32)
    n = jnp.sum(write, dtype=jnp.int32).reshape(1)
    # [R, Hv, D] -> [NB, R, hb, D]: a block's second-minor dim is then a full dim.
    blocked = lambda x: x.reshape(num_rows, nb, hb, x.shape[-1]).transpose(1, 0, 2, 3)
    # decay and beta per (row, head) as [NB, R, 2, hb]: streamed into SMEM one row's
    # block at a time, so SMEM does not grow with R x Hv (see SMEM above).
    gb = jnp.stack([jnp.exp(gd), bd], axis=1).reshape(num_rows, 2, nb, hb).transpose(2, 0, 1, 3)

    def pick(i, n_ref, order_ref):
        return order_ref[jnp.minimum(i, jnp.maximum(n_ref[0] - 1, 0))]

    def vec_map(j, i, n_ref, order_ref, *_):
        return j, pick(i, n_ref, order_ref), 0, 0

    def state_map(j, i, n_ref, order_ref, slot_ref, *_):
        return slot_ref[pick(i, n_ref, order_ref)], j, 0, 0

    vec = lambda d: pl.BlockSpec((None, None, hb, d), vec_map)
    gb_spec = pl.BlockSpec((None, None, 2, hb), vec_map, memory_space=pltpu.SMEM)
    state_spec = pl.BlockSpec((None, hb, head_k, head_v), state_map)
    o, states = pl.pallas_call(
        functools.partial(_kernel, block_heads=hb),
        out_shape=(jax.ShapeDtypeStruct((nb, num_rows, hb, head_v), jnp.float32),
                   jax.ShapeDtypeStruct(states.shape, states.dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=NUM_SCALAR_PREFETCH,
            grid=(nb, num_rows),
            in_specs=[gb_spec, vec(head_k), vec(head_k), vec(head_v), state_spec],
            out_specs=[vec(head_v), state_spec],
        ),
        input_output_aliases={NUM_SCALAR_PREFETCH + 4: 1},
        # Rows must run in order on one core: steps past n rely on the previous block.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        # Names the kernel and its row bucket in the compiled program (the step-bytes
        # accounting scales the estimate to the rows a step decodes).
        metadata={"jaxserve_kernel": "gated_delta_decode", "rows": str(num_rows)},
        cost_estimate=decode_cost(num_rows=num_rows, num_heads=num_heads, head_k=head_k,
                                  head_v=head_v, num_slots=states.shape[0]),
        interpret=interpret,
    )(n, order, slots.astype(jnp.int32), has_initial_state.astype(jnp.int32),
      gb, blocked(qd), blocked(kd), blocked(vd), states)
    return o.transpose(1, 0, 2, 3).reshape(num_rows, num_heads, head_v), states
