"""Where governance state lives: in this ingress replica's memory, or in Redis shared by every replica.

Redis is an optimisation, never a dependency of answering: `RedisConnection.call` runs a command on
a worker thread (the sync client is loop-agnostic and its pool thread-safe), and when Redis is down or
slow it raises `SharedStateUnavailable` after a short timeout, counts it, and then fails fast (no
network call at all) for `retry_after_s`, so an outage costs one timeout, not one per request.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import redis

from schemas.redis_url import redacted, scrub
from serve.metrics import serve_metrics

T = TypeVar("T")
log = logging.getLogger(__name__)


class SharedStateUnavailable(RuntimeError):
    """Redis did not answer; the caller degrades (a cache miss, a replica-local rate limit)."""


class RedisConnection:
    def __init__(self, url: str, timeout_s: float = 0.25, retry_after_s: float = 5.0):
        self.url = redacted(url)  # for logs and errors: never the password
        self._raw = url  # only to scrub its secrets out of the client's error messages
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.retry_after_s = retry_after_s
        self._down_until = 0.0  # time.monotonic() before which Redis is not tried again
        self._lock = threading.Lock()

    async def call(self, use: str, command: Callable[[redis.Redis], T]) -> T:
        """`command(client)` off the event loop; `use` names the caller in the log and the error metric."""
        if time.monotonic() < self._down_until:
            serve_metrics().shared_state_errors.inc(use=use)
            raise SharedStateUnavailable(f"redis at {self.url} is marked down")
        try:
            return await asyncio.to_thread(command, self.client)
        except redis.RedisError as error:
            with self._lock:
                first = time.monotonic() >= self._down_until
                self._down_until = time.monotonic() + self.retry_after_s
            message = scrub(str(error), self._raw)  # a client error may quote the URL it was given
            if first:
                log.warning("redis at %s unavailable for %s (%s); degrading for %.0f s",
                            self.url, use, message, self.retry_after_s)
            serve_metrics().shared_state_errors.inc(use=use)
            raise SharedStateUnavailable(message) from None

    def close(self) -> None:
        self.client.close()
