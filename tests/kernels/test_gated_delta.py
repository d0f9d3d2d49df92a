"""Gated DeltaNet: the single-sequence forms against transformers' torch code, the
ragged conv1d against transformers and a numpy loop, and the ragged gated delta
rule against each request run alone (state slots, padding, chunked prefill,
compile-once, zero loop trips for pure decode)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import (causal_conv1d_fn, causal_conv1d_update,
                                                          torch_chunk_gated_delta_rule,
                                                          torch_recurrent_gated_delta_rule)

from pallas_kernels.gated_delta import (chunk_gated_delta_rule, ragged_causal_conv1d,
                                        ragged_gated_delta_rule, recurrent_gated_delta_rule)
from pallas_kernels.gated_delta.ragged import plan_chunks

F32_TOL = 1e-5


def assert_close(got, want, tol=F32_TOL, msg=""):
    """Relative to the reference's scale: errors of f32 sums grow with the magnitudes."""
    got = np.asarray(jnp.asarray(got).astype(jnp.float32))
    want = np.asarray(want, np.float32)
    assert np.isfinite(got).all(), msg
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(np.abs(want).max(), 1e-3),
                               err_msg=msg)


def make_inputs(rng, length, hk, hv, dk, dv):
    """Realistic DeltaNet inputs: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)."""
    q = rng.standard_normal((length, hk, dk)).astype(np.float32)
    k = rng.standard_normal((length, hk, dk)).astype(np.float32)
    v = rng.standard_normal((length, hv, dv)).astype(np.float32)
    a_log = np.log(rng.uniform(0.5, 16.0, hv)).astype(np.float32)
    dt_bias = rng.standard_normal(hv).astype(np.float32)
    a = rng.standard_normal((length, hv)).astype(np.float32)
    g = (-np.exp(a_log) * np.logaddexp(0.0, a + dt_bias)).astype(np.float32)
    beta = (1.0 / (1.0 + np.exp(-rng.standard_normal((length, hv))))).astype(np.float32)
    return q, k, v, g, beta


def torch_rule(fn, q, k, v, g, beta, state):
    t = lambda x: torch.from_numpy(np.array(x, np.float32))[None]
    o, s = fn(t(q), t(k), t(v), t(g), t(beta), initial_state=None if state is None else t(state),
              output_final_state=True, use_qk_l2norm_in_kernel=True)
    return o[0].numpy(), s[0].numpy()


# (L, Hk, Hv, Dk, Dv, with initial state)
SEQ_CASES = [
    (1, 2, 4, 16, 16, True),
    (5, 2, 2, 16, 16, False),
    (64, 2, 4, 32, 16, True),
    (64, 2, 2, 16, 16, False),
    (65, 2, 4, 16, 16, False),
    (150, 2, 4, 32, 16, True),
    (150, 2, 2, 16, 16, False),
    (65, 2, 2, 32, 16, True),
]


@pytest.mark.parametrize("case", SEQ_CASES, ids=lambda c: "L{}-hk{}-hv{}-dk{}-dv{}-{}".format(
    *c[:5], "init" if c[5] else "zero"))
def test_single_sequence_forms_match_transformers(case):
    length, hk, hv, dk, dv, with_state = case
    rng = np.random.default_rng(length * 100 + hv * 10 + dk)
    q, k, v, g, beta = make_inputs(rng, length, hk, hv, dk, dv)
    state = (0.3 * rng.standard_normal((hv, dk, dv))).astype(np.float32) if with_state else None
    o_chunk, s_chunk = jax.jit(chunk_gated_delta_rule)(q, k, v, g, beta, state)
    o_rec, s_rec = jax.jit(recurrent_gated_delta_rule)(q, k, v, g, beta, state)
    want_o, want_s = torch_rule(torch_chunk_gated_delta_rule, q, k, v, g, beta, state)
    rec_o, rec_s = torch_rule(torch_recurrent_gated_delta_rule, q, k, v, g, beta, state)
    assert o_chunk.dtype == jnp.float32 and s_chunk.shape == (hv, dk, dv)
    assert_close(o_chunk, want_o, msg="chunk o")
    assert_close(s_chunk, want_s, msg="chunk state")
    assert_close(o_rec, rec_o, msg="recurrent o")
    assert_close(s_rec, rec_s, msg="recurrent state")
    assert_close(o_chunk, o_rec, msg="chunk vs recurrent o")
    assert_close(s_chunk, s_rec, msg="chunk vs recurrent state")


