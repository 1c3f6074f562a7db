"""A large request body is parsed and validated on a worker thread, not on the ingress's event loop (issue 60 item 1).

FastAPI reads a route's JSON body and validates it against the route's model inside the event loop. That work is
linear in the body but not small: a chat request of 256 messages × 64 text parts (519 KB) took ~4 ms to parse and
~50 ms to validate, 128 tools of 55 KB schemas (7 MB) ~6 ms and ~24 ms, and every other request and `/healthz` waited
behind it. Here a body over INLINE_BODY_NBYTES is parsed and validated on a worker (FastAPI's own calls: `json.loads`
and the route's body field's `validate`, so the value and every error are the ones FastAPI gives), and the route
receives the validated model; a smaller body (every ordinary request) is parsed inline, as before.

The work stays bounded by the body-size cap (16 MiB) and the body's nesting limit (serve/http/body_shape.py, which
runs first): it cannot be interrupted, so its time is capped by what it may read, not by a timer. It runs after the
key and the rate charge (serve/http/guards.py), so a tenant past its rate is refused before its body is read.
"""

from __future__ import annotations

import asyncio
import email.message
import json
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Request, Response, params
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

from pipeline.priority import BULK_NICE, lower_priority

# Bodies up to this are parsed inline: ~1.5 ms at the worst measured rate (~0.1 ms per KB, text parts of two
# characters), less than a thread hop's queueing behind a large body would cost the ordinary request.
INLINE_BODY_NBYTES = 16 << 10

# Two threads: one large body does not queue another behind it; the GIL makes more of them no faster. At BULK_NICE:
# the loop, `/healthz` and small requests get the cores first (issue 60; the serve shape's wide-JSON probe alone beside
# b, docs/RELIABILITY.md).
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="qvpic-parse", initializer=lower_priority,
                           initargs=(BULK_NICE,))

T = TypeVar("T")


async def off_the_loop(nbytes: int, work: Callable[..., T], *args: Any) -> T:
    """`work(*args)`, for input of `nbytes`: inline up to INLINE_BODY_NBYTES, else on the parsing worker."""
    if nbytes <= INLINE_BODY_NBYTES:
        return work(*args)
    return await asyncio.get_running_loop().run_in_executor(_POOL, work, *args)


def json_typed(request: Request) -> bool:
    """Whether FastAPI parses `request`'s body as JSON: an `application/json` or `application/*+json` content type
    (FastAPI's strict default; a body without one is validated as bytes and refused)."""
    value = request.headers.get("content-type")
    if not value:
        return False
    message = email.message.Message()
    message["content-type"] = value
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


class ReadRequest(Request):
    """`request` with its body already read, or its read's failure (the body cap's 413), and, when it was validated
    on the worker, the validated value: FastAPI's handler reads the body from here (`json()` is what it validates;
    a model instance passes its validation as is)."""

    def __init__(self, request: Request, body: bytes = b"", failure: Exception | None = None,
                 value: object = None):
        super().__init__(request.scope, request.receive)
        self._read, self._failure, self._value = body, failure, value

    async def body(self) -> bytes:
        if self._failure is not None:
            raise self._failure
        return self._read

    async def json(self) -> Any:
        return self._value


def validated(route: APIRoute, body: bytes) -> object:
    """`body` parsed and validated as `route`'s body, or RequestValidationError as FastAPI raises it: a JSON error
    at its position, or the field errors located under `body`."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError as error:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", error.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": error.msg}}], body=error.doc) from None
    value, errors = route.body_field.validate(data, {}, loc=("body",))
    if errors:
        raise RequestValidationError(errors, body=data)
    return value


class WorkerParsedRoute(APIRoute):
    """An APIRoute whose JSON body, over INLINE_BODY_NBYTES, is parsed and validated on the parsing worker. Routes
    without a body, or with several body parameters or a form, are FastAPI's as they are."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()
        if not self.parses_one_json_body():
            return handle

        async def parsed_first(request: Request) -> Response:
            try:
                body = await request.body()
            except Exception as error:  # noqa: BLE001  the body cap's 413: FastAPI's handler answers it as before
                return await handle(ReadRequest(request, failure=error))
            if len(body) <= INLINE_BODY_NBYTES or not json_typed(request):
                return await handle(request)
            value = await off_the_loop(len(body), validated, self, body)
            return await handle(ReadRequest(request, body, value=value))

        return parsed_first

    def parses_one_json_body(self) -> bool:
        """Whether the body is one JSON value validated whole: not a form, not several fields embedded by name
        (FastAPI's own flag, read with a fallback: where it is absent the route is left as FastAPI's)."""
        return (self.body_field is not None and not isinstance(self.body_field.field_info, params.Form)
                and getattr(self, "_embed_body_fields", True) is False)
