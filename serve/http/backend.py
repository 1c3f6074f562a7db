"""What the HTTP handlers call: the serving roles behind one interface, through Serve handles or in-process.

A request is route → generate: the generator fetches from the loader only the KV entries its device
hot tier lacks (serve/kv/hot_tier.py), so the loaded KV never passes through the ingress, and a request
whose chunks are hot moves none at all. `InProcessBackend` runs the same calls on plain objects (no
Ray), which is how the HTTP surface is tested without a cluster. This module imports no model stack.

A call that is abandoned (the client went away, or the request's deadline passed) is cancelled
downstream (serve/handles.py), and the generator drops the request at its next step.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

from pydantic import BaseModel
from ray.exceptions import ObjectLostError, RayActorError, RayTaskError, WorkerCrashedError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from schemas.api import AnswerRequest, CacheStats
from schemas.sampling import Sampling
from serve.handles import cancelling
from serve.plan import Answer, Plan

if TYPE_CHECKING:  # the in-process roles; the ingress never imports them
    from serve.engine import Generator
    from serve.kv import CacheLoader
    from serve.routing import Router


class Backend(Protocol):
    async def route(self, request: AnswerRequest, budget_tokens: int | None = None) -> Plan: ...
    async def generate(self, plan: Plan, sampling: Sampling, timeout_s: float | None = None) -> Answer: ...
    def stream(self, plan: Plan, sampling: Sampling, timeout_s: float | None = None) -> AsyncIterator[str | Answer]: ...
    async def cache_stats(self) -> CacheStats: ...
    async def device_cache_stats(self) -> CacheStats: ...


class HandleBackend:
    def __init__(self, router: DeploymentHandle, loader: DeploymentHandle, generator: DeploymentHandle):
        self.router, self.loader, self.generator = router, loader, generator

    async def route(self, request: AnswerRequest, budget_tokens: int | None = None) -> Plan:
        return await cancelling(self.router.plan.remote(request, budget_tokens))

    async def generate(self, plan: Plan, sampling: Sampling, timeout_s: float | None = None) -> Answer:
        return await cancelling(self.generator.generate.remote(plan, sampling, timeout_s))

    async def stream(self, plan: Plan, sampling: Sampling,
                     timeout_s: float | None = None) -> AsyncIterator[str | Answer]:
        events = self.generator.options(stream=True).stream.remote(plan, sampling, timeout_s)
        finished = False
        try:
            async for event in events:
                yield event
            finished = True
        finally:
            if not finished:  # the reader went away (disconnect, deadline) or the stream failed
                events.cancel()

    async def cache_stats(self) -> CacheStats:
        return await self.loader.stats.remote()

    async def device_cache_stats(self) -> CacheStats:
        return await self.generator.hot_tier_stats.remote()


class InProcessBackend:
    """The same roles as plain objects. The generator fetches its hot tier's misses from `loader`."""

    def __init__(self, router: Router, loader: CacheLoader, generator: Generator):
        self.router, self.loader, self.generator = router, loader, generator

    async def route(self, request: AnswerRequest, budget_tokens: int | None = None) -> Plan:
        return await self.router.plan(request, budget_tokens)

    async def generate(self, plan: Plan, sampling: Sampling, timeout_s: float | None = None) -> Answer:
        return await self.generator.generate(plan, sampling, timeout_s, loader=self.loader)

    def stream(self, plan: Plan, sampling: Sampling, timeout_s: float | None = None) -> AsyncIterator[str | Answer]:
        return self.generator.stream(plan, sampling, timeout_s, loader=self.loader)

    async def cache_stats(self) -> CacheStats:
        return self.loader.stats()

    async def device_cache_stats(self) -> CacheStats:
        return self.generator.hot_tier_stats()


def error_cause(error: Exception) -> Exception:
    """The exception raised here or inside a deployment (Ray wraps those)."""
    return error.cause if isinstance(error, RayTaskError) and error.cause is not None else error


# A replica died, was unreachable or shed load mid-request: Serve restarts or scales it, so a retry can succeed.
REPLICA_FAILURES = (RayActorError, WorkerCrashedError, ObjectLostError, DeploymentUnavailableError, BackPressureError)


def api_error(error: Exception) -> tuple[int, str]:
    """HTTP status and message of an error raised here or inside a deployment."""
    cause = error_cause(error)
    link: BaseException | None = cause
    while link is not None:  # Serve wraps an upstream replica's death in a RayServeException
        if isinstance(link, REPLICA_FAILURES):  # their messages are pages of cluster internals
            return 503, f"a serving replica failed during this request ({type(link).__name__}); retry it"
        link = link.__cause__
    return getattr(cause, "status_code", 500), str(cause)


def sse(event: BaseModel | dict | str) -> str:
    """One server-sent event carrying a JSON object (or a literal such as `[DONE]`)."""
    if isinstance(event, BaseModel):
        event = event.model_dump_json()
    elif isinstance(event, dict):
        event = json.dumps(event)
    return f"data: {event}\n\n"