def test_chunk_sizes_and_bfloat16():
    """Other chunk sizes give the same result; bf16 inputs give bf16 outputs that match
    the float32 computation on the same (rounded) inputs."""
    rng = np.random.default_rng(7)
    q, k, v, g, beta = make_inputs(rng, 37, 2, 4, 16, 16)
    state = (0.3 * rng.standard_normal((4, 16, 16))).astype(np.float32)
    want_o, want_s = torch_rule(torch_recurrent_gated_delta_rule, q, k, v, g, beta, state)
    for size in (8, 16):
        o, s = jax.jit(functools.partial(chunk_gated_delta_rule, chunk_size=size))(
            q, k, v, g, beta, state)
        assert_close(o, want_o, msg=f"chunk_size {size}")
        assert_close(s, want_s, msg=f"chunk_size {size}")
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)
    o, s = jax.jit(chunk_gated_delta_rule)(bf(q), bf(k), bf(v), g, beta, state)
    rounded = [np.asarray(bf(x).astype(jnp.float32)) for x in (q, k, v)]
    want_o, want_s = torch_rule(torch_chunk_gated_delta_rule, *rounded, g, beta, state)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    assert_close(o, want_o, tol=1e-2)
    assert_close(s, want_s)


# ---------------------------------------------------------------------------------------
# Ragged batches

class Batch:
    """A packed engine batch: rows = [(length, has_initial_state)], padded to T tokens and
    R rows; padding rows repeat the last query_start_loc and use the null slot 0."""

    def __init__(self, rows, *, num_tokens, num_rows, num_slots, rng):
        self.rows = rows
        lens = [n for n, _ in rows]
        assert sum(lens) <= num_tokens and len(rows) <= num_rows
        qsl = np.concatenate([[0], np.cumsum(lens)])
        self.qsl = np.concatenate([qsl, np.full(num_rows - len(rows), qsl[-1])]).astype(np.int32)
        live_slots = rng.permutation(np.arange(1, num_slots))[:len(rows)]
        self.slots = np.concatenate([live_slots, np.zeros(num_rows - len(rows), int)]).astype(np.int32)
        self.has_init = np.array([h for _, h in rows] + [False] * (num_rows - len(rows)))
        self.num_seqs = np.array([len(rows)], np.int32)

    def spans(self):
        for r, (n, h) in enumerate(self.rows):
            yield r, slice(self.qsl[r], self.qsl[r] + n), self.slots[r], h


def _nan_states(num_slots, shape):
    """Every slot NaN (so unused and fresh slots must be left alone / ignored)..."""
    return np.full((num_slots, *shape), np.nan, np.float32)


def _with_live_states(states, batch, rng):
    """... except the slots of rows that continue from a state."""
    for _, _, slot, has in batch.spans():
        if has:
            states[slot] = 0.3 * rng.standard_normal(states.shape[1:])
    return states


def _ragged_fn(chunk_size=64, impl="reference", interpret=False, decode_tokens=1):
    traces = []

    def fn(*args):
        traces.append(1)            # runs once per trace, i.e. per compilation
        return ragged_gated_delta_rule(*args, chunk_size=chunk_size, impl=impl,
                                       interpret=interpret, return_loop_trips=True,
                                       decode_tokens=decode_tokens)
    return jax.jit(fn, donate_argnums=(5,)), traces


def _run(fn, batch, inputs, states):
    q, k, v, g, beta = inputs
    return fn(q, k, v, g, beta, jnp.asarray(states), batch.slots, batch.qsl, batch.num_seqs,
              batch.has_init)


