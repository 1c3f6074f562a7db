"""Cost governance of one ingress: who asks (auth), what it may spend (budgets, rate limits), what it
costs (prices, before any KV moves), what need not be computed again (response caches), and what it
cost (metrics, request log).

A governed request is a `Turn` and reads, in the HTTP handlers, as
    begin (tenant, requests/s) → route (price, budget-aware promotion) → prepare (413 budget, response
    cache unless `Cache-Control: no-cache`, tokens/s) → generate | stream (model work, cache fill) →
    finish (metrics + one log row)
and `/v1/estimate` stops after route. Every turn finishes exactly once, whatever ends it: an answer,
an error response (the app's error handlers call `Governor.rejected`), or a client that went away.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from enum import Enum

from fastapi import Request
from pydantic import Field, model_validator

from schemas.sampling import Sampling
from schemas.api import (
    AnswerRequest,
    CacheReport,
    ChunkReport,
    EstimateResponse,
    Label,
    ResponseCacheReport,
    StoreInfo,
    Timings,
    TokenEstimate,
)
from schemas.config import Frozen, Mode
from serve.governance.auth import AuthConfig, Authenticator, header_label
from serve.http import Backend, api_error
from serve.governance.budget import Limit, RateLimitConfig, Price, RateLimiter, check_budget, token_budget
from serve.plan import Answer, Plan
from serve.metrics import serve_metrics
from serve.governance.request_log import RequestLog, RequestLogConfig, RequestRecord
from serve.governance.response_cache import (
    CacheDirectives,
    CacheHit,
    CacheKeys,
    MemoryBackend,
    RedisBackend,
    ResponseCache,
    ResponseCacheConfig,
)
from serve.governance.shared_state import RedisConnection, StateBackend

CLIENT_CLOSED = 499  # the client went away mid-stream (nginx's convention; never sent, only logged)


class Route(str, Enum):
    ANSWER = "answer"
    CHAT = "chat"
    ESTIMATE = "estimate"


ROUTE_OF_PATH = {"/v1/answer": Route.ANSWER, "/v1/chat/completions": Route.CHAT, "/v1/estimate": Route.ESTIMATE}


class GovernanceConfig(Frozen):
    """Defaults keep an ungoverned server's behaviour: in-process l1 cache only, no limits, no log, no auth."""

    default_tenant: Label = "anonymous"
    redis_url: str | None = Field(None, pattern=r"^rediss?://", description="shared state for backend: redis")
    limits: RateLimitConfig = RateLimitConfig()
    response_cache: ResponseCacheConfig = ResponseCacheConfig()
    request_log: RequestLogConfig = RequestLogConfig()
    auth: AuthConfig = AuthConfig()

    @model_validator(mode="after")
    def _redis_when_used(self) -> GovernanceConfig:
        uses = [name for name, backend in (("limits", self.limits.backend), ("response_cache", self.response_cache.backend))
                if backend is StateBackend.REDIS]
        if uses and self.redis_url is None:
            raise ValueError(f"{uses} use backend 'redis' but redis_url is not set")
        return self


def cache_namespace(store: StoreInfo) -> str:
    """Response-cache namespace: changes whenever the store's model/template fingerprint or tiers do."""
    identity = json.dumps([store.fingerprint, sorted(store.tiers.items()), sorted(v.value for v in store.variants)])
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


class Governor:
    def __init__(self, args: GovernanceConfig, store: StoreInfo):
        self.args = args
        self.metrics = serve_metrics()
        self.redis = RedisConnection(args.redis_url) if args.redis_url else None
        self.auth = Authenticator(args.auth, args.default_tenant)
        self.limits = RateLimiter(args.limits, self.redis)
        cache_args = args.response_cache
        backend = (RedisBackend(self.redis) if cache_args.backend is StateBackend.REDIS
                   else MemoryBackend(cache_args.max_entries))
        self.cache = ResponseCache(cache_args, cache_namespace(store), backend)
        self.log = RequestLog(args.request_log) if args.request_log.location is not None else None
        self.high_tier = max(store.tiers, key=store.tiers.get)

    async def begin(self, http: Request, request: AnswerRequest, route: Route) -> Turn:
        """Authenticate, then charge the tenant's request rate (401, 400 or 429 before any work)."""
        started = time.perf_counter()
        tenant = self.auth.tenant(http.headers)
        task_type = request.task_type or header_label(http.headers, "X-Task-Type")
        record = RequestRecord(time=datetime.now(timezone.utc), request_id=uuid.uuid4().hex, tenant=tenant,
                               task_type=task_type, route=route.value, mode=request.mode.value)
        turn = http.state.turn = Turn(self, request, record, started, CacheDirectives.of(http.headers))
        self.metrics.requests.inc(route=route.value, mode=request.mode.value)
        policy = self.args.limits.policy(tenant)
        turn.budget_tokens = token_budget(http.headers, policy)
        await self.limits.take(tenant, Limit.REQUESTS, 1)
        return turn

    def rejected(self, http: Request, status: int) -> None:
        """An error response was sent: finish its turn, or count it when it never became one (401, 422)."""
        turn = getattr(http.state, "turn", None)
        if turn is not None:
            turn.finish(status)
        else:
            route = ROUTE_OF_PATH.get(http.url.path)
            self.metrics.errors.inc(route=route.value if route else "other", status=str(status))

    def close(self) -> None:
        """Shutdown: write the buffered request log, drop connections."""
        if self.log is not None:
            self.log.close()
        if self.redis is not None:
            self.redis.close()


