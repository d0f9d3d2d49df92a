"""A chat request's prompt: its messages through the chat template, in one code path for
/v1/chat/completions and /tokenize (so /tokenize counts exactly the tokens chat would
run: the same template, template kwargs, checked tools and special tokens), and the
role and echoed text of its answer (vLLM's rules).
"""
from __future__ import annotations

from typing import Protocol

from jaxserve.api.protocol import CHAT_ONLY_TOKENIZE_FIELDS, ChatMessage, TokenizeRequest
from jaxserve.api.tools import tool_setup
from jaxserve.engine.chat_template import message_text
from jaxserve.errors import InputError
from jaxserve.engine.input_processor import InputProcessor
from jaxserve.multimodal.front import MultiModalInputs


class ChatPromptFields(Protocol):
    """What ChatCompletionRequest and TokenizeRequest (with messages) have in common."""
    messages: list[ChatMessage]
    add_generation_prompt: bool
    continue_final_message: bool
    chat_template_kwargs: dict | None


def render_chat_prompt(inputs: InputProcessor, req: ChatPromptFields, *,
                       chat_template: str | None, tools: list[dict] | None,
                       add_special_tokens: bool, template_kwargs: dict | None
                       ) -> tuple[list[int], MultiModalInputs | None]:
    """Worker thread: the prompt ids (image placeholders expanded) and the images'
    payload; InputError naming the field at fault. tools: the request's tools, checked
    (api/tools.tool_setup); template_kwargs: the request's chat_template_kwargs over the
    server's defaults."""
    return inputs.render_chat_mm([m.model_dump() for m in req.messages],
                              chat_template=chat_template,
                              add_generation_prompt=req.add_generation_prompt,
                              continue_final_message=req.continue_final_message,
                              template_kwargs=template_kwargs, tools=tools,
                              add_special_tokens=add_special_tokens)


def tokenize_request(inputs: InputProcessor, req: TokenizeRequest, *,
                     chat_template: str | None, template_kwargs: dict | None) -> list[int]:
    """Worker thread: /tokenize's ids, for a prompt (special tokens by default) or for
    messages exactly as chat renders them (none by default; tools checked as chat checks
    them). InputError naming the field at fault."""
    if (req.prompt is None) == (req.messages is None):
        raise InputError("give exactly one of 'prompt' and 'messages'", "prompt")
    if req.prompt is not None:
        defaults = type(req).model_fields
        chat_only = [f for f in CHAT_ONLY_TOKENIZE_FIELDS
                     if getattr(req, f) not in (None, [], {}, defaults[f].default)]
        if chat_only:
            raise InputError(f"{chat_only[0]} applies to messages, not to a prompt",
                             chat_only[0])
        return inputs.tokenize(req.prompt,
                               add_special_tokens=req.add_special_tokens is not False)
    return render_chat_prompt(inputs, req, chat_template=chat_template,
                              tools=tool_setup(req.tools, "none", auto_parser=None).tools,
                              add_special_tokens=bool(req.add_special_tokens),
                              template_kwargs=template_kwargs)[0]


def response_role(req: ChatPromptFields) -> str:
    """The answer's role: the assistant's after a generation prompt; without one the
    model goes on with the last message, so the answer has its role (as vLLM)."""
    return "assistant" if req.add_generation_prompt else req.messages[-1].role


def echoed_text(req: ChatPromptFields) -> str:
    """What `echo` puts before the answer: the last message's text when it has the
    answer's role (the answer continues it), else nothing (as vLLM)."""
    last = req.messages[-1]
    return message_text(last.content) if last.role == response_role(req) else ""
