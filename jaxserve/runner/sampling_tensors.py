"""The sampler's per-row inputs (SamplingTensors) and their one builder.

`pad_rows` lays n rows' settings out as the sampler takes them: padded to a row bucket
with a padding row's values (greedy, neutral, no penalty tokens, nothing banned, every
token allowed). Two front ends feed it: the persistent batch's columns
(InputBatch.sampling_tensors, every step) and a list of SamplingRows
(make_sampling_tensors: warmup's padding-only tensors, tests).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import flax.struct
import jax
import numpy as np

from jaxserve.runner.buckets import power_of_two_at_least
from jaxserve.runner.token_constraints import ALL_ALLOWED, bias_row, static_mask
from jaxserve.sampling_params import MAX_BANNED_TOKENS, MAX_LOGIT_BIAS, SamplingParams

_MIN_PENALTY_LEN = 16
_U32 = 0xFFFFFFFF

# SamplingParams fields kept per row as SamplingTensors takes them: (name, dtype, value
# of a padding row).
PARAM_COLUMNS = (("temperature", np.float32, 0.0), ("top_k", np.int32, 0),
                 ("top_p", np.float32, 1.0), ("min_p", np.float32, 0.0),
                 ("presence_penalty", np.float32, 0.0), ("frequency_penalty", np.float32, 0.0),
                 ("repetition_penalty", np.float32, 1.0))


@flax.struct.dataclass
class SamplingTensors:
    temperature: jax.Array  # f32[R]; < SAMPLING_EPS => greedy row
    top_k: jax.Array  # int32[R]; <= 0 => off
    top_p: jax.Array  # f32[R]; 1 => off
    min_p: jax.Array  # f32[R]; 0 => off
    keys: jax.Array  # uint32[R, 2]; raw threefry key data of PRNGKey(seed)
    steps: jax.Array  # int32[R]; index of the token being sampled, folded into keys
    presence_penalty: jax.Array  # f32[R]
    frequency_penalty: jax.Array  # f32[R]
    repetition_penalty: jax.Array  # f32[R]
    banned_token_ids: jax.Array  # int32[R, MAX_BANNED_TOKENS]; V = none (min_tokens stops)
    want_logprobs: jax.Array  # bool[R]; the row asked for logprobs
    penalty_token_ids: jax.Array | None = None  # int32[R, L]: prompt ids, output ids, V pad
    num_prompt_tokens: jax.Array | None = None  # int32[R]
    # Which tokens each row may sample: bit b of word w allows token 32 w + b (as the
    # grammar libraries lay their bitmasks out); all ones = unconstrained. The runner
    # always passes it (one program whatever the rows ask), None only in direct calls.
    token_mask: jax.Array | None = None  # uint32[R, mask_words(V)]
    logit_bias_ids: jax.Array | None = None  # int32[R, MAX_LOGIT_BIAS]; V = none
    logit_bias: jax.Array | None = None  # f32[R, MAX_LOGIT_BIAS]


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """What the sampler needs to know about one request this step.

    seed: the effective seed (defaults to params.seed). When both are None the
    row gets a fresh random key each step (not reproducible, as vLLM). The
    engine may instead give every request a random seed at arrival, which also
    makes preempted-and-recomputed requests draw the same tokens.
    prompt/output ids are read only when penalties are on.
    """

    params: SamplingParams
    num_output_tokens: int
    seed: int | None = None
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    banned_token_ids: Sequence[int] = ()  # may not be sampled now (stop tokens < min_tokens)


def mask_words(vocab_size: int) -> int:
    """32-bit words of a row of the token mask."""
    return -(-vocab_size // 32)


def seed_to_key_data(seed: int) -> tuple[int, int]:
    """Key data of jax.random.PRNGKey(seed) (64-bit seed semantics), without jax."""
    return (seed >> 32) & _U32, seed & _U32


def pad_rows(num_rows_padded: int, vocab_size: int, *, params: dict[str, np.ndarray],
             want_logprobs: np.ndarray, keys: np.ndarray, steps: np.ndarray,
             banned: np.ndarray, constraints: dict[str, np.ndarray],
             penalty: tuple[np.ndarray, np.ndarray] | None = None,
             take: np.ndarray | None = None) -> SamplingTensors:
    """SamplingTensors of n rows (len(steps)) padded to num_rows_padded. params: each
    PARAM_COLUMNS column [n] and want_logprobs [n], or with `take` (n indices) columns of
    which take's rows are the n (gathered straight into the padded arrays); keys [n, 2];
    banned [n, MAX_BANNED_TOKENS]; constraints: token_mask, logit_bias_ids and
    logit_bias, already padded; penalty: (token ids [n, L] padded with V, prompt lengths
    [n]), only for the penalties program."""
    n = len(steps)

    def col(a: np.ndarray, fill, dtype=None, rows: np.ndarray | None = None) -> np.ndarray:
        out = np.full((num_rows_padded, *a.shape[1:]), fill, dtype or a.dtype)
        out[:n] = a if rows is None else a[rows]
        return out

    t = {name: col(params[name], fill, dtype, take) for name, dtype, fill in PARAM_COLUMNS}
    if penalty is not None:
        t["penalty_token_ids"] = col(penalty[0], vocab_size, np.int32)
        t["num_prompt_tokens"] = col(penalty[1], 0, np.int32)
    return SamplingTensors(keys=col(keys, 0, np.uint32), steps=col(steps, 0, np.int32),
                           banned_token_ids=col(banned, vocab_size, np.int32),
                           want_logprobs=col(want_logprobs, False, np.bool_, take),
                           **t, **constraints)


def make_sampling_tensors(
    rows: Sequence[SamplingRow],
    num_rows_padded: int,
    vocab_size: int,
    *,
    penalties: bool = False,
    penalty_len: int | None = None,
    rng: np.random.Generator | None = None,
) -> SamplingTensors:
    """Host-side (numpy) batch of per-row settings; rows past len(rows) are padding.

    Padding rows are greedy with neutral settings and no penalty tokens.
    `penalties` must match the flag passed to `sample`. `penalty_len` fixes
    the padded length L of the token history (default: a power-of-two bucket).
    """
    r = len(rows)
    if r > num_rows_padded:
        raise ValueError(f"{r} rows do not fit num_rows_padded={num_rows_padded}")
    ps = [row.params for row in rows]
    keys = np.zeros((r, 2), np.uint32)
    for i, row in enumerate(rows):
        seed = row.seed if row.seed is not None else row.params.seed
        if seed is None:
            rng = rng if rng is not None else np.random.default_rng()
            keys[i] = rng.integers(0, 1 << 32, size=2, dtype=np.uint64)
        else:
            keys[i] = seed_to_key_data(seed)
    banned = np.full((r, MAX_BANNED_TOKENS), vocab_size, np.int32)
    for i, row in enumerate(rows):
        if row.banned_token_ids:
            if len(row.banned_token_ids) > MAX_BANNED_TOKENS:
                raise ValueError(f"at most {MAX_BANNED_TOKENS} stop tokens can be held back "
                                 f"by min_tokens, got {len(row.banned_token_ids)}")
            banned[i, :len(row.banned_token_ids)] = row.banned_token_ids
    constraints = dict(
        token_mask=np.full((num_rows_padded, mask_words(vocab_size)), ALL_ALLOWED, np.uint32),
        logit_bias_ids=np.full((num_rows_padded, MAX_LOGIT_BIAS), vocab_size, np.int32),
        logit_bias=np.zeros((num_rows_padded, MAX_LOGIT_BIAS), np.float32))
    for i, p in enumerate(ps):   # the fixed constraints (no grammar: the runner's job)
        static_mask(p, constraints["token_mask"][i])
        bias_row(p, vocab_size, constraints["logit_bias_ids"][i], constraints["logit_bias"][i])
    return pad_rows(
        num_rows_padded, vocab_size,
        params={name: np.asarray([getattr(p, name) for p in ps], dtype)
                for name, dtype, _ in PARAM_COLUMNS},
        want_logprobs=np.asarray([p.logprobs is not None for p in ps], np.bool_), keys=keys,
        steps=np.asarray([row.num_output_tokens for row in rows], np.int32), banned=banned,
        constraints=constraints, penalty=_penalty_rows(rows, vocab_size, penalty_len)
        if penalties else None)


def _penalty_rows(rows: Sequence[SamplingRow], vocab_size: int,
                  penalty_len: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Each row's prompt then output ids, padded with V to penalty_len (None: a
    power-of-two bucket of the longest), and its prompt length."""
    lengths = [len(row.prompt_token_ids) + len(row.output_token_ids) for row in rows]
    need = max(lengths, default=0)
    length = (power_of_two_at_least(need, _MIN_PENALTY_LEN) if penalty_len is None
              else penalty_len)
    if need > length:
        raise ValueError(f"penalty_len={length} is shorter than a row's {need} tokens")
    ids = np.full((len(rows), length), vocab_size, dtype=np.int32)
    for i, row in enumerate(rows):
        n_prompt = len(row.prompt_token_ids)
        ids[i, :n_prompt] = row.prompt_token_ids
        ids[i, n_prompt : lengths[i]] = row.output_token_ids
    return ids, np.asarray([len(row.prompt_token_ids) for row in rows], np.int32)
