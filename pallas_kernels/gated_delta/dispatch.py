"""ragged_gated_delta_rule: the public entry point over the reference and the kernels.

impl="reference": ragged.py with the pure-jnp decode step.
impl="pallas": the single-token (decode) rows go through a Pallas kernel chosen
  by the platform the computation is *lowered* for (lax.platform_dependent), so
  exporting for "cuda" or "tpu" works from a CPU-only machine:
    tpu  -> tpu.py (Mosaic TPU);
    cuda -> gpu.py (Mosaic GPU) when gpu.supports(Dk, Dv) (Dk % 64, Dv % 32), else
            the reference;
    anything else (cpu, rocm) -> the reference.
  interpret=True (or "tpu") runs the TPU kernel in TPU interpret mode,
  interpret="gpu" the GPU kernel in GPU interpret mode, both on CPU.
  Rows of up to decode_tokens tokens take it once per token (speculative decoding);
  longer rows (prefill chunks) still take the reference chunked while loop in every
  case: a Pallas chunk kernel is future work.
"""
from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.gated_delta import gpu, ragged, tpu

logger = logging.getLogger(__name__)

IMPLS = ("reference", "pallas")


def _pallas_decode_step(interpret, head_k: int, head_v: int) -> ragged.DecodeStep:
    if interpret in (True, "tpu"):
        from jax.experimental.pallas import tpu as pltpu
        return functools.partial(tpu.decode_step_tpu, interpret=pltpu.InterpretParams())
    gpu_ok = gpu.supports(head_k, head_v)
    if interpret == "gpu":
        if not gpu_ok:
            raise ValueError(f"the Mosaic GPU decode step does not support Dk={head_k}, Dv={head_v}")
        return functools.partial(gpu.decode_step_gpu, interpret=gpu.interpret_params())
    if interpret is not False:
        raise ValueError(f"interpret={interpret!r}: expected False, True, 'tpu' or 'gpu'")
    on_gpu = gpu.decode_step_gpu if gpu_ok else ragged.decode_step_reference
    if not gpu_ok and jax.default_backend() == "gpu":   # never a silent fallback
        logger.warning("ragged_gated_delta_rule(impl='pallas') on this GPU runs the jnp "
                       "decode step: the Mosaic GPU kernel needs Dk %% 64 == 0 and Dv %% %d "
                       "== 0, got Dk=%d, Dv=%d", gpu.COL_BLOCK, head_k, head_v)

    def step(*args):
        return lax.platform_dependent(*args, cuda=on_gpu, tpu=tpu.decode_step_tpu,
                                      default=ragged.decode_step_reference)
    return step


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
    decode_tokens: int = 1,
    impl: str = "reference",
    interpret: bool | str = False,
    return_loop_trips: bool = False,
) -> tuple[jax.Array, jax.Array] | tuple[jax.Array, jax.Array, jax.Array]:
    """The gated delta rule for every live row of a ragged batch, from states[slot]
    (zeros where not has_initial_state), writing each row's final state back to
    its slot. Returns (o [T, Hv, Dv] in v.dtype, zero on padding tokens; states),
    plus, with return_loop_trips, the multi-token while loop's trip count (tests).
    decode_tokens: rows of up to this many tokens take the recurrent (decode) step once
    per token instead of the chunked loop (speculative decoding's verify rows; static)."""
    _validate(q, k, v, g, beta, states, state_slots, query_start_loc, num_seqs,
              has_initial_state, chunk_size)
    if impl == "reference":
        step = ragged.decode_step_reference
    elif impl == "pallas":
        step = _pallas_decode_step(interpret, q.shape[-1], v.shape[-1])
    else:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")
    o, states, trips = ragged.ragged_gated_delta(
        q, k, v, g, beta, states, state_slots, query_start_loc, num_seqs, has_initial_state,
        chunk_size=chunk_size, decode_step=step, decode_tokens=decode_tokens)
    return (o, states, trips) if return_loop_trips else (o, states)
