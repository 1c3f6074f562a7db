"""One governed request: its price, its response-cache verdict, and its record.

A turn reads, in the HTTP handlers (serve/http/exchange.py), as
    begin (tenant, requests/s: `Governor.begin`) → priced (the routed plan's price) → prepare (413 budget,
    response cache unless `Cache-Control: no-cache`, tokens/s) → first_token … answered (cache fill) →
    finish (metrics + one log row)
and `/v1/estimate` stops after priced. The turn is handed each result: it never calls a serving role.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from schemas.api import AnswerRequest
from schemas.modes import Mode
from schemas.report import CacheReport, ChunkReport, EstimateResponse, ResponseCacheReport, Timings, TokenEstimate
from schemas.sampling import Sampling
from serve.governance.budget import Price, RateLimiter, check_budget, prompt_budget
from serve.governance.config import Limit
from serve.governance.request_log import RequestLog, RequestRecord
from serve.governance.response_cache import CacheDirectives, CacheHit, CacheKeys, ResponseCache
from serve.metrics import ServeMetrics
from serve.plan import Answer, Plan


@dataclass(frozen=True)
class TurnServices:
    """What a turn uses of its ingress's governance, handed to it whole: a turn never reaches into the governor."""

    cache: ResponseCache
    limits: RateLimiter
    metrics: ServeMetrics
    log: RequestLog | None  # None: no request log configured
    high_tier: str  # the store's highest resolution tier: what a promotion is counted against


