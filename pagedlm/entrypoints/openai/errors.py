"""Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`.

Every failure the server can answer — our own checks, FastAPI's schema validation,
routing errors, unexpected exceptions — goes through `error_response`, so a client
sees one shape and the status OpenAI would use (400 rather than FastAPI's 422).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedlm.engine.request_stream import EngineDeadError, QueueFullError, RequestFailedError

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
}
# Retry-After seconds for a full waiting queue: the queue drains at the engine's pace,
# and a second is a typical step-to-step horizon under load.
QUEUE_FULL_RETRY_AFTER_S = 1


class APIError(Exception):
    """An error to send to the client as is."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def error_body(status_code: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    error_type = _TYPE_BY_STATUS.get(status_code, "server_error" if status_code >= 500
                                     else "invalid_request_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(status_code: int, message: str, param: str | None = None,
                   code: str | None = None,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status_code, message, param, code), status_code=status_code,
                        headers=dict(headers or {}))


# Status of a request the engine ended with an error, by its code (others: 500).
_FAILED_STATUS = {"server_shutting_down": 503}
# Retry-After seconds while the server drains: its replacement is usually up by then.
SHUTDOWN_RETRY_AFTER_S = 5


def failed_request_error(exc: RequestFailedError) -> APIError:
    status = _FAILED_STATUS.get(exc.code, 500)
    headers = {"Retry-After": str(SHUTDOWN_RETRY_AFTER_S)} if status == 503 else None
    return APIError(status, str(exc), code=exc.code, headers=headers)


def queue_full_error(exc: QueueFullError) -> APIError:
    return APIError(503, str(exc), code="queue_full",
                    headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)})


# pydantic puts union members and validator kinds into `loc`; they mean nothing to a
# client ("prompt.list[int].0" reads better as "prompt.0").
_TYPE_TAG = re.compile(r"^(str|int|float|bool|dict|list|none|.*[\[\-].*)$")


def _describe_validation_errors(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    # A value that fails a union (stop: str | list[str]) fails every member; the member
    # whose check went past the type ("too long" rather than "not a string") is the one
    # the client meant.
    first = next((e for e in errors if not str(e.get("type", "")).endswith("_type")), errors[0])
    loc = [p for p in first.get("loc", ()) if not (isinstance(p, str) and _TYPE_TAG.match(p))]
    if loc and loc[0] == "body":
        loc = loc[1:]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg')}", None
    if not loc and first.get("type") == "missing":
        return "the request body is missing: send a JSON object", None
    where = ".".join(str(p) for p in loc) or "request body"
    message = f"{where}: {first.get('msg')}"
    fields = {e.get("loc", ())[1:2] for e in errors} - {first.get("loc", ())[1:2]}
    if fields:
        message += f" (and errors in {len(fields)} other field(s))"
    param = str(loc[0]) if loc else None
    return message, param


def install_exception_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status_code, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation_errors(exc.errors())
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        # FastAPI answers an unparseable body (e.g. invalid UTF-8) with a bare 400.
        message = str(exc.detail) if exc.detail else "error"
        return error_response(status, message, headers=exc.headers)

    @app.exception_handler(QueueFullError)
    async def _queue_full(_: Request, exc: QueueFullError) -> JSONResponse:
        err = queue_full_error(exc)
        return error_response(err.status_code, err.message, code=err.code, headers=err.headers)

    @app.exception_handler(RequestFailedError)
    async def _request_failed(_: Request, exc: RequestFailedError) -> JSONResponse:
        err = failed_request_error(exc)
        return error_response(err.status_code, err.message, code=err.code, headers=err.headers)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc), code="engine_dead")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error ({type(exc).__name__})",
                              code="internal_error")
