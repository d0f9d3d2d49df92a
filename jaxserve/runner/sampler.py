"""Token sampling on device for a batch of R rows (one row per request).

One program per (R, V) shape serves every kind of row: greedy and sampled rows, top-k
/ top-p / min-p, logprobs and stop tokens held back are per-row arrays and device-side
branches (``lax.cond`` on "does any row need it"), so a batch pays only for what its
rows ask for and changing settings never recompiles. Two static flags: ``penalties``
(they need each row's token history, an int32[R, L] input) and ``greedy`` (a batch of
greedy rows only: the argmax alone).

Order (as vLLM): raw logprobs (log_softmax of the model logits) -> penalties ->
greedy rows take the argmax; sampling rows divide by temperature, then min_p,
top_k and top_p (each renormalising what is left) become one threshold per row,
and a Gumbel-max draw picks the token.

Thresholds without sorting the vocabulary (accelerators): the TOP_CANDIDATES most
likely tokens of each row (lax.top_k) decide top-k / top-p whenever the kept set ends
inside them (the common case: top_k <= TOP_CANDIDATES, or a nucleus of fewer tokens);
min_p alone needs only the row's maximum. Only when some row's kept set may reach past
the candidates does the step sort the whole vocabulary (same thresholds, computed
exactly). XLA:CPU lowers lax.top_k to a full sort, so on CPU the sort is taken at once.

Batch invariance: a row's token depends only on its logits, its settings and its
key ``fold_in(PRNGKey(seed), step)``, step = the index of the token being sampled.
The filters are applied as a per-row logit threshold in vocabulary order (sorting
only finds the threshold), so rows that filter and rows that do not draw
their noise the same way, whatever else is in the batch.

Penalty inputs (penalties=True only): ``penalty_token_ids`` int32[R, L] holds
each row's prompt ids then output ids, padded with V (dropped by the scatter),
and ``num_prompt_tokens`` int32[R] splits them; the [R, V] counts are built on
device by scatter-add, so the host ships O(R*L) ids, not O(R*V) masks. L is a
static bucket: pass a fixed ``penalty_len`` (e.g. max_model_len) to avoid one
compile per bucket.
"""

from __future__ import annotations

from typing import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp

from jaxserve.runner.sampling_tensors import SamplingTensors
from jaxserve.sampling_params import MAX_LOGPROBS, SAMPLING_EPS, SamplingParams

# Most likely tokens per row that top-k / top-p are decided on (without sorting the
# vocabulary): top_k up to this, and any nucleus of fewer tokens, is exact on them.
TOP_CANDIDATES = 256
_KEY_IMPL = "threefry2x32"


@flax.struct.dataclass
class SamplerOutput:
    token_ids: jax.Array  # int32[R]
    # Column 0 is the sampled token, 1.. the top tokens (ids -1 / logprob -inf past the
    # vocabulary when V < K); zeros when no row of the batch wants logprobs.
    # K = sample's num_logprobs (the engine's max_logprobs).
    logprobs: jax.Array  # f32[R, K + 1]
    logprob_token_ids: jax.Array  # int32[R, K + 1]
    sampled_rank: jax.Array  # int32[R]; 1 = most likely


def allowed_tokens(token_mask: jax.Array, vocab_size: int) -> jax.Array:
    """uint32[R, W] bitmask -> bool[R, V]: shifts and a reshape (no gather), so XLA fuses
    it into the select that applies it."""
    bits = (token_mask[:, :, None] >> jnp.arange(32, dtype=jnp.uint32)) & jnp.uint32(1)
    return bits.reshape(token_mask.shape[0], -1)[:, :vocab_size].astype(jnp.bool_)


def only_greedy(params: Sequence[SamplingParams]) -> bool:
    """Whether a batch can take the greedy program (argmax, no logprobs, no penalties)."""
    return all(p.is_greedy and p.logprobs is None and not p.has_penalties for p in params)


