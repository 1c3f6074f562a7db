"""What the HTTP handlers call: the three roles behind one interface, through Serve handles or in-process.

Through handles the loaded KV never passes through the ingress: the loader's response is handed to
the generator as an argument and Serve resolves it there. `InProcessBackend` runs the same handlers
on plain objects (no Ray), which is how the HTTP surface is tested without a cluster.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, Protocol

from pydantic import BaseModel
from ray.exceptions import ObjectLostError, RayActorError, RayTaskError, WorkerCrashedError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from schemas.sampling import Sampling
from schemas.api import AnswerRequest, CacheStats, StoreInfo
from serve.generator import Generator
from serve.plan import Answer, Plan
from serve.loader import CacheLoader
from serve.router import Router


class ApiSettings(BaseModel):
    served_model_name: str
    default_top_k: int
    store: StoreInfo
    created: int  # unix seconds: when the store was created


class Backend(Protocol):
    async def route(self, request: AnswerRequest, budget_tokens: int | None = None) -> Plan: ...
    async def load(self, plan: Plan) -> Any: ...  # what `generate`/`stream` take
    async def generate(self, plan: Plan, loaded: Any, sampling: Sampling) -> Answer: ...
    def stream(self, plan: Plan, loaded: Any, sampling: Sampling) -> AsyncIterator[str | Answer]: ...
    async def cache_stats(self) -> CacheStats: ...


class HandleBackend:
    def __init__(self, router: DeploymentHandle, loader: DeploymentHandle, generator: DeploymentHandle):
        self.router, self.loader, self.generator = router, loader, generator

    async def route(self, request: AnswerRequest, budget_tokens: int | None = None) -> Plan:
        return await self.router.plan.remote(request, budget_tokens)

    async def load(self, plan: Plan) -> Any:
        return self.loader.load.remote(plan)  # a DeploymentResponse, resolved inside the generator

    async def generate(self, plan: Plan, loaded: Any, sampling: Sampling) -> Answer:
        return await self.generator.generate.remote(plan, loaded, sampling)

    def stream(self, plan: Plan, loaded: Any, sampling: Sampling) -> AsyncIterator[str | Answer]:
        return self.generator.options(stream=True).stream.remote(plan, loaded, sampling)

    async def cache_stats(self) -> CacheStats:
        return await self.loader.stats.remote()


class InProcessBackend:
    """The same three roles as plain objects; blocking work runs on worker threads. Like a handle's
    response, the load is a task the generate/stream step awaits, so its errors surface there too."""

    def __init__(self, router: Router, loader: CacheLoader, generator: Generator):
        self.router, self.loader, self.generator = router, loader, generator

    async def route(self, request: AnswerRequest, budget_tokens: int | None = None) -> Plan:
        return await self.router.plan(request, budget_tokens)

    async def load(self, plan: Plan) -> asyncio.Task:
        return asyncio.create_task(asyncio.to_thread(self.loader.load, plan))

    async def generate(self, plan: Plan, loaded: asyncio.Task, sampling: Sampling) -> Answer:
        return await asyncio.to_thread(self.generator.generate, plan, await loaded, sampling)

    async def stream(self, plan: Plan, loaded: asyncio.Task, sampling: Sampling) -> AsyncIterator[str | Answer]:
        events = self.generator.stream(plan, await loaded, sampling)
        while (event := await asyncio.to_thread(next, events, None)) is not None:
            yield event

    async def cache_stats(self) -> CacheStats:
        return self.loader.stats()


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