@functools.lru_cache(maxsize=None)
def _oracle_fn():
    return jax.jit(recurrent_gated_delta_rule)


def _check_against_oracle(batch, inputs, states_in, o, states_out, tol=F32_TOL):
    q, k, v, g, beta = inputs
    states_out = np.asarray(states_out)
    o = np.asarray(o)
    touched = set()
    for r, sl, slot, has in batch.spans():
        init = states_in[slot] if has else None
        want_o, want_s = _oracle_fn()(q[sl], k[sl], v[sl], g[sl], beta[sl], init)
        assert_close(o[sl], want_o, tol, msg=f"row {r} ({batch.rows[r]}) o")
        assert_close(states_out[slot], want_s, tol, msg=f"row {r} ({batch.rows[r]}) state")
        touched.add(int(slot))
    end = batch.qsl[batch.num_seqs[0]]
    assert (o[end:] == 0).all(), "padding tokens must give zeros"
    others = [s for s in range(1, states_in.shape[0]) if s not in touched]
    np.testing.assert_array_equal(states_out[others].view(np.uint32),
                                  states_in[others].view(np.uint32), "unused slots changed")


T, R, S = 400, 12, 24
HK, HV, DK, DV = 2, 4, 16, 16
MIXED = [(1, True), (150, False), (1, True), (2, False), (63, False), (30, True), (1, False),
         (64, False), (1, True), (65, False)]
DECODE = [(1, True)] * 9 + [(1, False)]


def _batch(rows, seed):
    rng = np.random.default_rng(seed)
    batch = Batch(rows, num_tokens=T, num_rows=R, num_slots=S, rng=rng)
    inputs = make_inputs(rng, T, HK, HV, DK, DV)
    # Garbage in padding tokens must not reach anything.
    end = batch.qsl[-1]
    for x in inputs:
        x[end:] = np.nan
    states = _with_live_states(_nan_states(S, (HV, DK, DV)), batch, rng)
    return batch, inputs, states


def test_ragged_mixed_then_decode_compiles_once():
    fn, traces = _ragged_fn()
    batch, inputs, states = _batch(MIXED, 0)
    o, out, trips = _run(fn, batch, inputs, states)
    _check_against_oracle(batch, inputs, states, o, out)
    # 150 -> 3 chunks, 2, 63, 30 -> 1 each, 64 -> 1, 65 -> 2
    assert int(trips) == 9 == int(plan_chunks(batch.qsl, batch.num_seqs, 64).total)

    batch, inputs, states = _batch(DECODE, 1)
    states_dev = jnp.asarray(states)
    q, k, v, g, beta = inputs
    o, out, trips = fn(q, k, v, g, beta, states_dev, batch.slots, batch.qsl, batch.num_seqs,
                       batch.has_init)
    assert states_dev.is_deleted(), "states must be donated"
    _check_against_oracle(batch, inputs, states, o, out)
    assert int(trips) == 0, "a pure-decode batch must not enter the chunk loop"
    assert len(traces) == 1, "a new batch composition must not recompile"


# Speculative decoding's verify rows (1 + k tokens) beside decodes and prefill chunks.
VERIFY = [(4, True), (1, True), (2, True), (3, False), (5, True), (1, False), (4, True),
          (17, False)]


def test_ragged_short_rows_take_the_recurrent_step():
    """decode_tokens=4: rows of up to 4 tokens go through the recurrent step token by
    token (no chunk-loop trip), longer ones through the loop; every row equals the
    oracle, and a batch of single tokens skips the later steps."""
    fn, traces = _ragged_fn(decode_tokens=4)
    batch, inputs, states = _batch(VERIFY, 3)
    o, out, trips = _run(fn, batch, inputs, states)
    _check_against_oracle(batch, inputs, states, o, out)
    assert int(trips) == 2 == int(plan_chunks(batch.qsl, batch.num_seqs, 64, 4).total)
    batch, inputs, states = _batch(DECODE, 4)
    o, out, trips = _run(fn, batch, inputs, states)
    _check_against_oracle(batch, inputs, states, o, out)
    assert int(trips) == 0 and len(traces) == 1


