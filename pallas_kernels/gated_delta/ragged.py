"""The gated delta rule over one ragged engine batch, with per-request state slots.

Rows are split by their token count in this step:
  - one token (decode, or a 1-token prompt): all such rows together in ONE
    vectorised recurrent step (gather their states, update, scatter). This is
    the serving hot path; `decode_step` is pluggable so impl="pallas" can put
    a kernel here;
  - up to `decode_tokens` tokens (speculative decoding's rows verifying drafts):
    the same step once per token position, every row that has a token there
    together (skipped on device when none has), each reading the state the
    previous one wrote to the slot;
  - more tokens (prefill chunks): a lax.while_loop over the batch's
    request-aligned chunks (up to chunk_size tokens of one row each). The trip
    count is computed on device, so a pure-decode batch runs zero iterations
    and one compiled program serves every batch composition. Each iteration
    reads the row's state from its slot (zeros on the row's first chunk when
    it has no initial state), runs the chunked form on the zero-padded chunk
    and writes the state back, so state is carried through the slot.
The states buffer is only ever updated with scatters / dynamic_update_slice,
so a donated buffer is updated in place. Head counts come from the shapes:
under shard_map each device sees its own head group.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.gated_delta import reference

# decode_step(states, slots, write, qd, kd, vd, gd, bd, has_initial_state)
#   -> (o [R, Hv, Dv] float32, states): one recurrent step for each row r with
#   write[r]; prepared float32 inputs [R, Hv, ...]; rows with write[r] False must
#   leave their slots untouched.
DecodeStep = Callable[..., tuple[jax.Array, jax.Array]]


class ChunkPlan(NamedTuple):
    lens: jax.Array          # int32[R] tokens per row this step (0 for rows >= num_seqs)
    decode: jax.Array        # bool[R] rows with exactly one token
    num_chunks: jax.Array    # int32[R] chunks of multi-token rows (0 otherwise)
    chunk_end: jax.Array     # int32[R] cumsum of num_chunks
    total: jax.Array         # int32[] while-loop trip count


def plan_chunks(query_start_loc: jax.Array, num_seqs: jax.Array, chunk_size: int,
                decode_tokens: int = 1) -> ChunkPlan:
    """decode: the rows of 1..decode_tokens tokens (the recurrent steps take them)."""
    qsl = query_start_loc.astype(jnp.int32)
    num_rows = qsl.shape[0] - 1
    live = jnp.arange(num_rows) < num_seqs.astype(jnp.int32)[0]
    lens = jnp.where(live, qsl[1:] - qsl[:-1], 0)
    decode = (lens >= 1) & (lens <= decode_tokens)
    num_chunks = jnp.where(lens > decode_tokens, -(-lens // chunk_size), 0)
    chunk_end = jnp.cumsum(num_chunks, dtype=jnp.int32)
    return ChunkPlan(lens, decode, num_chunks, chunk_end, chunk_end[-1])


def decode_step_reference(states: jax.Array, slots: jax.Array, write: jax.Array, qd: jax.Array,
                          kd: jax.Array, vd: jax.Array, gd: jax.Array, bd: jax.Array,
                          has_initial_state: jax.Array) -> tuple[jax.Array, jax.Array]:
    num_slots = states.shape[0]
    s0 = states[slots]                                                  # [R, Hv, Dk, Dv]
    s0 = jnp.where(has_initial_state[:, None, None, None], s0, 0.0)    # select: slots may hold NaN
    o, s1 = reference.recurrent_step(s0, qd, kd, vd, gd, bd)
    return o, states.at[jnp.where(write, slots, num_slots)].set(s1, mode="drop")


def ragged_gated_delta(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                       beta: jax.Array, states: jax.Array, state_slots: jax.Array,
                       query_start_loc: jax.Array, num_seqs: jax.Array,
                       has_initial_state: jax.Array, *, chunk_size: int, decode_step: DecodeStep,
                       decode_tokens: int = 1) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(o, states, while-loop trip count); argument conventions in dispatch.py."""
    num_tokens = q.shape[0]
    _, num_v, head_v = v.shape
    qsl = query_start_loc.astype(jnp.int32)
    slots = state_slots.astype(jnp.int32)
    has_init = has_initial_state.astype(bool)
    plan = plan_chunks(qsl, num_seqs, chunk_size, decode_tokens)
    f32 = lambda x: x.astype(jnp.float32)
    o = jnp.zeros((num_tokens, num_v, head_v), v.dtype)

    def recurrent_step(j: int, o, states):
        """Token j of every short row that has one, in one vectorised step (clipped for
        padding rows, whose results are dropped)."""
        tok = jnp.minimum(qsl[:-1] + j, num_tokens - 1)
        write = plan.decode & (plan.lens > j)
        qd, kd = reference.prepare_qk(q[tok], k[tok], num_v)
        # From the second token on, the state is the one the step before wrote.
        od, states = decode_step(states, slots, write, qd, kd, f32(v[tok]), f32(g[tok]),
                                 f32(beta[tok]), has_init if j == 0 else write)
        return o.at[jnp.where(write, tok, num_tokens)].set(od.astype(v.dtype),
                                                           mode="drop"), states

    o, states = recurrent_step(0, o, states)
    for j in range(1, decode_tokens):
        o, states = lax.cond(jnp.any(plan.decode & (plan.lens > j)),
                             lambda o, states, j=j: recurrent_step(j, o, states),
                             lambda o, states: (o, states), o, states)

    # Multi-token rows: chunk i belongs to the first row whose chunk_end exceeds i.
    offs = jnp.arange(chunk_size, dtype=jnp.int32)

    def body(carry):
        i, o, states = carry
        row = jnp.sum(plan.chunk_end <= i).astype(jnp.int32)
        j = i - (plan.chunk_end[row] - plan.num_chunks[row])             # chunk index inside the row
        start = qsl[row] + j * chunk_size
        valid = offs < jnp.minimum(chunk_size, plan.lens[row] - j * chunk_size)
        idx = jnp.where(valid, start + offs, 0)
        # Padding positions become q = k = v = 0, beta = g = 0 (exact, reference.py);
        # selects, not multiplies, so NaN in other rows' tokens cannot leak in.
        qc, kc = reference.prepare_qk(q[idx], k[idx], num_v)
        mask = lambda x: jnp.where(valid.reshape((-1,) + (1,) * (x.ndim - 1)), f32(x), 0.0)
        qc, kc, vc, gc, bc = (mask(x) for x in (qc, kc, v[idx], g[idx], beta[idx]))
        slot = slots[row]
        state = lax.dynamic_index_in_dim(states, slot, 0, keepdims=False)
        state = jnp.where((j > 0) | has_init[row], state, 0.0)
        heads_first = lambda x: jnp.moveaxis(x, 0, 1)
        oc, state = reference.chunk_step(state, *(heads_first(x) for x in (qc, kc, vc, gc, bc)))
        states = lax.dynamic_update_index_in_dim(states, state, slot, 0)
        o = o.at[jnp.where(valid, start + offs, num_tokens)].set(
            heads_first(oc).astype(o.dtype), mode="drop")
        return i + 1, o, states

    trips, o, states = lax.while_loop(lambda c: c[0] < plan.total, body,
                                      (jnp.int32(0), o, states))
    return o, states, trips
