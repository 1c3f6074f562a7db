"""What the HTTP handlers call: the serving roles behind one interface, through Serve handles or in-process.

A request is route → generate: the generator fetches from the loader only the KV entries its device
hot tier lacks (serve/kv/hot_tier.py), so the loaded KV never passes through the ingress, and a request
whose chunks are hot moves none at all. serve/local.py `InProcessBackend` runs the same calls on plain objects (no
Ray), which is how the HTTP surface is tested without a cluster. This module imports no model stack.

A call that is abandoned (the client went away, or the request's deadline passed) is cancelled
downstream (serve/handles.py), and the generator drops the request at its next step.

A replica that dies under a request (its node lost, its process killed) fails the call with an actor
error. `HandleBackend` retries such a call once — Serve's handle has already dropped the dead replica,
so the retry lands on a surviving one — but a stream only before its first event: once the client has
text, a retry would repeat it, so the stream ends with an error event instead (serve/http/ingress.py).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol, TypeVar

from pydantic import BaseModel
from ray.exceptions import ObjectLostError, RayActorError, RayTaskError, WorkerCrashedError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from schemas.api import AnswerRequest
from schemas.sampling import Sampling
from schemas.service import CacheStats
from schemas.utility import TokenizeRequest
from serve.handles import cancelling
from serve.metrics import serve_metrics
from serve.plan import Answer, Embedded, Plan, Tokenized

T = TypeVar("T")
log = logging.getLogger(__name__)


class Backend(Protocol):
    # `collections`: the authenticated tenant's grant (only their chunks exist for the request); `cache_salt`: that
    # tenant's salt, under which the router remembers query vectors
    async def route(self, request: AnswerRequest, budget_tokens: int | None,
                    collections: frozenset[str], cache_salt: bytes = b"") -> Plan: ...
    async def generate(self, plan: Plan, sampling: Sampling, timeout_s: float | None = None) -> Answer: ...
    def stream(self, plan: Plan, sampling: Sampling, timeout_s: float | None = None) -> AsyncIterator[str | Answer]: ...
    async def cache_stats(self) -> CacheStats: ...
    async def device_cache_stats(self) -> CacheStats: ...
    async def embed(self, texts: list[str]) -> Embedded: ...
    async def tokenize(self, request: TokenizeRequest) -> Tokenized: ...
    async def detokenize(self, tokens: list[int]) -> str: ...


class HandleBackend:
    def __init__(self, router: DeploymentHandle, loader: DeploymentHandle | None, generator: DeploymentHandle):
        """`loader` None: each generator replica has its own (loader_placement in_generator)."""
        self.router, self.loader, self.generator = router, loader, generator

    async def route(self, request: AnswerRequest, budget_tokens: int | None, collections: frozenset[str],
                    cache_salt: bytes = b"") -> Plan:
        return await retried_once("route", lambda: cancelling(self.router.plan.remote(request, budget_tokens,
                                                                                       collections, cache_salt)))

    async def embed(self, texts: list[str]) -> Embedded:
        return await retried_once("embed", lambda: cancelling(self.router.embed.remote(texts)))

    async def tokenize(self, request: TokenizeRequest) -> Tokenized:
        return await retried_once("tokenize", lambda: cancelling(self.router.tokenize.remote(request)))

    async def detokenize(self, tokens: list[int]) -> str:
        return await retried_once("detokenize", lambda: cancelling(self.router.detokenize.remote(tokens)))

    async def generate(self, plan: Plan, sampling: Sampling, timeout_s: float | None = None) -> Answer:
        remaining = Remaining(timeout_s)
        return await retried_once("generate", lambda: cancelling(
            self.generator.generate.remote(plan, sampling, remaining.s())))

    async def stream(self, plan: Plan, sampling: Sampling,
                     timeout_s: float | None = None) -> AsyncIterator[str | Answer]:
        remaining, retried = Remaining(timeout_s), False
        while True:
            events = self.generator.options(stream=True).stream.remote(plan, sampling, remaining.s())
            finished = streamed = False
            try:
                async for event in events:
                    streamed = True
                    yield event
                finished = True
                return
            except Exception as error:
                if streamed or retried or not retryable(error):
                    raise
                retried = True
                log.warning("stream: %s before its first event; retrying once on another replica",
                            type(error_cause(error)).__name__)
                serve_metrics().replica_retries.inc(call="stream")
            finally:
                if not finished:  # the reader went away (disconnect, deadline) or the stream failed
                    events.cancel()

    async def cache_stats(self) -> CacheStats:
        if self.loader is None:  # one generator replica's own host LRU, as the deployment's is one replica's
            return await self.generator.loader_stats.remote()
        return await self.loader.stats.remote()

    async def device_cache_stats(self) -> CacheStats:
        return await self.generator.hot_tier_stats.remote()


def error_cause(error: Exception) -> Exception:
    """The exception raised here or inside a deployment (Ray wraps those)."""
    return error.cause if isinstance(error, RayTaskError) and error.cause is not None else error


# False only to show that tests fail without the retry: the node-loss control of tests/cluster/test_cluster.py, and
# benchmarks/tools/mutations.py `retry-off`.
RETRY_ON_REPLICA_DEATH = True
# The replica behind a call is gone (its actor or node died): the call never ran to an end there.
REPLICA_DEATHS = (RayActorError, WorkerCrashedError, ObjectLostError)
# A replica died, was unreachable or shed load mid-request: Serve restarts or scales it, so a retry can succeed.
REPLICA_FAILURES = (*REPLICA_DEATHS, DeploymentUnavailableError, BackPressureError)


def failure_in(error: Exception, kinds: tuple[type[BaseException], ...]) -> BaseException | None:
    """The first of `kinds` in the error's cause chain (Serve wraps an upstream replica's death in a
    RayServeException), or None."""
    link: BaseException | None = error_cause(error)
    while link is not None and not isinstance(link, kinds):
        link = link.__cause__
    return link


def replica_died(error: Exception) -> bool:
    return failure_in(error, REPLICA_DEATHS) is not None


def retryable(error: Exception) -> bool:
    return RETRY_ON_REPLICA_DEATH and replica_died(error)


async def retried_once(what: str, call: Callable[[], Awaitable[T]]) -> T:
    """`call()`, and once more when its replica died under it (Serve routes the retry to a live one);
    each retry counted in `qvpic_replica_retries_total`."""
    try:
        return await call()
    except Exception as error:
        if not retryable(error):
            raise
        log.warning("%s: %s; retrying once on another replica", what, type(error_cause(error)).__name__)
        serve_metrics().replica_retries.inc(call=what)
    return await call()


class Remaining:
    """What is left of a deadline given in seconds from now (None: no deadline), for a call made again."""

    def __init__(self, timeout_s: float | None):
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def s(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())


def error_status(error: Exception) -> int:
    """The HTTP status `api_error` would answer, without its message (and without logging)."""
    if failure_in(error, REPLICA_FAILURES) is not None:
        return 503
    return getattr(error_cause(error), "status_code", 500)


def api_error(error: Exception, request_id: str | None = None) -> tuple[int, str]:
    """HTTP status and message of an error raised here or inside a deployment. Our own errors (those with a
    `status_code`) say what was wrong; anything else is "internal error" plus a request id, its detail (paths,
    a Ray traceback) only in the server log under that id."""
    failure = failure_in(error, REPLICA_FAILURES)
    if failure is not None:  # their messages are pages of cluster internals
        return 503, f"a serving replica failed during this request ({type(failure).__name__}); retry it"
    cause = error_cause(error)
    status = getattr(cause, "status_code", None)
    if status is not None:
        return status, str(cause)
    request_id = request_id or uuid.uuid4().hex
    log.error("internal error, request id %s", request_id, exc_info=cause)
    return 500, internal_detail(request_id)


def internal_detail(request_id: str) -> str:
    return f"internal error (request id {request_id}: the server log has the detail)"


def sse(event: BaseModel | dict | str) -> str:
    """One server-sent event carrying a JSON object (or a literal such as `[DONE]`)."""
    if isinstance(event, BaseModel):
        event = event.model_dump_json()
    elif isinstance(event, dict):
        event = json.dumps(event)
    return f"data: {event}\n\n"
