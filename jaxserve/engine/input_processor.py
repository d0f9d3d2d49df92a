"""The front door: every request, from the server or from `LLM`, is checked here once.

It owns the limits that depend on the served model (vocabulary, max_model_len,
the longest text worth tokenizing); SamplingParams owns the static ones (n, the
int32 and int64 ranges, finite floats). Past this point the engine trusts its
inputs: a value that would overflow a device array or exhaust memory never
gets in. Host only: no jax.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from jaxserve.engine.bad_words import BadWords
from jaxserve.engine.chat_template import render_chat
from jaxserve.engine.grammar import GrammarCompiler
from jaxserve.errors import InputError
from jaxserve.lora_request import LoRARequest
from jaxserve.multimodal.chat_parts import split_images
from jaxserve.config.media import MediaConfig
from jaxserve.multimodal.front import ImageFront, MultiModalInputs
from jaxserve.sampling_params import (MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS_TOKENS,
                                      MAX_BANNED_TOKENS, MAX_LOGPROBS, SamplingParams, is_int,
                                      logprobs_limit)

if TYPE_CHECKING:   # for hints only: transformers is heavy and loaded late
    from transformers import PreTrainedTokenizerBase

__all__ = ["EngineRequest", "InputError", "InputProcessor", "check_unicode"]

# Normalisers (NFC, for one) may merge a few characters into one before the tokenizer
# splits the text, so the character bound allows this factor on top of the longest token.
_NORMALISER_SLACK = 4
# vLLM's bound on a cache salt (a tenant's secret: 43 base64 characters carry 256 bits).
MAX_CACHE_SALT_CHARS = 1024


@dataclass(frozen=True)
class EngineRequest:
    """One request past the front door: every limit checked, trusted from here on.

    Only InputProcessor.process makes these; the engines add them as they are.
    """
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams   # max_tokens resolved: never None
    prompt: str | None = None         # the text the ids came from, when there was one
    priority: int = 0                 # lower runs first (scheduling_policy="priority")
    arrival_time: float | None = None   # None: when the engine adds it
    # Prefix-cache hits only among requests with the same salt (core/request.py).
    cache_salt: str | None = None
    # The prompt's images (their placeholder spans are in prompt_token_ids), or None.
    multi_modal: MultiModalInputs | None = None
    # Its LoRA adapter (checked: the engine serves it), or None for the base model.
    lora_request: LoRARequest | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def check_unicode(text: str, field: str) -> None:
    """Lone surrogates (which JSON's \\ud800 escapes can carry) are not text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"{field} is not valid Unicode: {e.reason} at position {e.start}",
                         field) from None


def _check_not_empty(prompt: str | Sequence[int], field: str) -> None:
    """The one home of the empty-prompt rule, for text and token ids alike. Text is
    checked before tokenizing: a tokenizer that adds BOS would make "" one token."""
    if len(prompt) == 0:
        raise InputError(f"{field} must not be empty", field)


