"""Stated limits on a request body's JSON shape, checked on the raw bytes before any parser or validator walks it,
and its size charged before it is parsed (docs/SECURITY.md, "Request limits" and "Cost").

- **Nesting**: JSON nested deeper than MAX_BODY_DEPTH is a 400 naming the limit. Python's JSON parser recurses once
  per level: 10,000 `[` raise RecursionError (which FastAPI answers with its own 400, or, in a code path that does
  not expect it, a 500), and a body just under the interpreter's limit still makes every later recursive walk
  (validation, echoing, logging) run near it.
- **Containers** (JSON objects and arrays): validation costs per container, not per byte (~3 µs each: a chat
  request of 256 messages × 64 text parts, 519 KB, took ~50 ms to validate where 8 MB of image data takes ~1 ms),
  and pydantic holds the GIL while it validates, so a worker thread does not give the event loop its time back.
  So a body holds at most MAX_BODY_CONTAINERS, and each CONTAINERS_PER_REQUEST beyond the first are charged as one
  more request to the tenant's request rate before the body is parsed: a tenant's validation time per second is
  bounded by its rate (20 requests/s: ≤ ~60 ms/s beyond its ordinary requests'). Bytes cost the loop too (read,
  scanned, parsed: ~5 ms per MiB), so each BYTES_PER_REQUEST (1 MiB) past the first is charged as one more request.

The scan removes strings (a regex, C speed; their brackets are not structure) and counts the brackets left, with
numpy's cumulative sum for the depth; a body holding no more brackets than the free allowance and the depth limit
is not scanned at all (every ordinary request). A large body is scanned on the parsing worker (serve/http/parsing.py;
a 16 MiB body: ~70 ms).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import numpy as np
from fastapi import Request, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.http.parsing import off_the_loop

# Deeper than any legitimate request: a tool's JSON Schema (MAX_SCHEMA_DEPTH, 32, checked later with its own
# message) sits ~6 levels down, and the schema checks name their own, smaller limits for what they bound.
MAX_BODY_DEPTH = 256
# Past any legitimate request: 2,048 embeddings inputs given as token arrays are 2,049; 128 tools with the 1,024
# subschemas a request may carry ~1,400; 256 messages of a few parts each ~1,000. ~12 ms of validation at most.
MAX_BODY_CONTAINERS = 4_096
# Containers one request's charge covers: ~3 ms of validation. Each further 1,024 is one more request charged.
CONTAINERS_PER_REQUEST = 1_024
# Bytes one request's charge covers: reading, scanning and parsing cost ~5 ms per MiB (a 15 MB body of text: ~60 ms of
# the loop), so each further MiB is one more request charged too (an 8 MiB image's data URL: ~10 more)
BYTES_PER_REQUEST = 1 << 20
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)  # a JSON string: its brackets are not nesting
_STEP = np.zeros(256, dtype=np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1


class BodyShape(NamedTuple):
    depth: int  # nesting, exact up to the limit scanned for; 0 for a body that cannot pass it (unscanned)
    containers: int  # JSON objects and arrays; brackets in strings counted too where that stays under the limits


def body_shape(body: bytes, max_depth: int = MAX_BODY_DEPTH,
               free_containers: int = CONTAINERS_PER_REQUEST) -> BodyShape:
    """The shape of `body` (JSON text). Malformed JSON gives some shape (the parser refuses it anyway)."""
    opening = body.count(b"[") + body.count(b"{")
    if opening <= min(max_depth, free_containers):
        return BodyShape(0, opening)
    steps = _STEP[np.frombuffer(_STRING.sub(b"", body), dtype=np.uint8)]
    return BodyShape(int(np.cumsum(steps, dtype=np.int64).max(initial=0)), int(np.count_nonzero(steps == 1)))


def nesting_depth(body: bytes, limit: int = MAX_BODY_DEPTH) -> int:
    """How deep `body` nests, exact up to `limit`; a body that cannot pass `limit` returns 0 unscanned."""
    return body_shape(body, limit, limit).depth


def extra_requests(containers: int, nbytes: int) -> int:
    """The requests a body of `containers` objects and arrays and `nbytes` bytes is charged beyond its own."""
    return containers // CONTAINERS_PER_REQUEST + nbytes // BYTES_PER_REQUEST


class BodyShapeLimit:
    """400 for a request body nesting deeper than `max_depth` or holding more than `max_containers`, and the charge
    of its containers (`charge(request, extra requests)`, a response to send instead when refused), before the
    route parses it. The body is read whole here (under the body-size cap, which wraps this) and replayed to the
    app; a failure while reading it (the cap's 413) is replayed too, so the route's handlers answer it as before."""

    def __init__(self, app: ASGIApp, respond: Callable[[Request, int, str], object],
                 on_error: Callable[[Request, int], None],
                 charge: Callable[[Request, int], Awaitable[Response | None]] | None = None,
                 max_depth: int = MAX_BODY_DEPTH, max_containers: int = MAX_BODY_CONTAINERS):
        self.app, self.respond, self.on_error, self.charge = app, respond, on_error, charge
        self.max_depth, self.max_containers = max_depth, max_containers

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
            refusal = await self.refusal(Request(scope), body)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
            messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def replay() -> Message:
            if messages:
                return messages.pop(0)
            if failure is not None:
                raise failure
            return await receive()

        await self.app(scope, replay, send)

    async def refusal(self, request: Request, body: bytes) -> object | None:
        """The response refusing `body` (its shape past a limit, or its charge refused), or None."""
        shape = await off_the_loop(len(body), body_shape, body, self.max_depth)
        detail = None
        if shape.depth > self.max_depth:
            detail = f"request body nests deeper than {self.max_depth} levels of JSON (the limit)"
        elif shape.containers > self.max_containers:
            detail = (f"request body holds {shape.containers} JSON objects and arrays; the limit is "
                      f"{self.max_containers}")
        if detail is not None:
            self.on_error(request, 400)
            return self.respond(request, 400, detail)
        extra = extra_requests(shape.containers, len(body))
        return await self.charge(request, extra) if extra and self.charge is not None else None
