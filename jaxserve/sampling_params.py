"""Per-request sampling parameters with vLLM's field names and defaults.

Host-only: this module must never import jax (the server and the scheduler use it).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
import reprlib
import typing
from dataclasses import dataclass, field
from typing import Any

# The engine's exceptions module imports nothing (no jax), so this stays host-only.
from jaxserve.errors import InputError
from jaxserve.structured_outputs import StructuredOutputsParams

# The default of EngineConfig.max_logprobs (vLLM's): the most logprobs a request may ask
# for (per sampled token and per prompt token), and so the number of top entries the
# sampler computes. The engine's own limit is checked at the front door
# (engine/input_processor.py); SamplingParams alone checks only the int32 range.
MAX_LOGPROBS = 20

# Stop tokens (eos + stop_token_ids) a row can hold back while below min_tokens: the
# width of the sampler's banned-token array, so a compile-time constant.
MAX_BANNED_TOKENS = 16

# Most entries of logit_bias: the width of the sampler's bias arrays (a compile-time
# constant, shipped every step). Larger exclusions belong in allowed_token_ids.
MAX_LOGIT_BIAS = 128
# Bias values are clamped to this range, as OpenAI documents and vLLM does.
LOGIT_BIAS_LIMIT = 100.0

# bad_words: at most this many words of at most this many characters in all (what the
# front door tokenizes), and, tokenized (each word twice: at the start of a text and
# after a space), at most MAX_BAD_WORD_TOKENS tokens a spelling (how far the automaton
# of engine/bad_words.py walks back on a token) and MAX_BAD_WORDS_TOKENS in all (its size).
MAX_BAD_WORDS = 16384
MAX_BAD_WORDS_CHARS = 2**20
MAX_BAD_WORD_TOKENS = 64
MAX_BAD_WORDS_TOKENS = 2**18

# Temperatures below this are greedy (as vLLM): dividing by ~0 would overflow.
SAMPLING_EPS = 1e-5

# Most completions one request may ask for (OpenAI's and vLLM's cap): each is a
# sequence with its own KV pages, so n is a memory knob a client must not own.
MAX_N = 128

# Most entries of allowed_token_ids or stop_token_ids: the largest vocabularies (Gemma's
# 262144). A longer list only repeats ids, and costs validation and stop checks per step.
MAX_TOKEN_ID_LIST = 2**18

# Integers that reach the device's int32 arrays (top_k, token ids) must fit them.
INT32_MAX = 2**31 - 1
# OpenAI documents `seed` as a 64-bit integer.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(enum.IntEnum):
    """What a streaming engine (AsyncEngine.generate) yields for a request, as vLLM's:
    CUMULATIVE, every output so far after each step; DELTA, only what is new since
    the last; FINAL_ONLY, one output when the request is done. LLM.generate returns
    final outputs whatever the kind."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def is_int(x: object) -> bool:
    """An int, numpy integer scalars included (token ids often come out of numpy)."""
    # (`type(x) is int` first: the ABC check costs a microsecond, per token of a list)
    return type(x) is int or (isinstance(x, numbers.Integral) and not isinstance(x, bool))


def token_id_of(key: object) -> int | None:
    """A logit_bias key as a token id, else None: an int in [0, INT32_MAX] or its ASCII
    decimal digits (JSON object keys are strings). Not int(): it takes other scripts'
    digits ("٣" is 3), signs, spaces and underscores."""
    if isinstance(key, str):
        if not (key.isascii() and key.isdigit() and len(key) <= len(str(INT32_MAX))):
            return None
        key = int(key)
    return int(key) if is_int(key) and 0 <= key <= INT32_MAX else None


def logprobs_limit(max_logprobs: int, vocab_size: int) -> int:
    """EngineConfig.max_logprobs resolved for a model: -1 is the whole vocabulary."""
    return vocab_size if max_logprobs == -1 else max_logprobs


