"""Ragged causal depthwise conv1d + SiLU with per-slot conv states (the DeltaNet's
short convolution over the q|k|v channels).

For a row with history h (conv_state[slot] if has_initial_state, else zeros;
Kc-1 entries, oldest first; a slot stores them channel-major, [C, Kc-1] flattened,
so that a tensor-parallel device's channels are one contiguous range of the row and
the state is one wide row per slot, which the gather and scatter by slot leave in
its plain layout on TPU) and tokens x_0..x_{n-1}, let xh = h ++ x. Token p
gives y_p = silu(sum_j w[j] xh[p + j]), j = 0..Kc-1, i.e. torch's conv1d with
padding Kc-1 (fresh rows) or on cat(conv_state, x) (continuing rows), as
transformers' causal_conv1d_fn / causal_conv1d_update do. The row's new conv
state is the last Kc-1 entries of xh.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.held_dtypes import as_held, as_values
from pallas_kernels.sorted_search import bucket_of


def token_rows(query_start_loc: jax.Array, num_seqs: jax.Array, num_tokens: int,
               num_rows: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per packed token: its row, its position inside the row, and whether it is live."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    row = bucket_of(query_start_loc[1:], t)
    row = jnp.minimum(row, num_rows - 1)
    valid = t < query_start_loc[num_seqs[0]]
    return row, t - query_start_loc[row], valid


def ragged_causal_conv1d(x: jax.Array, weight: jax.Array, conv_state: jax.Array,
                         state_slots: jax.Array, query_start_loc: jax.Array, num_seqs: jax.Array,
                         has_initial_state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [T, C]; weight [Kc, C]; conv_state [S, C * (Kc-1)]; state_slots int32[R];
    query_start_loc int32[R+1]; num_seqs int32[1]; has_initial_state bool[R].
    Returns (y [T, C] in x.dtype, zero on padding tokens; conv_state with every
    live row's slot replaced by its last Kc-1 inputs). Math in float32."""
    num_tokens, channels = x.shape
    taps = weight.shape[0]
    width = taps - 1
    num_slots, num_rows = conv_state.shape[0], state_slots.shape[0]
    if taps < 2 or weight.shape != (taps, channels):
        raise ValueError(f"weight {weight.shape}: expected [Kc >= 2, {channels}]")
    if conv_state.ndim != 2 or conv_state.shape[1] != channels * width:
        raise ValueError(f"conv_state {conv_state.shape}: expected [S, {channels * width}] "
                         f"(channels x {width} taps)")
    if query_start_loc.shape != (num_rows + 1,) or has_initial_state.shape != (num_rows,):
        raise ValueError(f"query_start_loc {query_start_loc.shape} / has_initial_state "
                         f"{has_initial_state.shape}: expected ({num_rows + 1},), ({num_rows},)")
    # Every row of a step computes at least one token (the KV cache manager refuses 0),
    # so only the first min(R, T) rows can be live: the states are gathered and
    # scattered for those alone (a 16-token decode bucket touches 16 slots, not R).
    num_rows = min(num_rows, num_tokens)
    qsl = query_start_loc[:num_rows + 1].astype(jnp.int32)
    num_seqs = num_seqs.astype(jnp.int32)
    slots = state_slots[:num_rows].astype(jnp.int32)
    has_initial_state = has_initial_state[:num_rows]
    row, pos, valid = token_rows(qsl, num_seqs, num_tokens, num_rows)

    # Only R histories are read (a small gather); fresh rows see zeros whatever the slot holds.
    hist = as_values(conv_state[slots]).reshape(num_rows, channels, width).transpose(0, 2, 1)  # [R, W, C]
    hist = jnp.where(has_initial_state[:, None, None], hist, jnp.zeros_like(hist))
    flat_hist = hist.astype(jnp.float32).reshape(num_rows * width, channels)

    xf = x.astype(jnp.float32)
    wf = weight.astype(jnp.float32)
    acc = xf * wf[width]
    for m in range(1, taps):                  # tap m reads xh[p + W - m], i.e. m tokens back
        shifted = jnp.concatenate([jnp.zeros((m, channels), jnp.float32), xf[:num_tokens - m]])
        from_hist = flat_hist[row * width + jnp.clip(width + pos - m, 0, width - 1)]
        acc = acc + wf[width - m] * jnp.where((pos >= m)[:, None], shifted, from_hist)
    y = jnp.where(valid[:, None], jax.nn.silu(acc), 0.0).astype(x.dtype)

    # New state entry i = xh[n + i]: a token when n + i >= W, else the old history.
    lens = qsl[1:] - qsl[:-1]
    idx = lens[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]     # [R, W]
    tok = jnp.clip(qsl[:-1, None] + idx - width, 0, num_tokens - 1)
    old = jnp.take_along_axis(hist, jnp.clip(idx, 0, width - 1)[:, :, None], axis=1)
    new = jnp.where((idx >= width)[:, :, None], x[tok].astype(old.dtype), old)
    live = jnp.arange(num_rows) < num_seqs[0]
    dst = jnp.where(live, slots, num_slots)                             # out of range: dropped
    new = new.transpose(0, 2, 1).reshape(num_rows, channels * width)
    # (held as bits on CPU: pallas_kernels/held_dtypes.py)
    return y, conv_state.at[dst].set(as_held(new, conv_state.dtype), mode="drop")
