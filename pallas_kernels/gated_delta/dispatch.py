"""ragged_gated_delta_rule: the public entry point over the reference and the kernels.

impl="reference": ragged.py with the pure-jnp decode step.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta import ragged

IMPLS = ("reference",)


def _validate(q, k, v, g, beta, states, state_slots, query_start_loc, num_seqs,
              has_initial_state, chunk_size):
    if q.ndim != 3 or k.shape != q.shape:
        raise ValueError(f"q {q.shape} / k {k.shape}: expected [T, Hk, Dk]")
    num_tokens, num_k, head_k = q.shape
    if v.ndim != 3 or v.shape[0] != num_tokens:
        raise ValueError(f"v {v.shape}: expected [{num_tokens}, Hv, Dv]")
    _, num_v, head_v = v.shape
    if num_v % num_k:
        raise ValueError(f"{num_v} value heads is not a multiple of {num_k} key heads")
    if g.shape != (num_tokens, num_v) or beta.shape != (num_tokens, num_v):
        raise ValueError(f"g {g.shape} / beta {beta.shape}: expected {(num_tokens, num_v)}")
    if states.ndim != 4 or states.shape[1:] != (num_v, head_k, head_v) or states.dtype != jnp.float32:
        raise ValueError(f"states {states.shape} {states.dtype}: expected float32 [S, {num_v}, "
                         f"{head_k}, {head_v}]")
    rows = state_slots.shape[0]
    if state_slots.shape != (rows,) or has_initial_state.shape != (rows,):
        raise ValueError(f"state_slots {state_slots.shape} / has_initial_state "
                         f"{has_initial_state.shape}: expected [R]")
    if query_start_loc.shape != (rows + 1,):
        raise ValueError(f"query_start_loc {query_start_loc.shape}: expected ({rows + 1},)")
    if num_seqs.shape != (1,):
        raise ValueError(f"num_seqs {num_seqs.shape}: expected (1,)")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size}: must be >= 1")


def ragged_gated_delta_rule(
    q: jax.Array,                   # [T, Hk, Dk]
    k: jax.Array,                   # [T, Hk, Dk]
    v: jax.Array,                   # [T, Hv, Dv]
    g: jax.Array,                   # [T, Hv] log decay (<= 0)
    beta: jax.Array,                # [T, Hv]
    states: jax.Array,              # float32 [S, Hv, Dk, Dv], slot 0 = null slot
    state_slots: jax.Array,         # int32[R]
    query_start_loc: jax.Array,     # int32[R + 1]
    num_seqs: jax.Array,            # int32[1]
    has_initial_state: jax.Array,   # bool[R]
    *,
    chunk_size: int = 64,
    impl: str = "reference",
    interpret: bool = False,
    return_loop_trips: bool = False,
):
    """The gated delta rule for every live row of a ragged batch, from states[slot]
    (zeros where not has_initial_state), writing each row's final state back to
    its slot. Returns (o [T, Hv, Dv] in v.dtype, zero on padding tokens; states),
    plus, with return_loop_trips, the multi-token while loop's trip count (tests)."""
    _validate(q, k, v, g, beta, states, state_slots, query_start_loc, num_seqs,
              has_initial_state, chunk_size)
    if impl == "reference":
        step = ragged.decode_step_reference
    else:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")
    del interpret
    o, states, trips = ragged.ragged_gated_delta(
        q, k, v, g, beta, states, state_slots, query_start_loc, num_seqs, has_initial_state,
        chunk_size=chunk_size, decode_step=step)
    return (o, states, trips) if return_loop_trips else (o, states)