class Turn:
    """One governed request, from `Governor.begin` to `finish`."""

    def __init__(self, services: TurnServices, request: AnswerRequest | None, record: RequestRecord, started: float,
                 collections: frozenset[str], directives: CacheDirectives = CacheDirectives()):
        self.services, self.request, self.record, self.started = services, request, record, started
        self.slots = 0  # its tenant's max_in_flight slots it holds, one per choice (Governor.release gives them back)
        self.collections = collections  # the tenant's grant: the only chunks that exist for it
        self.directives = directives
        self.cache_status: str | None = None  # RFC 9211 Cache-Status, once the cache was consulted
        self.lookup_ms: float | None = None
        self.budget_tokens: int | None = None  # the whole request's: prompt and completion
        self.completion_tokens = 0  # n × max_tokens, set aside from the budget before routing (`reserve`)
        self.plan: Plan | None = None
        self.price: Price | None = None
        self.keys: CacheKeys | None = None
        self.hit: Answer | None = None  # the response cache's answer, once `prepare` found one
        self.ttft_ms: float | None = None
        self.finished = False

    @property
    def headers(self) -> dict[str, str]:
        """Response headers: the request id, the plan's price once it is routed, the cache's verdict once asked."""
        status = {"Cache-Status": self.cache_status} if self.cache_status else {}
        return {"X-Request-Id": self.record.request_id, **(self.price.headers() if self.price else {}), **status}

    def _elapsed_ms(self) -> float:
        return (time.perf_counter() - self.started) * 1e3

    def reserve(self, sampling: Sampling, param: str) -> None:
        """Set the answer's n × max_tokens aside from the token budget, before any work: a 400 naming `param` (the
        route's max_tokens field) when nothing is left for the prompt."""
        self.completion_tokens = sampling.n * sampling.max_new_tokens
        prompt_budget(self.budget_tokens, self.completion_tokens, param)

    async def routing(self) -> None:
        """Before the router reads the prompt (its text tokenised, its images decoded): a tenant whose token rate is
        in debt is refused here (429), not after that work. A response-cache hit needs the plan too, so it is
        refused as well until the debt is paid."""
        await self.services.limits.take(self.record.tenant, Limit.TOKENS, 0)

    async def refused_too_long(self, counted_tokens: int) -> None:
        """The router refused the prompt as longer than the context after reading `counted_tokens` of it: those are
        charged to the token rate whatever it holds (issue 60: a 256-message history cost ~45 ms of the router and,
        refused, nothing; now its debt holds the tenant's next routes back)."""
        if counted_tokens > 0:
            await self.services.limits.take(self.record.tenant, Limit.TOKENS, counted_tokens, force=True)

    @property
    def prompt_budget_tokens(self) -> int | None:
        """What the router may place the prompt in: the budget less the completion set aside."""
        return None if self.budget_tokens is None else self.budget_tokens - self.completion_tokens

    def priced(self, plan: Plan) -> Plan:
        """The routed plan, priced from the index alone and recorded."""
        self.plan = plan
        self.price = price = Price.of(plan, self.services.high_tier)
        record = self.record
        record.num_chunks, record.high_res_chunks = price.num_chunks, price.high_res_chunks
        record.context_tokens, record.vision_tokens = price.context_tokens, price.vision_tokens
        record.text_tokens, record.query_tokens = price.text_tokens, price.query_tokens
        return plan

    async def charge_estimate(self) -> None:
        """An estimate's routing read the prompt's own text and images (the template, the user's messages, the
        question): those tokens are charged to the tenant's token rate; the chunks are index lookups."""
        plan = self.plan
        await self.services.limits.take(self.record.tenant, Limit.TOKENS, plan.prefix_tokens + plan.query_tokens)

    def estimate(self) -> EstimateResponse:
        plan, price = self.plan, self.price
        chunks = [ChunkReport(chunk_id=c.chunk_id, doc_id=c.doc_id, relevance=c.relevance, tier=c.tier,
                              variant=c.entry.variant if c.entry else None, num_tokens=c.num_tokens,
                              vision_tokens=c.vision_tokens, position_span=c.position_span, tier_reason=c.tier_reason)
                  for c in plan.chunks]
        usage = TokenEstimate(context_tokens=price.context_tokens, context_vision_tokens=price.vision_tokens,
                              context_text_tokens=price.text_tokens, query_tokens=price.query_tokens,
                              max_new_tokens=self.request.max_new_tokens)
        within = self.budget_tokens is None or price.prompt_tokens + self.completion_tokens <= self.budget_tokens
        self.finish(200)
        return EstimateResponse(mode=plan.mode, chunks=chunks, usage=usage, high_res_chunks=price.high_res_chunks,
                                budget_tokens=self.budget_tokens, within_budget=within)

    async def prepare(self, sampling: Sampling) -> Answer | None:
        """The cached answer (also kept as `hit`), or None once the budget holds and the tenant's token rate
        admitted the work."""
        services = self.services
        check_budget(self.price, self.budget_tokens, self.completion_tokens)
        self.keys = services.cache.keys(self.plan, sampling, self.record.task_type, self.record.tenant)
        hit, self.lookup_ms = None, None
        if self.keys is None:
            result, self.cache_status = "bypass", "qvpic; fwd=bypass"  # nothing cacheable: no level on, or sampled
        elif not self.directives.lookup:
            result, self.cache_status = "no_cache", "qvpic; fwd=request"  # the client asked for a computed answer
        else:
            started = time.perf_counter()
            hit = await services.cache.lookup(self.keys, self.plan.query_embedding)
            self.lookup_ms = (time.perf_counter() - started) * 1e3
            result = hit.level.value if hit else "miss"
            self.cache_status = f"qvpic; hit; detail={result}" if hit else "qvpic; fwd=uri-miss"
        services.metrics.response_cache.inc(result=result)
        if hit is not None:
            self.hit = self._from_cache(hit)
            return self.hit
        cost = self.price.context_tokens + self.price.query_tokens + sampling.n * sampling.max_new_tokens
        await services.limits.take(self.record.tenant, Limit.TOKENS, cost)
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

    def first_token(self) -> None:
        """A streamed delta was sent: the first one sets the time to first token."""
        self.ttft_ms = self._elapsed_ms() if self.ttft_ms is None else self.ttft_ms

    async def answered(self, answer: Answer) -> Answer:
        """The answer as sent: a computed one with its (missed) lookup's time, stored in the response cache
        unless the request said `no-store` or `no-cache`; the turn finishes with 200."""
        if self.hit is None:
            if self.lookup_ms is not None:
                answer = dataclasses.replace(answer, report=answer.report.model_copy(
                    update={"response_cache": ResponseCacheReport(lookup_ms=self.lookup_ms)}))
            # no-cache computed a fresh answer without reading the entry: it must not overwrite it either
            if self.keys is not None and self.directives.store and self.directives.lookup:
                await self.services.cache.store(self.keys, answer, self.plan.query_embedding)
        self.finish(200, answer)
        return answer

    def embedded(self, prompt_tokens: int) -> None:
        """An embeddings request answered: its tokens recorded, the turn finished with 200."""
        self.record.query_tokens = prompt_tokens
        self.finish(200)

    def finish(self, status: int, answer: Answer | None = None) -> None:
        """Record the turn's metrics and log row; only the first call counts."""
        if self.finished:
            return
        self.finished = True
        metrics, record, route = self.services.metrics, self.record, self.record.route
        record.status, record.total_ms = status, self._elapsed_ms()
        if status >= 400:
            metrics.errors.inc(route=route, status=str(status))
        if answer is not None:
            self._record_answer(answer)
        if self.services.log is not None:
            self.services.log.append(record)

    def _record_answer(self, answer: Answer) -> None:
        metrics, record, report = self.services.metrics, self.record, answer.report
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
            metrics.promotions.inc(sum(c.tier == self.services.high_tier for c in report.chunks))
        metrics.kv_lookups.inc(report.cache.hits, outcome="hit")
        metrics.kv_lookups.inc(report.cache.misses, outcome="miss")
        for tier, count in (("device", report.cache.device_hits), ("host", report.cache.hits),
                            ("store", report.cache.misses)):
            metrics.kv_tier_hits.inc(count, tier=tier)
        metrics.kv_loaded_bytes.inc(report.cache.nbytes_from_store)
        metrics.tier_fallbacks.inc(len(report.fallbacks))


async def replay(hit: Answer) -> AsyncIterator[str | Answer]:
    """A cached answer as a stream of the shape a computed one has: a delta per word, then the answer."""
    for piece in re.findall(r"\S+\s*|\s+", hit.text):
        yield piece
    yield hit