def apply_penalties(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """Repetition penalty on prompt+output tokens, frequency/presence on output tokens."""
    num_rows, vocab = logits.shape
    ids = t.penalty_token_ids  # [R, L]
    is_output = jnp.arange(ids.shape[1])[None, :] >= t.num_prompt_tokens[:, None]
    row = jnp.arange(num_rows)[:, None]
    zeros = jnp.zeros((num_rows, vocab), jnp.int32)
    seen = zeros.at[row, ids].add(1, mode="drop") > 0  # [R, V]
    counts = zeros.at[row, ids].add(is_output.astype(jnp.int32), mode="drop")  # [R, V]
    rep = t.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - t.frequency_penalty[:, None] * counts.astype(logits.dtype)
    return logits - t.presence_penalty[:, None] * (counts > 0).astype(logits.dtype)


def _keep_sorted(desc: jax.Array, k: jax.Array, t: SamplingTensors,
                 whole: jax.Array | None = None) -> jax.Array:
    """Which of a row's most likely tokens the filters keep: desc [R, C] holds each row's
    C largest scaled logits in descending order, k its top_k (vocab = off). whole: for
    rows with k > C, the mass min_p keeps over the whole row (sum of exp(logit - max));
    None when desc is the whole row. -> bool[R, C], a prefix of each row."""
    pos = jnp.arange(desc.shape[-1])[None, :]
    keep = pos < k[:, None]
    # min_p: p_i >= min_p * p_max  <=>  logit_i - logit_max >= log(min_p); log(0) = -inf.
    keep &= (desc - desc[:, :1]) >= jnp.log(t.min_p)[:, None]
    weight = jnp.where(keep, jnp.exp(desc - desc[:, :1]), 0.0)
    total = jnp.sum(weight, axis=-1)
    if whole is not None:
        total = jnp.where(k <= desc.shape[-1], total, whole)
    before = (jnp.cumsum(weight, axis=-1) - weight) / total[:, None]  # more likely tokens' mass
    return keep & ((before < t.top_p[:, None]) | (t.top_p[:, None] >= 1.0))


def _last_kept(desc: jax.Array, keep: jax.Array) -> jax.Array:
    """The smallest kept logit of each row (the first always is): f32[R]."""
    n_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    return jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)[:, 0]


def _top_k_arg(top_k: jax.Array, vocab: int) -> jax.Array:
    return jnp.where((top_k <= 0) | (top_k > vocab), vocab, top_k)


def _thresholds(scaled: jax.Array, t: SamplingTensors) -> jax.Array:
    """Exact per-row threshold for min_p, top_k and top_p by sorting the whole
    vocabulary: f32[R]; keep scaled >= it."""
    desc = -jnp.sort(-scaled, axis=-1)  # [R, V], most likely first
    return _last_kept(desc, _keep_sorted(desc, _top_k_arg(t.top_k, scaled.shape[-1]), t))


def _keep_mask(scaled: jax.Array, t: SamplingTensors, filtered: jax.Array) -> jax.Array:
    """bool[R, V]: the tokens min_p, top_k and top_p keep, decided on each row's
    TOP_CANDIDATES most likely tokens; rows whose kept set may reach past them (and only
    then the whole step) fall back to the exact sort of `_thresholds`."""
    vocab = scaled.shape[-1]
    k = _top_k_arg(t.top_k, vocab)
    no_top_p = t.top_p >= 1.0
    min_p_only = (k == vocab) & no_top_p     # keep logit - max >= log(min_p): no sort
    in_min_p = (scaled - jnp.max(scaled, axis=-1, keepdims=True)) >= jnp.log(t.min_p)[:, None]
    return jax.lax.cond(jnp.all(min_p_only | ~filtered), lambda: in_min_p,
                        lambda: _candidate_mask(scaled, t, filtered, in_min_p, min_p_only))