def _is_number(x: object) -> bool:
    """A finite int or float: NaN and infinities are refused (a NaN temperature
    would sample token 0 for ever)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample the completion(s) of one request.

    Frozen: derive variants with ``dataclasses.replace`` (which re-validates),
    ``clone()`` or ``child(i)``. ``top_k`` of -1 is normalised to 0 (off), a
    string ``stop`` to a one-element list, ``stop_token_ids=None`` to ``[]``. A
    greedy request (temperature < SAMPLING_EPS) has its top_p/top_k/min_p reset
    to their neutral values, since they cannot change an argmax.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    # Token constraints (vLLM's names), applied on device by one bitmask per row:
    # logit_bias adds to the logits of its tokens (values clamped to +-100);
    # allowed_token_ids: only these may be sampled; bad_words: strings that may never be
    # completed (the last token of a word is banned where the output ends with the rest).
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Constrained decoding: the output must match a JSON schema, regex, choice or grammar.
    structured_outputs: StructuredOutputsParams | None = None
    # Sample best_of completions and return the n with the highest cumulative logprob (as
    # vLLM V0 did); None = n. With best_of > n a stream carries only the final output.
    best_of: int | None = None
    # Keep only the last k prompt tokens (-1: max_model_len), before the length checks.
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # As in vLLM: a free-form slot for extensions; not validated, not compared.
    extra_args: dict | None = field(default=None, compare=False)
    # Set by the front door (engine/input_processor.py), never by users: bad_words as an
    # automaton over their token ids (engine/bad_words.py BadWords), and the compiled
    # grammar of structured_outputs.
    bad_words_automaton: Any = field(default=None, compare=False, repr=False)
    grammar: Any = field(default=None, compare=False, repr=False)
    # Set by the server's reasoning parser: the grammar applies from the token after these
    # (the end of the think block the chat template opened), not from the first.
    grammar_after_ids: tuple[int, ...] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        # --- normalise ---
        if self.stop is None:
            set_("stop", [])
        elif isinstance(self.stop, str):
            set_("stop", [self.stop])
        else:
            set_("stop", list(self.stop))
        set_("stop_token_ids", [] if self.stop_token_ids is None else list(self.stop_token_ids))
        if is_int(self.top_k) and self.top_k == -1:
            set_("top_k", 0)
        if isinstance(self.structured_outputs, dict):
            set_("structured_outputs", StructuredOutputsParams(**self.structured_outputs))
        self._validate()
        # Plain ints from here on, whatever integer type (numpy's) came in.
        for name in _INT_FIELDS:
            if getattr(self, name) is not None:
                set_(name, int(getattr(self, name)))
        set_("stop_token_ids", [int(t) for t in self.stop_token_ids])
        if self.allowed_token_ids is not None:
            set_("allowed_token_ids", [int(t) for t in self.allowed_token_ids])
        if self.logit_bias:   # int keys (JSON gives strings), values clamped
            set_("logit_bias", {token_id_of(k): max(-LOGIT_BIAS_LIMIT,
                                                    min(LOGIT_BIAS_LIMIT, float(v)))
                                for k, v in self.logit_bias.items()})
        if self.temperature < SAMPLING_EPS:
            set_("top_p", 1.0)
            set_("top_k", 0)
            set_("min_p", 0.0)

    def _validate(self) -> None:
        def bad(name: str, value: object, want: str) -> InputError:
            # (reprlib: the start of a value, which may be a million ids long)
            return InputError(f"{name} must be {want}, got {reprlib.repr(value)}", name)

        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", self.n, f"an int in [1, {MAX_N}]")
        if not _is_number(self.temperature) or self.temperature < 0.0:
            raise bad("temperature", self.temperature, "a finite number >= 0")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not is_int(self.top_k) or not -1 <= self.top_k <= INT32_MAX:
            raise bad("top_k", self.top_k, f"an int in [-1, {INT32_MAX}] (0 or -1 disables it)")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", self.repetition_penalty, "a finite number > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise bad(name, value, "in [-2, 2]")
        # 0: score the prompt only (prompt_logprobs; lm-eval's loglikelihood), no sampling.
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 0):
            raise bad("max_tokens", self.max_tokens, "None or an int >= 0")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "an int >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InputError(
                f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens!r}",
                "min_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or not 0 <= value <= INT32_MAX):
                raise bad(name, value, "None or an int >= 0 (at most the engine's "
                                       "max_logprobs)")
        if self.best_of is not None and (not is_int(self.best_of)
                                         or not self.n <= self.best_of <= MAX_N):
            raise bad("best_of", self.best_of, f"None or an int in [n={self.n}, {MAX_N}]")
        k = self.truncate_prompt_tokens
        if k is not None and (not is_int(k) or not (k == -1 or 1 <= k <= INT32_MAX)):
            raise bad("truncate_prompt_tokens", k, "None, -1 (max_model_len) or an int >= 1")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", self.output_kind, "a RequestOutputKind")
        if self.seed is not None and (not is_int(self.seed)
                                      or not INT64_MIN <= self.seed <= INT64_MAX):
            raise bad("seed", self.seed, "None or a 64-bit int")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise bad("stop", self.stop, "a list of non-empty strings")
        if len(self.stop_token_ids) > MAX_TOKEN_ID_LIST:
            raise bad("stop_token_ids", self.stop_token_ids,
                      f"a list of at most {MAX_TOKEN_ID_LIST} token ids (MAX_TOKEN_ID_LIST)")
        for t in self.stop_token_ids:
            if not is_int(t) or not 0 <= t <= INT32_MAX:
                raise bad("stop_token_ids", self.stop_token_ids,
                          f"a list of ints in [0, {INT32_MAX}]")
        self._validate_constraints(bad)

    def _validate_constraints(self, bad) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS \
                    or not all(_is_number(v) for v in self.logit_bias.values()):
                raise bad("logit_bias", self.logit_bias,
                          f"a map of at most {MAX_LOGIT_BIAS} token ids to finite numbers "
                          f"(to exclude many tokens use allowed_token_ids)")
            key = next((k for k in self.logit_bias if token_id_of(k) is None), None)
            if key is not None:
                raise InputError(f"logit_bias key {reprlib.repr(key)} is not a token id (ASCII "
                                 f"digits for an int in [0, {INT32_MAX}])", "logit_bias")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids
                or len(self.allowed_token_ids) > MAX_TOKEN_ID_LIST
                or not all(is_int(t) and 0 <= t <= INT32_MAX for t in self.allowed_token_ids)):
            raise bad("allowed_token_ids", self.allowed_token_ids,
                      f"a non-empty list of at most {MAX_TOKEN_ID_LIST} token ids "
                      f"(MAX_TOKEN_ID_LIST)")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(
                    isinstance(w, str) and w for w in self.bad_words):
                raise InputError("bad_words must be a list of non-empty strings",
                                 "bad_words")   # (the list itself may be long: not echoed)
            chars = sum(map(len, self.bad_words))
            if len(self.bad_words) > MAX_BAD_WORDS or chars > MAX_BAD_WORDS_CHARS:
                raise InputError(f"bad_words: at most {MAX_BAD_WORDS} words of at most "
                                 f"{MAX_BAD_WORDS_CHARS} characters in all, got "
                                 f"{len(self.bad_words)} of {chars}", "bad_words")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs", self.structured_outputs,
                          "a StructuredOutputsParams")
            if self.ignore_eos or self.min_tokens:
                raise InputError("structured_outputs cannot be combined with ignore_eos or "
                                 "min_tokens: the grammar ends the output with an "
                                 "end-of-sequence token they would hold back",
                                 "structured_outputs")

    # --- derived views ---

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def has_penalties(self) -> bool:
        """Whether any penalty differs from its neutral value (sampler needs token history)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    @property
    def num_samples(self) -> int:
        """Completions the engine samples: best_of, else n."""
        return self.n if self.best_of is None else self.best_of

    @property
    def ranks_samples(self) -> bool:
        """Whether the n returned are chosen among more samples (best_of > n)."""
        return self.num_samples > self.n

    @classmethod
    def from_optional(cls, **kwargs: Any) -> SamplingParams:
        """As vLLM's: an argument given as None takes the field's default, except where
        None is itself a value of the field (seed, max_tokens, stop, logprobs, ...)."""
        hints = typing.get_type_hints(cls)
        # (a name that is no field is passed on, for the constructor to refuse)
        return cls(**{k: v for k, v in kwargs.items() if v is not None or k not in hints
                      or type(None) in typing.get_args(hints[k])})

    def clone(self) -> SamplingParams:
        """An independent copy (list fields copied too)."""
        return dataclasses.replace(self)

    def child(self, index: int) -> SamplingParams:
        """Parameters of the `index`-th of the num_samples parallel samples: n=1,
        seed+index. When they are ranked (best_of > n) each child asks for its sampled
        token's logprob (logprobs=0 at least): the ranking sums them."""
        if not is_int(index) or not 0 <= index < self.num_samples:
            raise ValueError(f"child index must be in [0, {self.num_samples}), got {index!r}")
        seed = None if self.seed is None else _wrap_int64(self.seed + index)
        logprobs = self.logprobs
        if self.ranks_samples and logprobs is None:
            logprobs = 0
        return dataclasses.replace(self, n=1, best_of=None, seed=seed, logprobs=logprobs)


# Integer fields made plain ints once validated.
_INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
               "best_of", "truncate_prompt_tokens")


def _wrap_int64(x: int) -> int:
    """x in two's-complement 64 bits, so a child of seed INT64_MAX stays a valid seed."""
    return (x - INT64_MIN) % 2**64 + INT64_MIN