class InputProcessor:
    """Tokenizes, renders chats, and turns a prompt and its SamplingParams into an
    EngineRequest. Stateless but for its counters, so any thread may call it (the
    server calls it from worker threads, never through the engine)."""

    def __init__(self, *, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int,
                 max_model_len: int,
                 eos_token_ids: tuple[int, ...] = (), max_logprobs: int = MAX_LOGPROBS,
                 images: ImageFront | None = None, lora: Any = None):
        """max_logprobs: EngineConfig.max_logprobs (-1: the vocabulary size); images: the
        model's image front (None: images are refused, as for a text-only model); lora:
        the runner's adapter store (runner/lora_store.LoRAStore: check(adapter) raises
        ValueError naming why it cannot be served), None with LoRA off."""
        self.tokenizer = tokenizer
        self.lora = lora
        self.images = images
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = logprobs_limit(max_logprobs, vocab_size)
        self.eos_token_ids = eos_token_ids
        self._grammars = None     # GrammarCompiler, made by the first structured request
        self._grammars_lock = threading.Lock()
        # A text longer than this cannot fit in max_model_len tokens (no token covers
        # more characters than the longest vocabulary entry), so it is refused before
        # the tokenizer spends time on it.
        longest = max(map(len, tokenizer.get_vocab()), default=1) if tokenizer else 1
        self.max_prompt_chars = max_model_len * max(longest, 1) * _NORMALISER_SLACK
        # What process() accepted and refused: each request is checked exactly once.
        self.num_processed = 0
        self.num_refused = 0
        self._count_lock = threading.Lock()

    # ---- text -> token ids -----------------------------------------------------------
    def check_text(self, text: str, field: str = "prompt") -> None:
        if not isinstance(text, str):
            raise InputError(f"{field} must be a string, got {type(text).__name__}", field)
        _check_not_empty(text, field)
        if len(text) > self.max_prompt_chars:
            raise InputError(
                f"{field} has {len(text)} characters: more than max_model_len="
                f"{self.max_model_len} tokens can hold with this tokenizer (at most "
                f"{self.max_prompt_chars} characters)", field)
        check_unicode(text, field)

    def tokenize(self, text: str, *, add_special_tokens: bool = True,
                 field: str = "prompt") -> list[int]:
        self.check_text(text, field)
        if self.tokenizer is None:
            raise InputError("this model has no tokenizer: send token ids", field)
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def render_chat(self, messages: list[dict], *, chat_template: str | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict] | None = None,
                    add_special_tokens: bool = False) -> list[int]:
        """Chat messages -> prompt ids; every failure is the request's (InputError).
        Text only: render_chat_mm takes image parts (and returns their payload)."""
        ids, multi_modal = self.render_chat_mm(
            messages, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, template_kwargs=template_kwargs,
            tools=tools, add_special_tokens=add_special_tokens)
        if multi_modal is not None:
            raise InputError("these messages hold images: they take render_chat_mm, whose "
                             "payload goes with the ids to process()", "messages")
        return ids

    def render_chat_mm(self, messages: list[dict], *, chat_template: str | None = None,
                       add_generation_prompt: bool = True, continue_final_message: bool = False,
                       template_kwargs: dict[str, Any] | None = None,
                       tools: list[dict] | None = None, add_special_tokens: bool = False
                       ) -> tuple[list[int], MultiModalInputs | None]:
        """render_chat for messages that may hold image_url parts: the ids with each
        image's placeholders expanded, and the images' payload (None without images)."""
        _check_strings(messages, "messages")
        if isinstance(messages, list):
            messages, urls = split_images(messages)
        else:
            urls = []
        if urls:   # refused before any rendering, fetching or decoding
            self.image_front.check_count(len(urls), "messages")
        _check_strings(template_kwargs, "chat_template_kwargs")
        _check_strings(tools, "tools")
        ids = render_chat(self.tokenizer, messages, chat_template=chat_template,
                          add_generation_prompt=add_generation_prompt,
                          continue_final_message=continue_final_message,
                          max_chars=self.max_prompt_chars, template_kwargs=template_kwargs,
                          tools=tools, add_special_tokens=add_special_tokens)
        if not urls:
            return ids, None
        return self.image_front.expand(ids, self.image_front.load(urls))

    @property
    def image_front(self) -> ImageFront:
        """The image front; for a server built without one, a front that refuses."""
        if self.images is None:
            self.images = ImageFront(None, {}, MediaConfig(), refusal="this model takes "
                                     "text only")
        return self.images

    # ---- the front door --------------------------------------------------------------
    def process(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                *, text: str | None = None, priority: int = 0,
                arrival_time: float | None = None, cache_salt: str | None = None,
                add_special_tokens: bool = True,
                multi_modal: MultiModalInputs | None = None,
                lora_request: LoRARequest | None = None) -> EngineRequest:
        """Checks one request against every limit; the only way to an EngineRequest.

        prompt: text (tokenized here, with the tokenizer's special tokens unless
        add_special_tokens is false) or token ids; text: the text token ids came from,
        if the caller has it (outputs carry it). Raises InputError naming the field.
        """
        try:
            request = self._process(request_id, prompt, params, text, priority, arrival_time,
                                    add_special_tokens)
            if cache_salt is not None:
                _check_cache_salt(cache_salt)
                request = replace(request, cache_salt=cache_salt)
            if multi_modal is not None:
                if isinstance(prompt, str) or params.truncate_prompt_tokens is not None:
                    raise InputError("images need prompt token ids with their placeholders "
                                     "expanded, and no truncate_prompt_tokens", "prompt")
                request = replace(request, multi_modal=multi_modal)
            if lora_request is not None:
                request = replace(request, lora_request=self.checked_lora(lora_request))
        except InputError:
            with self._count_lock:
                self.num_refused += 1
            raise
        with self._count_lock:
            self.num_processed += 1
        return request

    def checked_lora(self, lora_request: Any) -> LoRARequest:
        """The adapter, once the engine has checked it can serve it (read, fitted to the
        model, within --max-lora-rank); InputError naming the cause otherwise."""
        if not isinstance(lora_request, LoRARequest):
            raise InputError(f"lora_request must be a jaxserve.LoRARequest, got "
                             f"{type(lora_request).__name__}", "lora_request")
        if self.lora is None:
            raise InputError(f"LoRA adapter {lora_request.lora_name!r} was asked for, but "
                             f"the engine runs without LoRA: start it with --enable-lora "
                             f"(LLM(..., enable_lora=True))", "lora_request")
        try:
            self.lora.check(lora_request)
        except ValueError as e:
            raise InputError(str(e), "lora_request") from None
        return lora_request

    def _process(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                 text: str | None, priority: int, arrival_time: float | None,
                 add_special_tokens: bool) -> EngineRequest:
        if not isinstance(request_id, str):
            raise InputError(f"request_id must be a str, got {type(request_id).__name__}")
        if not isinstance(params, SamplingParams):
            raise InputError(f"sampling params must be a SamplingParams, got "
                             f"{type(params).__name__}")
        if not is_int(priority):
            raise InputError(f"priority must be an int, got {priority!r}", "priority")
        if isinstance(prompt, str):
            text, prompt = prompt, self.tokenize(prompt, add_special_tokens=add_special_tokens)
        # A tokenizer's ids are checked too: its added tokens may lie past the vocabulary.
        ids = self._checked_ids(prompt)
        keep = params.truncate_prompt_tokens
        if keep is not None:    # before the length checks: what is kept must fit
            ids = ids[-(self.max_model_len if keep == -1 else keep):]
        params = self._checked_params(len(ids), params)
        return EngineRequest(request_id, tuple(ids), params, prompt=text, priority=priority,
                             arrival_time=arrival_time)

    def _checked_ids(self, prompt_token_ids: Sequence[int]) -> list[int]:
        if isinstance(prompt_token_ids, np.ndarray) and prompt_token_ids.ndim == 1 \
                and np.issubdtype(prompt_token_ids.dtype, np.integer):
            prompt_token_ids = prompt_token_ids.tolist()
        if not isinstance(prompt_token_ids, (list, tuple)) or not all(
                is_int(t) for t in prompt_token_ids):
            raise InputError("prompt_token_ids must be a list of ints", "prompt")
        _check_not_empty(prompt_token_ids, "prompt")
        vocab = self.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise InputError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})",
                             "prompt")
        return [int(t) for t in prompt_token_ids]   # numpy integers become ints

    def _checked_params(self, n: int, params: SamplingParams) -> SamplingParams:
        """params with max_tokens resolved against the room an n-token prompt leaves
        (the checks keep the order they always had, so the same error wins)."""
        vocab = self.vocab_size
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise InputError(f"stop_token_ids: {bad[0]} is outside the vocabulary "
                             f"[0, {vocab})", "stop_token_ids")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.max_logprobs:
                raise InputError(f"{name}={k} is more than this engine's max_logprobs="
                                 f"{self.max_logprobs} (the server's --max-logprobs, "
                                 f"LLM(max_logprobs=...); -1 allows the whole vocabulary)",
                                 name)
        if n >= self.max_model_len:
            raise InputError(f"the prompt has {n} tokens; max_model_len={self.max_model_len} "
                             f"leaves no room to generate (prompt must be < max_model_len)",
                             "prompt")
        if params.min_tokens and len(params.stop_token_ids) + 1 > MAX_BANNED_TOKENS:
            raise InputError(f"stop_token_ids: at most {MAX_BANNED_TOKENS - 1} with "
                             f"min_tokens > 0, got {len(params.stop_token_ids)}",
                             "stop_token_ids")
        params = self._checked_constraints(params)
        room = self.max_model_len - n
        if params.max_tokens is None:
            return replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
        if params.max_tokens > room:
            raise InputError(f"max_tokens={params.max_tokens} cannot fit: the prompt has {n} "
                             f"tokens and max_model_len={self.max_model_len} leaves {room}",
                             "max_tokens")
        return params


    def _checked_constraints(self, params: SamplingParams) -> SamplingParams:
        """Token constraints against the vocabulary; bad_words tokenized and the
        structured-output grammar compiled (on the compiler's own threads: never on the
        engine loop) and checked against them."""
        vocab = self.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InputError(f"{name}: token id {bad[0]} is outside the vocabulary "
                                 f"[0, {vocab})", name)
        if params.bad_words:
            params = replace(params, bad_words_automaton=self._bad_words(params.bad_words))
        if params.structured_outputs is not None:
            # The server compiles ahead, on the compiler's threads (compile_async).
            grammar = self.grammar_compiler().compiled(params.structured_outputs,
                                                       params.grammar)
            grammar.check_first_token(params)
            params = replace(params, grammar=grammar)
        return params

    def _bad_words(self, words: Sequence[str]) -> BadWords:
        """The automaton of the words' token ids: each word as the tokenizer writes it at
        the start of a text and after a space (its two usual spellings in an output).
        SamplingParams bounded the words; here their tokens are bounded too."""
        if self.tokenizer is None:
            raise InputError("bad_words needs a tokenizer; this model has none", "bad_words")
        for word in words:
            check_unicode(word, "bad_words")
        texts = [t for w in words for t in (w.lstrip(), " " + w.lstrip())]
        spellings = self.tokenizer(texts, add_special_tokens=False).input_ids
        total = 0
        for i, ids in enumerate(spellings):
            total += len(ids)
            if len(ids) > MAX_BAD_WORD_TOKENS:
                raise InputError(f"bad_words[{i // 2}] is {len(ids)} tokens; a bad word may "
                                 f"have at most {MAX_BAD_WORD_TOKENS}", "bad_words")
        if total > MAX_BAD_WORDS_TOKENS:
            raise InputError(f"bad_words are {total} tokens (each word counted at the start "
                             f"of a text and after a space); at most {MAX_BAD_WORDS_TOKENS}",
                             "bad_words")
        vocab = self.vocab_size
        return BadWords(ids for ids in spellings if all(0 <= t < vocab for t in ids))

    def grammar_compiler(self) -> GrammarCompiler:
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise InputError("structured outputs need a tokenizer; this model has none",
                                     "structured_outputs")
                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size,
                                                 self.eos_token_ids)
            return self._grammars


def _check_cache_salt(salt: Any) -> None:
    if not isinstance(salt, str):
        raise InputError(f"cache_salt must be a string, got {type(salt).__name__}",
                         "cache_salt")
    _check_not_empty(salt, "cache_salt")
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise InputError(f"cache_salt has {len(salt)} characters, more than "
                         f"{MAX_CACHE_SALT_CHARS}", "cache_salt")
    check_unicode(salt, "cache_salt")


def _check_strings(value: Any, field: str) -> None:
    """check_unicode on every string inside nested dicts and lists."""
    if isinstance(value, str):
        check_unicode(value, field)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_strings(k, field)
            _check_strings(v, field)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _check_strings(v, field)