class Turn:
    """One governed request, from `Governor.begin` to `finish`."""

    def __init__(self, governor: Governor, request: AnswerRequest, record: RequestRecord, started: float,
                 directives: CacheDirectives = CacheDirectives()):
        self.governor, self.request, self.record, self.started = governor, request, record, started
        self.directives = directives
        self.cache_status: str | None = None  # RFC 9211 Cache-Status, once the cache was consulted
        self.lookup_ms: float | None = None
        self.budget_tokens: int | None = None
        self.plan: Plan | None = None
        self.price: Price | None = None
        self.keys: CacheKeys | None = None
        self.ttft_ms: float | None = None
        self.finished = False

    @property
    def headers(self) -> dict[str, str]:
        """Response headers: the request id, the plan's price once it is routed, the cache's verdict once asked."""
        status = {"Cache-Status": self.cache_status} if self.cache_status else {}
        return {"X-Request-Id": self.record.request_id, **(self.price.headers() if self.price else {}), **status}

    def _elapsed_ms(self) -> float:
        return (time.perf_counter() - self.started) * 1e3

    async def route(self, backend: Backend) -> Plan:
        self.plan = await backend.route(self.request, self.budget_tokens)
        self.price = price = Price.of(self.plan, self.governor.high_tier)
        record = self.record
        record.num_chunks, record.high_res_chunks = price.num_chunks, price.high_res_chunks
        record.context_tokens, record.vision_tokens = price.context_tokens, price.vision_tokens
        record.text_tokens, record.query_tokens = price.text_tokens, price.query_tokens
        return self.plan

    def estimate(self) -> EstimateResponse:
        plan, price = self.plan, self.price
        chunks = [ChunkReport(chunk_id=c.chunk_id, doc_id=c.doc_id, relevance=c.relevance, tier=c.tier,
                              variant=c.entry.variant if c.entry else None, num_tokens=c.num_tokens,
                              vision_tokens=c.vision_tokens, position_span=c.position_span) for c in plan.chunks]
        usage = TokenEstimate(context_tokens=price.context_tokens, context_vision_tokens=price.vision_tokens,
                              context_text_tokens=price.text_tokens, query_tokens=price.query_tokens,
                              max_new_tokens=self.request.max_new_tokens)
        within = self.budget_tokens is None or price.context_tokens <= self.budget_tokens
        self.finish(200)
        return EstimateResponse(mode=plan.mode, chunks=chunks, usage=usage, high_res_chunks=price.high_res_chunks,
                                budget_tokens=self.budget_tokens, within_budget=within)

    async def admit(self, backend: Backend, sampling: Sampling) -> Answer | None:
        """route, then prepare: the cached answer, or None once the request may run."""
        await self.route(backend)
        return await self.prepare(sampling)

    async def prepare(self, sampling: Sampling) -> Answer | None:
        """The cached answer, or None once the budget holds and the tenant's token rate admitted the work."""
        governor = self.governor
        check_budget(self.price, self.budget_tokens)
        self.keys = governor.cache.keys(self.plan, sampling, self.record.task_type, self.record.tenant)
        hit, self.lookup_ms = None, None
        if self.keys is None:
            result, self.cache_status = "bypass", "qvpic; fwd=bypass"  # nothing cacheable: no level on, or sampled
        elif not self.directives.lookup:
            result, self.cache_status = "no_cache", "qvpic; fwd=request"  # the client asked for a computed answer
        else:
            started = time.perf_counter()
            hit = await governor.cache.lookup(self.keys, self.plan.query_embedding)
            self.lookup_ms = (time.perf_counter() - started) * 1e3
            result = hit.level.value if hit else "miss"
            self.cache_status = f"qvpic; hit; detail={result}" if hit else "qvpic; fwd=uri-miss"
        governor.metrics.response_cache.inc(result=result)
        if hit is not None:
            return self._from_cache(hit)
        cost = self.price.context_tokens + self.price.query_tokens + sampling.max_new_tokens
        await governor.limits.take(self.record.tenant, Limit.TOKENS, cost)
        return None

    def _from_cache(self, hit: CacheHit) -> Answer:
        """The cached answer with this request's own timings: routed and looked up; no model phase ran, so
        none is reported (null, not a 0 that would read as a measurement). Its latency is `total_ms`."""
        timings = Timings(route_ms=self.plan.route_ms, load_ms=None, render_ms=None, queue_ms=None,
                          reanchor_ms=None, prefill_ms=None, decode_ms=None, total_ms=0.0)
        report = hit.answer.report.model_copy(update={
            "timings": timings, "cache": CacheReport(hits=0, misses=0, nbytes_from_store=0), "cache_hit": True,
            "response_cache": ResponseCacheReport(level=hit.level, similarity=hit.similarity,
                                                  lookup_ms=self.lookup_ms)})
        return Answer(text=hit.answer.text, report=report)

    def _computed(self, answer: Answer) -> Answer:
        """A computed answer, with the time its response-cache lookup (a miss) took, if there was one."""
        if self.lookup_ms is None:
            return answer
        report = answer.report.model_copy(update={"response_cache": ResponseCacheReport(lookup_ms=self.lookup_ms)})
        return Answer(text=answer.text, report=report)

    async def generate(self, backend: Backend, sampling: Sampling, hit: Answer | None,
                       timeout_s: float | None = None) -> Answer:
        if hit is None:
            answer = self._computed(await backend.generate(self.plan, sampling, timeout_s))
            await self._fill(answer)
        else:
            answer = hit
        self.finish(200, answer)
        return answer

    async def stream(self, backend: Backend, sampling: Sampling, hit: Answer | None,
                     timeout_s: float | None = None) -> AsyncIterator[str | Answer]:
        try:
            events = _replay(hit) if hit is not None else backend.stream(self.plan, sampling, timeout_s)
            async for event in events:
                if isinstance(event, str):
                    self.ttft_ms = self._elapsed_ms() if self.ttft_ms is None else self.ttft_ms
                else:
                    if hit is None:
                        event = self._computed(event)
                        await self._fill(event)
                    self.finish(200, event)
                yield event
        except Exception as error:
            self.finish(api_error(error)[0])
            raise
        finally:
            self.finish(CLIENT_CLOSED)  # only if nothing above finished it: the client stopped reading

    async def _fill(self, answer: Answer) -> None:
        if self.keys is not None and self.directives.store:
            await self.governor.cache.store(self.keys, answer, self.plan.query_embedding)

    def finish(self, status: int, answer: Answer | None = None) -> None:
        """Record the turn's metrics and log row; only the first call counts."""
        if self.finished:
            return
        self.finished = True
        metrics, record, route = self.governor.metrics, self.record, self.record.route
        record.status, record.total_ms = status, self._elapsed_ms()
        if status >= 400:
            metrics.errors.inc(route=route, status=str(status))
        if answer is not None:
            self._record_answer(answer)
        if self.governor.log is not None:
            self.governor.log.append(record)

    def _record_answer(self, answer: Answer) -> None:
        metrics, record, report = self.governor.metrics, self.record, answer.report
        level = report.response_cache.level
        mode = report.mode.value
        usage = report.usage
        record.cache_level = level.value if level else None
        record.context_tokens, record.vision_tokens = usage.context_tokens, usage.context_vision_tokens
        record.text_tokens, record.query_tokens = usage.context_text_tokens, usage.query_tokens
        record.completion_tokens, record.kv_loaded_bytes = usage.completion_tokens, report.cache.nbytes_from_store
        # unstreamed: the generator's decode time is what came after the first token
        decode_ms = report.timings.decode_ms or 0.0  # null on a response-cache hit
        record.ttft_ms = self.ttft_ms if self.ttft_ms is not None else record.total_ms - decode_ms
        cache = "hit" if level else "miss"
        metrics.ttft_ms.observe(record.ttft_ms, mode=mode, cache=cache)
        metrics.latency_ms.observe(record.total_ms, mode=mode, cache=cache)
        if level is not None:
            return  # no model work: the rest describes work done
        metrics.context_tokens.observe(usage.context_tokens, mode=mode)
        for chunk in report.chunks:
            metrics.chunks.inc(mode=mode, tier=chunk.tier or "text")
        if report.mode is Mode.QVPIC:
            metrics.promotions.inc(sum(c.tier == self.governor.high_tier for c in report.chunks))
        metrics.kv_lookups.inc(report.cache.hits, outcome="hit")
        metrics.kv_lookups.inc(report.cache.misses, outcome="miss")
        for tier, count in (("device", report.cache.device_hits), ("host", report.cache.hits),
                            ("store", report.cache.misses)):
            metrics.kv_tier_hits.inc(count, tier=tier)
        metrics.kv_loaded_bytes.inc(report.cache.nbytes_from_store)
        metrics.tier_fallbacks.inc(len(report.fallbacks))


async def _replay(hit: Answer) -> AsyncIterator[str | Answer]:
    """A cached answer as a stream of the shape a computed one has: a delta per word, then the answer."""
    for piece in re.findall(r"\S+\s*|\s+", hit.text):
        yield piece
    yield hit
