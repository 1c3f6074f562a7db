"""Request guards of the HTTP surface: body limits and the failure answers no route gives itself.

- A body over `max_body_nbytes` (16 MiB by default: images travel as data URLs) is refused with 413 before it
  is parsed: at once when its declared Content-Length is over, else as soon as the bytes streamed in (chunked,
  or a length that lied) pass the cap (Starlette's `RequestBodyLimitMiddleware` counts them).
- A replica that dies or cannot be reached while serving a request (Serve restarts it) answers 503 with
  `Retry-After`, as JSON, instead of a bare 500.
- A body nesting deeper than MAX_BODY_DEPTH (256) levels, or holding more than MAX_BODY_CONTAINERS (4,096) JSON
  objects and arrays, is a 400 naming the limit, and every further 1,024 of them are charged as a request, before
  it is parsed (serve/http/body_shape.py). One that is not UTF-8 or holds a number Python will not parse (over
  4300 digits) is a 422 like any malformed JSON (FastAPI answers those 400).
- With no API keys (the loopback mode), a request whose Host is not localhost, 127.0.0.1 or [::1] is a 400:
  DNS rebinding cannot turn a browser into a client of the unauthenticated API.
- A 422 names each invalid field, its rule and limit (FastAPI's error list) but never echoes the input;
  what it names is spelled so JSON can carry it: `NaN`/`Infinity` (Python's parser accepts them; `1e400`
  parses to infinity) as strings, lone surrogates (`"\\ud800"`) escaped. FastAPI's own handler crashes on
  both, turning a bad request into a plain-text 500.
- Anything else that escapes a route is a JSON 500 in the route's shape, never a plain-text page.
- Every error here keeps FastAPI's `{"detail": …}` body, and takes OpenAI's error shape on the
  OpenAI-compatible routes, like every other error there. A path no route serves is OpenAI's 404
  (`Invalid URL (GET /path)`) everywhere: what a client written for OpenAI or vLLM reads.

Per-field limits (chunk count, query length, `max_new_tokens`, unknown fields, no paths or URIs) are
in the request models of schemas/api.py, whose numbers and booleans take only what their JSON Schema
says (schemas/wire.py); `max_chunks` and the context size are checked by the router.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from ray.serve.exceptions import RayServeException
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware.body_limit import RequestBodyLimitMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from schemas.errors import UnauthorizedError
from serve.governance.auth import Authenticator, is_loopback
from serve.http.backend import REPLICA_FAILURES, api_error, internal_detail
from serve.http.body_shape import BodyShapeLimit
from serve.http.openai import is_openai_path, openai_error, openai_invalid
from serve.ui import STATIC_UI_PATHS, STATIC_UI_PREFIX

DEFAULT_MAX_BODY_NBYTES = 16 << 20  # a conversation with images as data URLs (schemas/conversation.py bounds each)
RETRY_AFTER_S = 1
log = logging.getLogger(__name__)
# bytes that are not UTF-8 (a ValueError), JSON nested past the parser, an integer of over 4300 digits
UNPARSABLE = (ValueError, RecursionError)
MAX_ECHO_DEPTH = 64  # nesting of an echoed input beyond which it is elided


def json_safe(value: Any, depth: int = 0) -> Any:
    """`value` (a request's parsed JSON, or a validation error holding it) in a form JSON can carry:
    non-finite floats as the strings `NaN`, `Infinity` and `-Infinity`; lone surrogates backslash-escaped."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, (dict, list, tuple)) and depth >= MAX_ECHO_DEPTH:
        return "..."
    if isinstance(value, dict):
        return {json_safe(str(k)): json_safe(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v, depth + 1) for v in value]
    return value


def validation_messages(error: RequestValidationError) -> str:
    """One line naming every invalid field: `body.temperature: Input should be a finite number; ...`."""
    return json_safe("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors()))


def error_response(request: Request, status: int, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    if is_openai_path(request.url.path):
        return openai_error(status, detail, headers)
    return JSONResponse(status_code=status, content={"detail": detail}, headers=headers)


class DeclaredLengthLimit:
    """413 for a body whose declared Content-Length is over the cap, before the app reads a byte (and
    in the route's error shape: Starlette's middleware would answer plain text)."""

    def __init__(self, app: ASGIApp, max_body_nbytes: int, on_error: Callable[[Request, int], None]):
        self.app, self.max_body_nbytes, self.on_error = app, max_body_nbytes, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        declared = Headers(scope=scope).get("content-length", "") if scope["type"] == "http" else ""
        if declared.isdigit() and int(declared) > self.max_body_nbytes:
            request = Request(scope, receive)
            self.on_error(request, 413)
            detail = f"request body of {int(declared)} bytes is over the {self.max_body_nbytes}-byte limit"
            await error_response(request, 413, detail)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class KeyGate:
    """With API keys configured, 401 for a request without a valid one before any route runs, on every path but
    the open ones (`auth.open_paths`: the probes by default; and the inspector's static pages, which hold no
    data: their data calls send the key). Routes still take their tenant from the key themselves."""

    def __init__(self, app: ASGIApp, auth: Authenticator, is_open: Callable[[str], bool],
                 on_error: Callable[[Request, int], None]):
        self.app, self.auth, self.is_open, self.on_error = app, auth, is_open, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and self.auth.required and not self.is_open(path):
            request = Request(scope, receive)
            try:
                self.auth.tenant(request.headers)
            except UnauthorizedError as error:
                self.on_error(request, 401)
                await error_response(request, 401, str(error), error.headers())(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ChargeOnArrival:
    """`charge(request)` before the body is read: the request rate is charged on arrival (`Governor.arrive`), so a
    tenant past its rate gets its 429 without the ingress reading, parsing or validating its body. `charge`
    returns the error response to send, or None to go on."""

    def __init__(self, app: ASGIApp, charge: Callable[[Request], Awaitable[Response | None]]):
        self.app, self.charge = app, charge

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = await self.charge(Request(scope, receive))  # shares scope["state"] with the route's Request
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


class LoopbackHostGate:
    """With no API keys and no `insecure_no_auth` (the loopback mode: `exposure` refuses any wider bind), 400 for a
    request whose Host is not a loopback name: a web page on evil.com whose DNS later answers 127.0.0.1 (DNS
    rebinding) would otherwise drive the unauthenticated API from the user's browser as its own origin. A browser
    always sends the name it resolved, so the page's requests carry `evil.com`; local clients send `localhost` or a
    loopback address (an IP literal in Host names no DNS record, so it cannot be rebound)."""

    def __init__(self, app: ASGIApp, auth: Authenticator, on_error: Callable[[Request, int], None]):
        self.app, self.auth, self.on_error = app, auth, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.auth.loopback_only:
            host = Headers(scope=scope).get("host")
            if not is_loopback(host_name(host) or "example.invalid"):  # localhost or a loopback IP literal
                request = Request(scope, receive)
                self.on_error(request, 400)
                detail = ("this Host is not served: with no API keys this server answers only Host localhost, "
                          "127.0.0.1 or [::1] (any loopback address, any port)")  # the header is not echoed
                await error_response(request, 400, detail)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def host_name(host: str | None) -> str | None:
    """The name of a Host header without its port, lowercased: `[::1]:8000` → `[::1]`, `LocalHost:80` → `localhost`."""
    if host is None:
        return None
    host = host.strip().lower()
    end = host.find("]") + 1 if host.startswith("[") else 0  # an IPv6 literal holds colons of its own
    rest, colon, port = host[end:].partition(":")
    return host[:end] + rest if not colon or port.isdigit() else None


class ReleaseTurn:
    """Once a request's response is over — sent, streamed to its end, failed, or abandoned by the client — its
    turn's in-flight slot is given back (`Governor.release`): a `finally` around the whole ASGI call, so no path
    (a cancellation included) keeps a slot."""

    def __init__(self, app: ASGIApp, release: Callable[[Any], None]):
        self.app, self.release = app, release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            self.release((scope.get("state") or {}).get("turn"))


def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
    """422: FastAPI's body (`detail`: a list of errors, each echoing its input) natively; on the OpenAI-compatible
    routes a 400 in OpenAI's shape (one message naming every field, `param` the first one's path)."""
    if is_openai_path(request.url.path):
        return openai_invalid(error.errors(), validation_messages(error))
    # FastAPI's list of errors, without the `input` each one echoes (a 100,000-character query came back as a
    # 100 kB error, and an echo reflects whatever a caller sent): the field, the rule and its limit suffice.
    return JSONResponse(status_code=422, content={"detail": [
        {"type": e["type"], "loc": json_safe(list(e["loc"])), "msg": json_safe(e["msg"]),
         **({"ctx": jsonable_encoder(json_safe(limits))} if (limits := echo_free_ctx(e)) else {})}
        for e in error.errors()]})


def echo_free_ctx(error: dict) -> dict:
    """The limits of a validation error (`max_length`, `le`, `expected` …): its numbers and short strings."""
    return {k: v for k, v in (error.get("ctx") or {}).items()
            if isinstance(v, (int, float)) or (isinstance(v, str) and len(v) <= 200)}


def install_guards(app: FastAPI, on_error: Callable[[Request, int], None], auth: Authenticator,
                   max_body_nbytes: int = DEFAULT_MAX_BODY_NBYTES,
                   charge: Callable[[Request], Awaitable[Response | None]] | None = None,
                   charge_shape: Callable[[Request, int], Awaitable[Response | None]] | None = None) -> None:
    """Add the key gate, the body cap and the handlers above to `app`; `on_error(request, status)` sees every
    error sent. `charge`: the arrival charge (`ChargeOnArrival`), after the key gate and before any body limit
    reads the body; `charge_shape`: the extra requests a body's JSON containers cost, before it is parsed."""
    if max_body_nbytes < 1:
        raise ValueError(f"max_body_nbytes must be >= 1, got {max_body_nbytes}")
    # inside the size cap: 400 for a body nesting past MAX_BODY_DEPTH or holding more than MAX_BODY_CONTAINERS,
    # and its containers charged, before the route parses it
    app.add_middleware(BodyShapeLimit, respond=error_response, on_error=on_error, charge=charge_shape)
    app.add_middleware(RequestBodyLimitMiddleware, max_body_size=max_body_nbytes)  # counts what arrives
    app.add_middleware(DeclaredLengthLimit, max_body_nbytes=max_body_nbytes, on_error=on_error)
    if charge is not None:
        app.add_middleware(ChargeOnArrival, charge=charge)  # a tenant past its rate: 429 before its body is read
    is_open = (lambda path: path in auth.open_paths or path in STATIC_UI_PATHS  # noqa: E731
               or path.startswith(STATIC_UI_PREFIX))
    app.add_middleware(KeyGate, auth=auth, is_open=is_open, on_error=on_error)  # 401 costs nothing
    app.add_middleware(LoopbackHostGate, auth=auth, on_error=on_error)  # runs first: no keys, loopback Host only

    async def invalid(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, RequestValidationError)
        on_error(request, 400 if is_openai_path(request.url.path) else 422)
        return invalid_request(request, error)

    async def http_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException)
        if isinstance(error.__cause__, UNPARSABLE):
            cause = error.__cause__
            detail = f"body is not JSON: {type(cause).__name__}: {json_safe(str(cause))[:200]}"
            return await invalid(request, RequestValidationError(
                [{"type": "json_invalid", "loc": ("body",), "msg": detail, "input": {}}]))
        on_error(request, error.status_code)
        if error.status_code == 404 and error.detail == "Not Found":  # no route serves the path: OpenAI's answer,
            # in its shape on every path (clients written for OpenAI or vLLM read `error.message`)
            where = json_safe(f"{request.method} {request.url.path}"[:300])
            return openai_error(404, f"Invalid URL ({where})", error.headers)
        detail = (f"request body is over the {max_body_nbytes}-byte limit" if error.status_code == 413
                  else str(error.detail))
        return error_response(request, error.status_code, detail, error.headers)

    async def replica_failed(request: Request, error: Exception) -> JSONResponse:
        status, detail = api_error(error)
        on_error(request, status)
        return error_response(request, status, detail, {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None)

    async def crashed(request: Request, error: Exception) -> JSONResponse:  # Starlette re-raises it to log
        on_error(request, 500)
        turn = getattr(request.state, "turn", None)  # a governed request's id is in its log record and header
        request_id = turn.record.request_id if turn is not None else uuid.uuid4().hex
        log.error("internal error, request id %s", request_id, exc_info=error)  # the detail stays here
        return error_response(request, 500, internal_detail(request_id), {"X-Request-Id": request_id})

    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, crashed)
    for failure in (*REPLICA_FAILURES, RayServeException):  # the latter: api_error finds a replica's death in it
        app.add_exception_handler(failure, replica_failed)
