"""Request limits and failure answers of the HTTP surface that no route handles itself.

- A body over `max_body_nbytes` (1 MiB by default) is refused with 413 before it is parsed, whether the
  client declared its length or streams it chunked (Starlette's `RequestBodyLimitMiddleware`).
- A replica that dies or cannot be reached while serving a request (Serve restarts it) answers 503 with
  `Retry-After`, as JSON, instead of a bare 500.
- Every HTTPException (413 above, 404 unknown path, 405 wrong method) keeps FastAPI's `{"detail": …}`
  body, and takes OpenAI's error shape on the OpenAI-compatible routes like every other error there.
  A body that is not UTF-8, or nests deeper than the JSON parser goes, is a 422 like any malformed
  JSON (FastAPI answers those 400).

Per-field limits (chunk count, query length, `max_new_tokens`, unknown fields, no paths or URIs) are
in the request models of schemas/api.py; `max_chunks` and the context size are checked by the router.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.middleware.body_limit import RequestBodyLimitMiddleware

from serve import openai_api
from serve.backend import REPLICA_FAILURES, api_error

DEFAULT_MAX_BODY_NBYTES = 1 << 20  # the largest valid request (1024 ids of 256 characters) is ~300 KB
RETRY_AFTER_S = 1
UNPARSABLE = (UnicodeDecodeError, RecursionError)  # bytes that are not UTF-8; JSON nested past the parser


def install_limits(app: FastAPI, on_error: Callable[[Request, int], None],
                   max_body_nbytes: int = DEFAULT_MAX_BODY_NBYTES) -> None:
    """Add the body cap and the handlers above to `app`; `on_error(request, status)` sees every error sent."""
    if max_body_nbytes < 1:
        raise ValueError(f"max_body_nbytes must be >= 1, got {max_body_nbytes}")
    app.add_middleware(RequestBodyLimitMiddleware, max_body_size=max_body_nbytes)

    async def http_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException)
        if isinstance(error.__cause__, UNPARSABLE):  # FastAPI's 400 for these; malformed JSON is a 422
            detail = f"body is not JSON: {type(error.__cause__).__name__}"
            invalid = RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": detail, "input": {}}])
            return await app.exception_handlers[RequestValidationError](request, invalid)
        on_error(request, error.status_code)
        if request.url.path.startswith(openai_api.PATH_PREFIX):
            return openai_api.openai_error(error.status_code, str(error.detail), error.headers)
        return await http_exception_handler(request, error)

    async def replica_failed(request: Request, error: Exception) -> JSONResponse:
        status, detail = api_error(error)
        on_error(request, status)
        headers = {"Retry-After": str(RETRY_AFTER_S)}
        if request.url.path.startswith(openai_api.PATH_PREFIX):
            return openai_api.openai_error(status, detail, headers)
        return JSONResponse(status_code=status, content={"detail": detail}, headers=headers)

    app.add_exception_handler(HTTPException, http_error)
    for failure in REPLICA_FAILURES:
        app.add_exception_handler(failure, replica_failed)