def test_ragged_short_rows_with_the_tpu_kernel():
    """The same through the Pallas TPU decode-step kernel (interpret mode): it is called
    once per token position, the later ones reading the state the first wrote."""
    fn, _ = _ragged_fn(impl="pallas", interpret="tpu", decode_tokens=4)
    batch, inputs, states = _batch(VERIFY[:4], 5)
    o, out, _ = _run(fn, batch, inputs, states)
    _check_against_oracle(batch, inputs, states, o, out, tol=1e-4)


def test_ragged_updates_states_in_place():
    """The compiled step aliases the donated states to the output and needs no second
    buffer of that size (a full copy would show in the temporaries)."""
    fn, _ = _ragged_fn()
    big = 512                                    # states (2 MiB) dwarf every other buffer
    args = (jax.ShapeDtypeStruct((T, HK, DK), jnp.float32),) * 2 + (
        jax.ShapeDtypeStruct((T, HV, DV), jnp.float32),
        jax.ShapeDtypeStruct((T, HV), jnp.float32), jax.ShapeDtypeStruct((T, HV), jnp.float32),
        jax.ShapeDtypeStruct((big, HV, DK, DV), jnp.float32),
        jax.ShapeDtypeStruct((R,), jnp.int32), jax.ShapeDtypeStruct((R + 1,), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((R,), bool))
    compiled = fn.lower(*args).compile()
    mem = compiled.memory_analysis()
    states_bytes = big * HV * DK * DV * 4
    assert mem.alias_size_in_bytes >= states_bytes
    assert mem.temp_size_in_bytes < states_bytes // 2, mem


def test_ragged_chunked_prefill_equals_one_call():
    """150 tokens as 40 + 70 + 40 over three steps (state carried in the slot) equals
    one 150-token step; a small chunk_size makes chunks straddle the step boundaries."""
    rng = np.random.default_rng(3)
    inputs = make_inputs(rng, 150, HK, HV, DK, DV)
    fn, traces = _ragged_fn(chunk_size=32)
    slot = 5

    def step(lo, hi, states, has_init):
        n = hi - lo
        qsl = np.array([0, n] + [n] * (R - 1), np.int32)
        slots = np.array([slot] + [0] * (R - 1), np.int32)
        pad = lambda x: np.concatenate([x[lo:hi], np.zeros((T - n, *x.shape[1:]), x.dtype)])
        o, states, _ = fn(*(pad(x) for x in inputs), states, slots, qsl,
                          np.array([1], np.int32), np.array([has_init] + [False] * (R - 1)))
        return np.asarray(o)[:n], states

    fresh = jnp.full((S, HV, DK, DV), jnp.nan, jnp.float32)
    whole_o, whole_s = step(0, 150, fresh, False)
    states = jnp.full((S, HV, DK, DV), jnp.nan, jnp.float32)
    outs = []
    for lo, hi in ((0, 40), (40, 110), (110, 150)):
        o, states = step(lo, hi, states, lo > 0)
        outs.append(o)
    assert_close(np.concatenate(outs), whole_o)
    assert_close(np.asarray(states)[slot], np.asarray(whole_s)[slot])
    want_o, want_s = _oracle_fn()(*inputs, None)
    assert_close(whole_o, want_o)
    assert_close(np.asarray(whole_s)[slot], want_s)
    assert len(traces) == 1


def test_ragged_bfloat16_and_no_live_rows():
    fn, _ = _ragged_fn()
    batch, inputs, states = _batch(MIXED[:6], 4)
    q, k, v, g, beta = inputs
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)
    o, out, _ = fn(bf(q), bf(k), bf(v), g, beta, jnp.asarray(states), batch.slots, batch.qsl,
                   batch.num_seqs, batch.has_init)
    assert o.dtype == jnp.bfloat16
    rounded = tuple(np.asarray(bf(x).astype(jnp.float32)) for x in (q, k, v)) + (g, beta)
    _check_against_oracle(batch, rounded, states, o, out, tol=2e-2)

    # num_seqs = 0: nothing is live, nothing but (possibly) the null slot is written.
    o, out, trips = fn(bf(q), bf(k), bf(v), g, beta, jnp.asarray(states), batch.slots, batch.qsl,
                       np.array([0], np.int32), batch.has_init)
    assert int(trips) == 0 and not np.asarray(o.astype(jnp.float32)).any()
    np.testing.assert_array_equal(np.asarray(out)[1:].view(np.uint32), states[1:].view(np.uint32))


