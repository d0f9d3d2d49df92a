"""Server-sent events: each chunk one `data:` event, an error as an event in OpenAI's
shape (a stream cannot change its status any more), `[DONE]` last."""
from __future__ import annotations

import json
from typing import Any, AsyncIterator

from fastapi.responses import StreamingResponse

from jaxserve.api.errors import APIError, error_body
from jaxserve.api.internal_errors import log_unexpected
from jaxserve.api.serving.base import Answer


def data(obj: dict) -> str:
    """One event."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events that close their answer when the response is done, even
    when the body never started (the client left before the first byte)."""

    def __init__(self, body: AsyncIterator[str], answer: Answer):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.answer = answer

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.answer.close()


def sse(chunks: AsyncIterator[str], answer: Answer) -> StreamingResponse:
    """The response that streams `chunks` (events) for an admitted answer."""
    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        except APIError as e:
            yield data(error_body(e.status, e.message, e.param))
        except Exception as e:  # noqa: BLE001 - a stream cannot change its status any more
            log_unexpected("stream failed", e)
            yield data(error_body(500, f"internal error: {e}"))
        yield "data: [DONE]\n\n"
    return EventStream(body(), answer)
