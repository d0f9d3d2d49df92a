"""OpenAI request bodies (pydantic) and their translation into SamplingParams.

vLLM's extra sampling fields (top_k, min_p, repetition_penalty, ignore_eos, ...) are
accepted. A field jaxserve knows of but does not implement (tools, response_format,
logit_bias, ...) is refused by name unless its value changes nothing; other unknown
fields are ignored, as OpenAI-compatible servers do, and logged (api/unsupported.py).
The static limits (SamplingParams' own) are part of the schema, so /openapi.json
says what the server accepts; the limits that depend on the model (vocabulary,
max_model_len) are the input processor's.
"""
from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from jaxserve.api.unsupported import refused_field
from jaxserve.errors import InputError
from jaxserve.engine.input_processor import MAX_CACHE_SALT_CHARS
from jaxserve.sampling_params import (INT32_MAX, INT64_MAX, INT64_MIN, MAX_N,
                                      RequestOutputKind, SamplingParams)
from jaxserve.structured_outputs import StructuredOutputsParams

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
# The upper limit is the engine's --max-logprobs, checked at the front door (a 400 naming
# the field and the limit).
Logprobs = Annotated[int, Field(ge=0, le=INT32_MAX)]


class _Fields(BaseModel):
    # strict: a value of another JSON type ("5" for 5, true for 1.0) is refused, as the
    # schema says, rather than coerced; finite floats only.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class _Body(_Fields):
    """A whole request body: only valid Unicode in any string, however deep."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        try:   # one pass in C; the walk, in Python, only to name the field at fault
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except (TypeError, ValueError):   # (TypeError: not from JSON; walk it)
            _check_unicode(data, [])
        return data


def _check_unicode(value: Any, path: list[str]) -> None:
    """JSON's \\ud800-style escapes can carry lone surrogates, which no tokenizer takes."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            field = ".".join(path) or "body"
            raise PydanticCustomError(
                "invalid_unicode", "{field} is not valid Unicode: {reason} at position {pos}",
                {"field": field, "reason": e.reason, "pos": e.start}) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_unicode(k, path)
            _check_unicode(v, [*path, str(k)])
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_unicode(v, [*path, str(i)])


class StreamOptions(_Fields):
    include_usage: bool = False


class _SamplingFields(_Body):
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    # vLLM's: keep the prompt's last k tokens (-1: max_model_len).
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT32_MAX)
    user: str | None = None
    # Token constraints and structured outputs (vLLM's fields; OpenAI's logit_bias).
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's: prefix-cache hits only among requests with the same salt (tenants).
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        return _refuse_unimplemented(cls, data)


def _refuse_unimplemented(model: type[BaseModel], data: Any) -> Any:
    refused = refused_field(data, set(model.model_fields))
    if refused:
        raise PydanticCustomError("unsupported_field", "{message}",
                                  {"field": refused[0], "message": refused[1]})
    return data


class CompletionRequest(_SamplingFields):
    prompt: str | list[TokenId] | list[str | list[TokenId]]
    # 0 with echo scores the prompt (lm-eval's loglikelihood): nothing is generated.
    max_tokens: int | None = Field(16, ge=0)
    logprobs: Logprobs | None = None
    echo: bool = False
    add_special_tokens: bool = True    # for text prompts (vLLM's default)


class ChatMessage(_Fields):
    role: str
    content: str | list[dict[str, Any]] | None = None
    # Tool calling and earlier turns' reasoning, passed on to the chat template.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # On top of those the chat template writes (vLLM's default: none).
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    # The last message's text before the answer, when it has the answer's role.
    echo: bool = False


# /tokenize's fields that only apply to messages (a prompt given with one is refused).
CHAT_ONLY_TOKENIZE_FIELDS = ("add_generation_prompt", "continue_final_message",
                             "chat_template_kwargs", "tools")


class TokenizeRequest(_Body):
    """vLLM's two /tokenize bodies in one: a prompt, or messages rendered exactly as
    /v1/chat/completions renders them."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # None: vLLM's defaults, True for a prompt and False for messages (the template
    # writes them).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        return _refuse_unimplemented(cls, data)


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]


def sampling_params(req: _SamplingFields, defaults: dict[str, Any], *, max_tokens: int | None,
                    logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
    """Request fields over the served model's defaults (its generation_config) over ours.

    Raises InputError (a ValueError) whose `param` names the bad field (SamplingParams
    validates).
    """
    def pick(name: str, fallback):
        value = getattr(req, name)
        if value is not None:
            return value
        return defaults.get(name, fallback)

    return SamplingParams(
        logit_bias=req.logit_bias, allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words, structured_outputs=structured_outputs(req),
        n=req.n, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0),
        top_k=pick("top_k", 0), min_p=pick("min_p", 0.0),
        presence_penalty=pick("presence_penalty", 0.0),
        frequency_penalty=pick("frequency_penalty", 0.0),
        repetition_penalty=pick("repetition_penalty", 1.0), seed=req.seed, stop=req.stop,
        stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, max_tokens=max_tokens,
        min_tokens=req.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
        # The server merges each step's new tokens into its answer (streamed or not).
        output_kind=RequestOutputKind.DELTA)


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
# Grammar backends a request may name: llguidance is the one jaxserve has.
_BACKENDS = ("auto", "guidance", "llguidance")


def constraint_field(req: _SamplingFields) -> str:
    """The request field that carried its structured-output constraint (the front door
    names "structured_outputs" in its errors; the client should see its own field)."""
    if req.response_format is not None and req.response_format.get("type") != "text":
        return "response_format"
    if getattr(req, "tools", None) and getattr(req, "tool_choice", None) not in (
            None, "none", "auto"):
        return "tools"           # the grammar of a forced call, built from the tools
    return next((n for n in _GUIDED if getattr(req, n) is not None), "structured_outputs")


def structured_outputs(req: _SamplingFields) -> StructuredOutputsParams | None:
    """The one constraint a request asks for, from any of its spellings: OpenAI's
    response_format (chat), vLLM's structured_outputs and its older guided_* fields."""
    if req.guided_decoding_backend not in (None, *_BACKENDS):
        raise InputError(f"guided_decoding_backend={req.guided_decoding_backend!r}: jaxserve "
                         f"has llguidance ({', '.join(_BACKENDS)})", "guided_decoding_backend")
    asked: list[tuple[str, dict]] = []
    fmt = req.response_format
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            asked.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise InputError("response_format.json_schema.schema must be a JSON schema "
                                 "object", "response_format")
            asked.append(("response_format", {"json": schema}))
        elif kind != "text":
            raise InputError(f"response_format type {kind!r}: expected text, json_object or "
                             f"json_schema", "response_format")
    if req.structured_outputs is not None:
        asked.append(("structured_outputs", dict(req.structured_outputs)))
    for name, kind in _GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            asked.append((name, {kind: value}))
    if not asked:
        return None
    if len(asked) > 1:
        raise InputError(f"{' and '.join(n for n, _ in asked)}: ask for one constraint",
                         asked[1][0])
    name, spec = asked[0]
    try:
        return StructuredOutputsParams(**spec)
    except TypeError as e:      # an unknown key inside structured_outputs
        raise InputError(f"{name}: {e}", name) from None
    except InputError as e:
        raise InputError(str(e), name) from None