def test_bad_arguments():
    batch, inputs, states = _batch(DECODE, 5)
    q, k, v, g, beta = inputs
    args = (q, k, v, g, beta, states, batch.slots, batch.qsl, batch.num_seqs, batch.has_init)
    with pytest.raises(ValueError, match="impl"):
        ragged_gated_delta_rule(*args, impl="triton")
    with pytest.raises(ValueError, match="states"):
        ragged_gated_delta_rule(*args[:5], states.astype(np.float16), *args[6:])
    with pytest.raises(ValueError, match="multiple"):
        ragged_gated_delta_rule(q[:, :1].repeat(3, 1), k[:, :1].repeat(3, 1), *args[2:])


# ---------------------------------------------------------------------------------------
# Conv1d

KC, CH = 4, 24
# (length, has_initial_state): fresh/continuing, rows shorter than Kc-1 shift old history.
CONV_ROWS = [(5, False), (1, True), (2, True), (1, False), (7, True), (2, False), (3, True)]


def _conv_oracle(x_row, w, hist):
    """Per-row numpy loop in float64: xh = hist ++ x, y_p = silu(sum_j w_j xh[p+j])."""
    xh = np.concatenate([hist, x_row]).astype(np.float64)
    width = w.shape[0] - 1
    acc = np.stack([(w * xh[p:p + width + 1]).sum(0) for p in range(x_row.shape[0])])
    return acc / (1.0 + np.exp(-acc)), xh[-width:]


def _to_slots(hist: np.ndarray) -> np.ndarray:
    """[S, Kc-1, C] histories -> the kernel's state rows [S, C * (Kc-1)] (channel-major)."""
    return np.ascontiguousarray(hist.transpose(0, 2, 1)).reshape(hist.shape[0], -1)


def _from_slots(rows) -> np.ndarray:
    rows = np.asarray(rows)
    return rows.reshape(rows.shape[0], CH, KC - 1).transpose(0, 2, 1)