def _candidate_mask(scaled: jax.Array, t: SamplingTensors, filtered: jax.Array,
                    in_min_p: jax.Array, min_p_only: jax.Array) -> jax.Array:
    """_keep_mask where some row needs top_k or top_p (in_min_p: min_p's mask;
    min_p_only: the rows that need nothing else)."""
    vocab = scaled.shape[-1]
    c = min(vocab, TOP_CANDIDATES)
    k = _top_k_arg(t.top_k, vocab)
    desc, _ = jax.lax.top_k(scaled, c)  # [R, C], descending
    top = desc[:, :1]
    # With top_k <= C every kept token is a candidate; without top_k the kept mass is
    # min_p's over the whole row (a sum, no sort).
    whole = jnp.sum(jnp.where(in_min_p, jnp.exp(scaled - top), 0.0), axis=-1)
    keep = _keep_sorted(desc, k, t, whole)
    no_top_p = t.top_p >= 1.0
    # Exact where the kept prefix ends inside the candidates and its mass is known: top_k
    # <= C; or a cut before C with the whole row's mass (no top_k) or no mass needed
    # (no top_p; C < top_k < V makes the mass that of tokens past the candidates).
    ends_inside = jnp.sum(keep, axis=-1) < c
    covered = ~filtered | (k <= c) | min_p_only | (ends_inside & ((k == vocab) | no_top_p))
    threshold = jax.lax.cond(
        jnp.all(covered),
        lambda: _last_kept(desc, keep),
        lambda: jnp.where(covered, _last_kept(desc, keep), _thresholds(scaled, t)))
    return jnp.where(min_p_only[:, None], in_min_p, scaled >= threshold[:, None])


def _random_sample(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    num_rows, vocab = logits.shape
    greedy_row = t.temperature < SAMPLING_EPS
    temp = jnp.where(greedy_row, 1.0, t.temperature)
    scaled = logits / temp[:, None]
    filtered = ~greedy_row & (
        ((t.top_k > 0) & (t.top_k < vocab)) | (t.top_p < 1.0) | (t.min_p > 0.0)
    )
    # Skip the filters at run time when no row filters (a device-side branch, no sync).
    # XLA:CPU lowers lax.top_k to a full sort, so there the exact sort alone is cheaper.
    keep = jax.lax.cond(
        jnp.any(filtered),
        lambda: jax.lax.platform_dependent(
            cpu=lambda: scaled >= _thresholds(scaled, t)[:, None],
            default=lambda: _keep_mask(scaled, t, filtered)),
        lambda: jnp.ones(scaled.shape, jnp.bool_))
    scaled = jnp.where(keep, scaled, -jnp.inf)
    base = jax.random.wrap_key_data(t.keys, impl=_KEY_IMPL)  # [R] keys
    keys = jax.vmap(jax.random.fold_in)(base, t.steps)
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,), jnp.float32))(keys)
    return first_argmax(scaled + gumbel)


def first_argmax(x: jax.Array) -> jax.Array:
    """argmax over the last axis (the first index on ties), as int32.

    Written as a max and a min over the indices that reach it: XLA CPU compiles
    jnp.argmax's (value, index) reduction into a scalar loop about 4x slower than
    these two plain reductions ([64, 32000]: 4.7 ms vs 1.1 ms). A row holding a
    NaN gives the last index (jnp.argmax would give the NaN's).
    """
    vocab = x.shape[-1]
    best = jnp.max(x, axis=-1, keepdims=True)
    ids = jnp.arange(vocab, dtype=jnp.int32)
    return jnp.minimum(jnp.min(jnp.where(x == best, ids, vocab), axis=-1), vocab - 1)


