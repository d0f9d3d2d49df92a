"""What a client is told when FastAPI or a route raises: every error in OpenAI's shape
(errors.error_body), a body FastAPI cannot validate as a 400 naming its field (never
FastAPI's 422). What no handler catches is InternalErrors' one logged 500."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxserve.api.errors import APIError, error_body, error_response


def install(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)


async def _on_api_error(request: Request, err: APIError) -> JSONResponse:
    return error_response(err)


async def _on_validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
    first = _most_specific(err.errors())
    loc = [str(x) for x in first.get("loc", ()) if x != "body" and not _is_union_tag(x)]
    if first.get("type") == "json_invalid":
        message, param = "malformed JSON body", None
    elif not loc:   # a whole-body check (e.g. Unicode) names its field itself
        message, param = first.get("msg", "invalid body"), first.get("ctx", {}).get("field")
    else:
        message = f"{'.'.join(loc)}: {first.get('msg', 'invalid value')}"
        param = loc[0]
    return JSONResponse(error_body(400, message, param), status_code=400)


async def _on_http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    # The framework's own 404 / 405 ..., in OpenAI's error shape too.
    return JSONResponse(error_body(err.status_code, str(err.detail)),
                        status_code=err.status_code, headers=err.headers)


def _most_specific(errors: list[dict]) -> dict:
    """A value that fits no branch of a union (prompt: str | list[int] | ...) gets an
    error per branch; the one that is not a mere type mismatch says what is wrong."""
    specific = [e for e in errors if not e.get("type", "").endswith("_type")]
    return (specific or errors or [{}])[0]


_BUILTIN_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _is_union_tag(part: Any) -> bool:
    """pydantic names the union branch in an error's location ('list[constrained-int]')."""
    return isinstance(part, str) and ("[" in part or "-" in part or part in _BUILTIN_TAGS)