def test_ragged_causal_conv1d():
    rng = np.random.default_rng(11)
    tokens, rows, slots_n = 32, 9, 16
    batch = Batch(CONV_ROWS, num_tokens=tokens, num_rows=rows, num_slots=slots_n, rng=rng)
    x = rng.standard_normal((tokens, CH)).astype(np.float32)
    x[batch.qsl[-1]:] = np.nan
    w = rng.standard_normal((KC, CH)).astype(np.float32) * 0.5
    conv_state = np.full((slots_n, KC - 1, CH), np.nan, np.float32)
    for _, _, slot, has in batch.spans():
        if has:
            conv_state[slot] = rng.standard_normal((KC - 1, CH))
    fn = jax.jit(ragged_causal_conv1d, donate_argnums=(2,))
    y, new_state = fn(x, w, jnp.asarray(_to_slots(conv_state)), batch.slots, batch.qsl,
                      batch.num_seqs, batch.has_init)
    y, new_state = np.asarray(y), _from_slots(new_state)
    wt = torch.from_numpy(w.T.copy())                     # [C, Kc], transformers' layout
    touched = set()
    for r, sl, slot, has in batch.spans():
        xr = x[sl]
        hist = conv_state[slot] if has else np.zeros((KC - 1, CH), np.float32)
        want_y, want_state = _conv_oracle(xr, w, hist)
        assert_close(y[sl], want_y, msg=f"row {r} loop")
        assert_close(new_state[slot], want_state, msg=f"row {r} state")
        xt = torch.from_numpy(xr.T.copy())[None]          # [1, C, n]
        if has:
            st = torch.from_numpy(hist.T.copy())[None]
            ty = causal_conv1d_update(xt, st, wt, None, "silu")
            assert_close(new_state[slot], st[0].numpy().T, msg=f"row {r} transformers state")
        else:
            ty = causal_conv1d_fn(xt, wt, None, activation="silu")
        assert_close(y[sl], ty[0].numpy().T, msg=f"row {r} transformers")
        touched.add(int(slot))
    assert (y[batch.qsl[-1]:] == 0).all()
    others = [s for s in range(1, slots_n) if s not in touched]
    np.testing.assert_array_equal(new_state[others].view(np.uint32),
                                  conv_state[others].view(np.uint32))

    # bf16 activations and states: same result as float32 on the rounded inputs.
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)
    y16, state16 = fn(bf(x), w, bf(_to_slots(conv_state)), batch.slots, batch.qsl, batch.num_seqs,
                      batch.has_init)
    assert y16.dtype == state16.dtype == jnp.bfloat16
    f32 = lambda a: np.asarray(a.astype(jnp.float32))
    y32, state32 = fn(f32(bf(x)), w, jnp.asarray(f32(bf(_to_slots(conv_state)))), batch.slots,
                      batch.qsl, batch.num_seqs, batch.has_init)
    live = batch.qsl[-1]
    assert_close(f32(y16)[:live], np.asarray(y32)[:live], tol=1e-2)
    np.testing.assert_array_equal(f32(state16)[list(touched)], np.asarray(state32)[list(touched)])


def test_conv_states_of_a_decode_bucket_touch_one_slot_per_token():
    """A decode step's token bucket T is far smaller than the engine's R rows: the conv
    states are gathered and scattered for the first min(R, T) rows only (each row of a
    step computes >= 1 token, so no other row is live), not R slots per layer and step
    (the TPU step-bytes accounting found R x the conv state read at batch 1)."""
    rng = np.random.default_rng(5)
    tokens, rows, slots_n = 4, 64, 80
    live = 3                                              # three decodes, one padding token
    qsl = np.minimum(np.arange(rows + 1), live).astype(np.int32)
    slots = np.zeros(rows, np.int32)
    slots[:live] = [7, 2, 11]
    has_init = np.zeros(rows, bool)
    has_init[:live] = [True, False, True]
    x = rng.standard_normal((tokens, CH)).astype(np.float32)
    w = rng.standard_normal((KC, CH)).astype(np.float32) * 0.5
    conv_state = rng.standard_normal((slots_n, KC - 1, CH)).astype(np.float32)
    args = (x, w, jnp.asarray(_to_slots(conv_state)), slots, qsl, np.array([live], np.int32),
            has_init)
    y, new_state = jax.jit(ragged_causal_conv1d)(*args)
    new_state = _from_slots(new_state)
    for r in range(live):
        hist = conv_state[slots[r]] if has_init[r] else np.zeros((KC - 1, CH), np.float32)
        want_y, want_state = _conv_oracle(x[r:r + 1], w, hist)
        assert_close(np.asarray(y)[r:r + 1], want_y, msg=f"row {r}")
        assert_close(new_state[slots[r]], want_state, msg=f"row {r} state")
    others = [s for s in range(slots_n) if s not in slots[:live]]
    np.testing.assert_array_equal(new_state[others], conv_state[others])
    # The jaxpr's gather from and scatter into the state table move T rows, not R.
    jaxpr = jax.make_jaxpr(ragged_causal_conv1d)(*args).jaxpr
    state_in = jaxpr.invars[2]
    moved = [e for e in jaxpr.eqns if e.primitive.name in ("gather", "scatter")
             and e.invars[0] is state_in]
    assert {e.primitive.name for e in moved} == {"gather", "scatter"}
    for e in moved:
        rows_moved = e.outvars[0].aval.shape[0] if e.primitive.name == "gather" \
            else e.invars[2].aval.shape[0]
        assert rows_moved == tokens, e