def _top_logprobs(logprobs: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """top-k over the last axis, padded with (-inf, -1) when the vocabulary is smaller."""
    kk = min(k, logprobs.shape[-1])
    values, ids = jax.lax.top_k(logprobs, kk)
    if kk < k:
        pad = [(0, 0)] * (logprobs.ndim - 1) + [(0, k - kk)]
        values = jnp.pad(values, pad, constant_values=-jnp.inf)
        ids = jnp.pad(ids, pad, constant_values=-1)
    return values, ids.astype(jnp.int32)


def _token_logprob_and_rank(logprobs: jax.Array, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    chosen = jnp.take_along_axis(logprobs, ids[:, None], axis=-1)  # [*, 1]
    rank = jnp.sum(logprobs > chosen, axis=-1).astype(jnp.int32) + 1
    return chosen[:, 0], rank


def _logprobs_out(logits: jax.Array, token_ids: jax.Array,
                  num_logprobs: int) -> tuple[jax.Array, ...]:
    """(logprobs, their ids, sampled rank) of SamplerOutput from the raw logits."""
    raw = jax.nn.log_softmax(logits, axis=-1)
    chosen, rank = _token_logprob_and_rank(raw, token_ids)
    top_values, top_ids = _top_logprobs(raw, num_logprobs)
    return (jnp.concatenate([chosen[:, None], top_values], axis=-1),
            jnp.concatenate([token_ids[:, None], top_ids], axis=-1), rank)


def sample(logits: jax.Array, tensors: SamplingTensors, *, penalties: bool = False,
           greedy: bool = False, num_logprobs: int = MAX_LOGPROBS,
           gather: Callable[[jax.Array], jax.Array] = lambda x: x) -> SamplerOutput:
    """Pick one token per row. logits: [R, V] (any float dtype; computed in f32).
    num_logprobs: the top entries computed for rows that want logprobs (static: the
    engine's max_logprobs, so that one program serves every request).
    Static flags: penalties, whether `tensors` carries the token history; greedy, every
    row is greedy and none wants logprobs (the argmax alone: XLA:CPU charges a step for
    the sampling branches even when they do not run). gather: makes a [R, V] array
    whole where a branch needs every token of a row (under a mesh the logits may come
    vocab-parallel; the greedy argmax reduces the shards as they are)."""
    t = tensors
    logits = logits.astype(jnp.float32)
    num_rows, width = logits.shape[0], num_logprobs + 1
    rows = jnp.arange(num_rows)[:, None]
    masked = logits.at[rows, t.banned_token_ids].set(-jnp.inf, mode="drop")
    if t.logit_bias_ids is not None:
        masked = masked.at[rows, t.logit_bias_ids].add(t.logit_bias, mode="drop")
    if t.token_mask is not None:
        masked = jnp.where(allowed_tokens(t.token_mask, logits.shape[-1]), masked, -jnp.inf)
    if penalties:
        masked = apply_penalties(masked, t)
    greedy_ids = first_argmax(masked)
    no_logprobs = (jnp.zeros((num_rows, width), jnp.float32),
                   jnp.zeros((num_rows, width), jnp.int32), jnp.zeros((num_rows,), jnp.int32))
    if greedy:
        return SamplerOutput(greedy_ids, *no_logprobs)
    greedy_row = t.temperature < SAMPLING_EPS
    token_ids = jax.lax.cond(
        jnp.all(greedy_row), lambda: greedy_ids,
        lambda: jnp.where(greedy_row, greedy_ids, _random_sample(gather(masked), t)))
    logprobs, logprob_ids, rank = jax.lax.cond(
        jnp.any(t.want_logprobs),
        lambda: _logprobs_out(gather(logits), token_ids, num_logprobs),
        lambda: no_logprobs)
    return SamplerOutput(token_ids=token_ids, logprobs=logprobs, logprob_token_ids=logprob_ids,
                         sampled_rank=rank)


def compute_prompt_logprobs(
    logits: jax.Array, target_ids: jax.Array, num_logprobs: int = MAX_LOGPROBS
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Logprobs of the next prompt tokens under the model's raw logits.

    logits f32[T, V] (row t predicts target_ids[t]), target_ids int32[T] ->
    (target logprob f32[T], target rank int32[T], top logprobs f32[T, K],
    top ids int32[T, K]), K = num_logprobs (static).
    """
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen, rank = _token_logprob_and_rank(logprobs, target_ids.astype(jnp.int32))
    top_values, top_ids = _top_logprobs(logprobs, num_logprobs)
    return chosen, rank, top_values, top_ids
