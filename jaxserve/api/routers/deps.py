"""Each endpoint family's serving object, for its router's handlers: `install` puts them
on app.state (one set per app), the dependencies below hand them out. (async: a plain
function dependency would run in the thread pool.)"""
from __future__ import annotations

from typing import Annotated

from fastapi import Depends, FastAPI, Request

from jaxserve.api.serving.admin import AdminServing
from jaxserve.api.serving.base import OpenAIServing
from jaxserve.api.serving.chat import ChatServing
from jaxserve.api.serving.completions import CompletionsServing
from jaxserve.api.serving.tokenize import TokenizeServing


def install(app: FastAPI, base: OpenAIServing) -> None:
    """The families' serving objects over `base` (app.state.serving: admission, the
    shutdown's end of every answer, see loading.py)."""
    app.state.serving = base
    app.state.admin = AdminServing(base)
    app.state.completions = CompletionsServing(base)
    app.state.chat = ChatServing(base)
    app.state.tokenize = TokenizeServing(base)


async def _admin(request: Request) -> AdminServing:
    return request.app.state.admin


async def _completions(request: Request) -> CompletionsServing:
    return request.app.state.completions


async def _chat(request: Request) -> ChatServing:
    return request.app.state.chat


async def _tokenize(request: Request) -> TokenizeServing:
    return request.app.state.tokenize


Admin = Annotated[AdminServing, Depends(_admin)]
Completions = Annotated[CompletionsServing, Depends(_completions)]
Chat = Annotated[ChatServing, Depends(_chat)]
Tokenize = Annotated[TokenizeServing, Depends(_tokenize)]
