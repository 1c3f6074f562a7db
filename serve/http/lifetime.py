"""A request's lifetime at the ingress: it ends at its deadline or when its client goes away, whichever first.

The deadline is the request's `timeout_s`, else its `X-Request-Timeout` header (seconds), else the
server's default — and never later than that default: a client may ask for less time than the operator set, not
more (issue 60: one client cannot hold a row past the operator's bound). Past it the request answers 504 (or, once
a stream has started, ends with a 504 error event) and its work is cancelled downstream; the remaining time also
travels with the call to the generator, which drops the request from its batch on its own. A client that
disconnects cancels the work in flight the same way (Starlette cancels a streaming response's iterator; a plain
request's disconnect is watched here), so no replica keeps computing an answer nobody will read.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import Request

from schemas.api import MAX_TIMEOUT_S
from schemas.errors import ApiError, DeadlineExceededError, InvalidHeaderError

TIMEOUT_HEADER = "X-Request-Timeout"
STREAM_GRACE_S = 1.0
T = TypeVar("T")


class ClientClosedError(ApiError):
    """The client disconnected before its answer was ready (nginx's 499: logged, never received)."""

    status_code = 499


def request_timeout_s(http: Request, requested: float | None, default_s: float) -> float:
    """The request's deadline in seconds: the client's (`timeout_s`, else the header), capped at the operator's."""
    if requested is not None:
        return min(requested, default_s)
    header = http.headers.get(TIMEOUT_HEADER)
    if header is None:
        return default_s
    try:
        value = float(header)
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_TIMEOUT_S:  # also rejects nan
        raise InvalidHeaderError(f"{TIMEOUT_HEADER} must be seconds in (0, {MAX_TIMEOUT_S:g}], got {header[:40]!r}")
    return min(value, default_s)


class Lifetime:
    def __init__(self, http: Request, timeout_s: float):
        self.http, self.timeout_s = http, timeout_s
        self.deadline = asyncio.get_running_loop().time() + timeout_s

    def remaining_s(self) -> float:
        return max(self.deadline - asyncio.get_running_loop().time(), 1e-3)

    def expired(self) -> DeadlineExceededError:
        return DeadlineExceededError(f"the request passed its {self.timeout_s:g} s deadline; its work was stopped")

    async def run(self, work: Awaitable[T]) -> T:
        """`work`'s result, unless the deadline passes first (504) or the client goes away (499);
        either way `work` is cancelled, and with it the calls it made downstream."""
        task = asyncio.ensure_future(work)
        watch = asyncio.ensure_future(self._disconnected())
        try:
            done, _ = await asyncio.wait({task, watch}, timeout=self.remaining_s(),
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task  # let the cancellation reach its downstream calls before answering
        if watch in done:
            raise ClientClosedError("the client disconnected; its work was stopped")
        raise self.expired()

    async def stream(self, events: AsyncIterator[T]) -> AsyncIterator[T]:
        """`events` until the deadline; past it the stream is closed (its work cancelled) and 504 raised.
        A client that disconnects cancels this generator where it waits, which closes `events` too.

        The generator ends a stream at the deadline by itself (its engine checks every row at every step,
        and the error travels down the stream); this timer is the backstop, `STREAM_GRACE_S` later."""
        try:
            while True:
                try:
                    async with asyncio.timeout_at(self.deadline + STREAM_GRACE_S):
                        event = await anext(events)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise self.expired() from None
                yield event
        finally:
            await events.aclose()

    async def _disconnected(self) -> None:
        while (await self.http.receive())["type"] != "http.disconnect":
            pass
