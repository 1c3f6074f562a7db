"""A stated nesting limit on every request body: JSON nested deeper than MAX_BODY_DEPTH is a 400 naming the limit,
before any parser or validator recurses into it (docs/SECURITY.md, "Request limits").

Python's JSON parser recurses once per level: 10,000 `[` raise RecursionError (which FastAPI answers with its own
400, or, in a code path that does not expect it, a 500), and a body just under the interpreter's limit still makes
every later recursive walk (validation, echoing, logging) run near it. The check scans the raw bytes: strings
removed (a regex, C speed), the brackets left counted with numpy's cumulative sum; a body holding no more opening
brackets than the limit cannot nest past it and is not scanned at all (every ordinary request).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Deeper than any legitimate request: a tool's JSON Schema (MAX_SCHEMA_DEPTH, 32, checked later with its own
# message) sits ~6 levels down, and the schema checks name their own, smaller limits for what they bound.
MAX_BODY_DEPTH = 256
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)  # a JSON string: its brackets are not nesting
_STEP = np.zeros(256, dtype=np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1


def nesting_depth(body: bytes, limit: int = MAX_BODY_DEPTH) -> int:
    """How deep `body` (JSON text) nests, exact up to `limit`; a body that cannot pass `limit` returns 0 unscanned.
    Malformed JSON gives some depth (the parser refuses it anyway)."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return 0
    steps = _STEP[np.frombuffer(_STRING.sub(b"", body), dtype=np.uint8)]
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0))


class BodyDepthLimit:
    """400 for a request body nesting deeper than `max_depth`, before the route parses it. The body is read whole
    here (under the body-size cap, which wraps this) and replayed to the app; a failure while reading it (the cap's
    413) is replayed too, so the route's handlers answer it as before."""

    def __init__(self, app: ASGIApp, respond: Callable[[Request, int, str], object],
                 on_error: Callable[[Request, int], None], max_depth: int = MAX_BODY_DEPTH):
        self.app, self.respond, self.on_error, self.max_depth = app, respond, on_error, max_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        failure: Exception | None = None
        try:
            while True:
                message = await receive()
                messages.append(message)
                if message["type"] != "http.request" or not message.get("more_body", False):
                    break
        except Exception as error:  # noqa: BLE001  the size cap's 413: replayed where the route reads the body
            failure = error
        if failure is None and messages and messages[-1]["type"] == "http.request":
            body = b"".join(m.get("body", b"") for m in messages)
            if nesting_depth(body, self.max_depth) > self.max_depth:
                request = Request(scope)
                self.on_error(request, 400)
                detail = f"request body nests deeper than {self.max_depth} levels of JSON (the limit)"
                await self.respond(request, 400, detail)(scope, receive, send)
                return
            messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def replay() -> Message:
            if messages:
                return messages.pop(0)
            if failure is not None:
                raise failure
            return await receive()

        await self.app(scope, replay, send)
