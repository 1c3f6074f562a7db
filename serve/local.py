"""The serving roles in this process, without Serve: `build_local(config)`, beside `build_app(config)`.

`build_app` (serve/app.py) deploys router, loader and generator as Serve deployments behind the ingress;
`build_local` builds the same classes from the same `AppConfig` as plain objects, checked by the same preflight,
the generator reading its device tier's misses from the loader beside it (serve/kv/source.py `LocalLoader`). What
runs in-process — `qvpic eval`, the benchmarks that time the roles, the tests — therefore measures what the service
does: the same routing, the same stored KV, the same engine. `InProcessBackend` is what the HTTP handlers call on
these objects, and `LocalStack.api()` puts the HTTP surface (serve/http/) in front of it, as the ingress replica
does, for tests that drive it without a cluster.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI

from schemas.api import AnswerRequest
from schemas.sampling import Sampling
from schemas.service import CacheStats
from schemas.utility import TokenizeRequest
from serve.app import api_spec, preflight
from serve.config import AppConfig
from serve.engine import Generator
from serve.governance import Governor
from serve.http import make_api
from serve.kv import CacheLoader, LocalLoader
from serve.plan import Answer, Embedded, Plan, Tokenized
from serve.routing import Router


@dataclass(frozen=True)
class LocalStack:
    """Router, loader and generator of one `AppConfig`, as plain objects."""

    config: AppConfig
    router: Router
    loader: CacheLoader  # the host tier and the store reader the generator's misses go through
    generator: Generator

    def backend(self) -> InProcessBackend:
        """What the HTTP handlers call, on these objects."""
        return InProcessBackend(self.router, self.loader, self.generator)

    def api(self, governor: Governor | None = None) -> FastAPI:
        """The ingress's HTTP surface over these roles (its governance from `config.ingress`, unless given). A server is
        starting: the router's framing process starts now, as a deployed router's does (serve/routing/framer.py)."""
        if self.config.router.framing.processes:
            self.router.framer.start()
        return make_api(self.backend(), api_spec(self.config), governor, self.config.ingress)

    async def answer(self, request: AnswerRequest, budget_tokens: int | None = None) -> Answer:
        """Route `request`, then generate its answer (no governance: that is the ingress's)."""
        plan = await self.router.plan(request, budget_tokens)
        return await self.generator.generate(plan, Sampling.of(request))

    def answer_blocking(self, request: AnswerRequest) -> Answer:
        """`answer` for callers without an event loop (scripts, evaluation, tests)."""
        return asyncio.run(self.answer(request))

    def clear_caches(self) -> None:
        """Empty the device tier and the host tier: the next request reads its chunks' KV from the store (the
        engine's prefix cache is the generator's to clear: `generator.clear_prefix_cache()`)."""
        self.loader.clear()
        self.generator.clear_hot_tier()

    def close(self) -> None:
        """Drop the router's and the loader's leases on the store's generation (their owner calls it when done)."""
        self.router.close()
        self.loader.close()


class InProcessBackend:
    """What the HTTP handlers call (serve/http/backend.py `Backend`), on plain objects: the generator reads its device
    tier's misses through `loader`, which also answers the cache statistics."""

    def __init__(self, router: Router, loader: CacheLoader, generator: Generator):
        self.router, self.loader, self.generator = router, loader, generator
        self.source = LocalLoader(loader)

    async def route(self, request: AnswerRequest, budget_tokens: int | None, collections: frozenset[str],
                    cache_salt: bytes = b"") -> Plan:
        return await self.router.plan(request, budget_tokens, collections, cache_salt)

    async def embed(self, texts: list[str]) -> Embedded:
        return await self.router.embed(texts)

    async def tokenize(self, request: TokenizeRequest) -> Tokenized:
        return await self.router.tokenize(request)

    async def detokenize(self, tokens: list[int]) -> str:
        return await self.router.detokenize(tokens)

    async def generate(self, plan: Plan, sampling: Sampling, timeout_s: float | None = None) -> Answer:
        return await self.generator.generate(plan, sampling, timeout_s, source=self.source)

    def stream(self, plan: Plan, sampling: Sampling, timeout_s: float | None = None) -> AsyncIterator[str | Answer]:
        return self.generator.stream(plan, sampling, timeout_s, source=self.source)

    async def cache_stats(self) -> CacheStats:
        return self.loader.stats()

    async def device_cache_stats(self) -> CacheStats:
        return self.generator.hot_tier_stats()


def build_local(config: AppConfig | Mapping[str, Any]) -> LocalStack:
    """The roles of `config` (an `AppConfig`, or the mapping `serve/config.yaml` `args` holds) in this process,
    after the same preflight as `build_app`: the store matches the model, its parts are all there, its seal holds."""
    config = config if isinstance(config, AppConfig) else AppConfig.model_validate(config)
    preflight(config)
    loader = CacheLoader(config.loader)
    return LocalStack(config, Router(config.router), loader, Generator(config.generator, LocalLoader(loader)))
