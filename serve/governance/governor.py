"""Cost governance of one ingress: who asks (auth), what it may spend (budgets, rate limits), what need
not be computed again (response caches), and what it cost (metrics, request log).

`Governor.begin` opens a request's `Turn` (serve/governance/turn.py), which the HTTP handlers carry
through routing and answering; every turn finishes exactly once, whatever ends it: an answer, an error
response (the app's error handlers call `Governor.rejected`), or a client that went away. Governance
never calls the serving roles itself: the handlers hand it each result (serve/http/exchange.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from collections import Counter
from datetime import datetime, timezone
from enum import Enum

from fastapi import Request

from schemas.api import AnswerRequest
from schemas.errors import InvalidRequestError, RateLimitedError, TooManyInFlightError
from schemas.service import StoreInfo
from serve.governance.auth import Authenticator, header_label
from serve.governance.budget import RateLimiter, token_budget
from serve.governance.config import GovernanceConfig, Limit, StateBackend
from serve.governance.request_log import RequestLog, RequestRecord
from serve.governance.response_cache import CacheDirectives, MemoryBackend, RedisBackend, ResponseCache
from serve.governance.shared_state import RedisConnection
from serve.governance.turn import Turn, TurnServices
from serve.metrics import serve_metrics

log = logging.getLogger(__name__)


class Route(str, Enum):
    ANSWER = "answer"
    CHAT = "chat"
    COMPLETIONS = "completions"  # legacy completions: each prompt one turn, as a chat of one user message
    EMBEDDINGS = "embeddings"  # the store's embedder: request rate charged, tokens logged (no token budget)
    ESTIMATE = "estimate"
    INSPECT = "inspect"  # the inspector's data routes (/ui/api/*): authenticated, rate-limited, logged
    RESPONSES = "responses"  # OpenAI's Responses API: a chat turn; its stored responses' GET and DELETE


ROUTE_OF_PATH = {"/v1/answer": Route.ANSWER, "/v1/chat/completions": Route.CHAT, "/v1/estimate": Route.ESTIMATE,
                 "/v1/completions": Route.COMPLETIONS, "/v1/embeddings": Route.EMBEDDINGS,
                 "/ui/api/page": Route.INSPECT, "/ui/api/store": Route.INSPECT, "/v1/responses": Route.RESPONSES}
STORED_RESPONSES = "/v1/responses/"  # GET and DELETE of a stored response: charged like the routes above


def charged_route(path: str) -> Route | None:
    """The route of `path` when a request to it is charged to its tenant's request rate (every route that does
    work for a tenant; not the probes, `/metrics`, the static UI or the model list), else None."""
    return ROUTE_OF_PATH.get(path) or (Route.RESPONSES if path.startswith(STORED_RESPONSES) else None)


def embedding_tokens_bound(texts: list[str]) -> int:
    """What an embeddings request is charged before its texts are tokenised (the ingress has no tokenizer): one
    token per character plus the two specials, a bound for the store's WordPiece embedders (a piece is at least one
    character); the embedder reads at most its window of each, so long texts are charged more than they use."""
    return sum(len(text) + 2 for text in texts)


def cache_namespace(store: StoreInfo) -> str:
    """Response-cache namespace: changes whenever the store's model/template fingerprint or tiers do."""
    identity = json.dumps([store.fingerprint, sorted(store.tiers.items()), sorted(v.value for v in store.variants)])
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


class Governor:
    def __init__(self, config: GovernanceConfig, store: StoreInfo):
        self.config = config
        self.metrics = serve_metrics()
        self.redis = RedisConnection(config.redis_url) if config.redis_url else None
        self.auth = Authenticator(config.auth, config.default_tenant)
        self.limits = RateLimiter(config.limits, self.redis)
        cache_config = config.response_cache
        backend = (RedisBackend(self.redis) if cache_config.backend is StateBackend.REDIS
                   else MemoryBackend(cache_config.max_entries))
        self.cache = ResponseCache(cache_config, cache_namespace(store), backend)
        self.log = RequestLog(config.request_log) if config.request_log.location is not None else None
        self.high_tier = max(store.tiers, key=store.tiers.get)
        self.services = TurnServices(self.cache, self.limits, self.metrics, self.log, self.high_tier)  # every turn's
        self.held: Counter[str] = Counter()  # tenant -> its refusals being held (`_hold`)
        self.sleep = asyncio.sleep  # how a refusal is held (a test records it instead)
        self.in_flight: Counter[str] = Counter()  # tenant -> its requests in progress here (max_in_flight)

    async def arrive(self, http: Request) -> None:
        """A request has arrived; its body is not read yet. On a charged path, authenticate (401) and charge the
        tenant's request rate (429) now, and on a path that spends tokens check that its token rate is not in debt
        (429: nothing it asks could be paid for): a tenant past its rate is refused for the price of its headers,
        before its body is read, parsed and validated (a 50 KB schema bomb cost ~1.5 ms of the ingress loop before
        its 429, a 954 KB embeddings body more, so a loop of them stalled every tenant: issue 60). The refusal is
        held (`_hold`) so that a client ignoring Retry-After cannot loop refusals. The route's own first request
        charge is then this one (`_charge_request`). A 429 here is counted and logged as a request of mode `none`
        (its body unread)."""
        route = charged_route(http.url.path)
        if route is None:
            return
        started, tenant = time.perf_counter(), self.auth.tenant(http.headers)
        try:
            await self.limits.take(tenant, Limit.REQUESTS, 1)
            http.state.arrival_charged = True
            if http.url.path in ROUTE_OF_PATH and route is not Route.INSPECT:  # it spends tokens
                await self.limits.take(tenant, Limit.TOKENS, 0)
        except RateLimitedError as error:
            await self._refused(http, route, tenant, error, started)
            raise

    async def charge_shape(self, http: Request, extra_requests: int) -> None:
        """A body's JSON containers past what one request covers, charged as `extra_requests` more requests to the
        tenant's rate once the body is read and before it is parsed (serve/http/body_shape.py): validation costs
        per container, so a tenant's is bounded by its rate. Refused (429, held) as on arrival."""
        route = charged_route(http.url.path)
        if route is None or extra_requests <= 0:
            return
        started, tenant = time.perf_counter(), self.auth.tenant(http.headers)
        try:
            await self.limits.take(tenant, Limit.REQUESTS, extra_requests)
        except RateLimitedError as error:
            await self._refused(http, route, tenant, error, started)
            raise

    async def _refused(self, http: Request, route: Route, tenant: str, error: RateLimitedError,
                       started: float) -> None:
        """A request refused before its body is parsed: counted, held (`_hold`) and logged as mode `none`."""
        self.metrics.requests.inc(route=route.value, mode="none")  # the error itself: `rejected`, by path
        if route is Route.INSPECT:  # as `inspect` logs it: who probed what, refused ones too
            log.info("inspect tenant=%s path=%s", tenant, http.url.path)
        await self._hold(tenant, error.retry_after_s)
        if self.log is not None:
            self.log.append(RequestRecord(
                time=datetime.now(timezone.utc), request_id=uuid.uuid4().hex, tenant=tenant,
                task_type=header_label(http.headers, "X-Task-Type"), route=route.value, mode="none", status=429,
                total_ms=(time.perf_counter() - started) * 1e3))

    async def _hold(self, tenant: str, wait_s: float) -> None:
        """Wait before a refusal is sent: the wait it names, at most `limits.refusal_hold_s`, and only while fewer
        than `limits.max_held_refusals` of the tenant's, and `limits.max_held_refusals_total` of all tenants', are
        held here (beyond, at once: held refusals take bounded room of the replica's `max_ongoing_requests`, however
        many keys loop them). A client that ignores Retry-After then sends at most one
        refused request per connection per hold; one that heeds it waits at least as long anyway."""
        limits = self.config.limits
        hold_s = min(wait_s, limits.refusal_hold_s)
        if hold_s <= 0 or self.held[tenant] >= limits.max_held_refusals or \
                self.held.total() >= limits.max_held_refusals_total:
            return
        self.held[tenant] += 1
        try:
            await self.sleep(hold_s)
        finally:
            self.held[tenant] -= 1
            if self.held[tenant] <= 0:
                del self.held[tenant]

    async def _charge_request(self, http: Request, tenant: str) -> None:
        """One request to `tenant`'s rate, unless `arrive` charged this one already (a completions request of
        several prompts charges each prompt after the first)."""
        if getattr(http.state, "arrival_charged", False):
            http.state.arrival_charged = False
            return
        await self.limits.take(tenant, Limit.REQUESTS, 1)

    async def begin(self, http: Request, request: AnswerRequest, route: Route, n: int = 1) -> Turn:
        """Authenticate, then charge the tenant's request rate (401, 400 or 429 before any work); `n` choices hold
        n of the tenant's in-flight slots, as they hold n rows of the generator's batch."""
        turn = self._open(http, request, route, request.mode.value, request.user, request.task_type, n)
        turn.budget_tokens = token_budget(http.headers, self.config.limits.policy(turn.record.tenant))
        await self._charge_request(http, turn.record.tenant)
        return turn

    async def begin_embeddings(self, http: Request, user: str | None, texts: list[str]) -> Turn:
        """An embeddings request's turn: authenticated and charged to the request rate like the others, then to
        the token rate for a bound on its inputs' tokens, before anything is embedded (`embedding_tokens_bound`);
        no plan, so no response cache (its tokens are recorded as `query_tokens`). The budget header is parsed: a
        malformed one is the same 400 on every route, never ignored on some."""
        turn = self._open(http, None, Route.EMBEDDINGS, "none", user, None)
        token_budget(http.headers, self.config.limits.policy(turn.record.tenant))
        await self._charge_request(http, turn.record.tenant)
        await self.limits.take(turn.record.tenant, Limit.TOKENS, embedding_tokens_bound(texts))
        return turn

    def _open(self, http: Request, request: AnswerRequest | None, route: Route, mode: str, user: str | None,
              task_type: str | None, slots: int = 1) -> Turn:
        started = time.perf_counter()
        tenant = self.auth.tenant(http.headers)
        task_type = task_type or header_label(http.headers, "X-Task-Type")
        record = RequestRecord(time=datetime.now(timezone.utc), request_id=uuid.uuid4().hex, tenant=tenant,
                               task_type=task_type, route=route.value, mode=mode, end_user=user)
        cap = self.config.limits.policy(tenant).max_in_flight
        if cap is not None and slots > cap:  # never admitted, however long it waits: not a 429
            error = InvalidRequestError(f"n = {slots} choices count as {slots} requests in progress; tenant {tenant!r} "
                                        f"may have at most {cap} (max_in_flight)")
            error.param = "n"
            raise error
        if cap is not None and self.in_flight[tenant] + slots > cap:
            raise TooManyInFlightError(f"tenant {tenant!r} has {self.in_flight[tenant]} of its {cap} requests in "
                                       f"progress (max_in_flight; n choices count n); retry when one ends",
                                       retry_after_s=1.0)
        turn = http.state.turn = Turn(self.services, request, record, started, self.config.auth.grant(tenant),
                                      CacheDirectives.of(http.headers))
        self.in_flight[tenant] += slots  # given back by `release` when the response has been sent (or abandoned)
        turn.slots = slots
        self.metrics.requests.inc(route=route.value, mode=mode)
        return turn

    async def inspect(self, http: Request) -> frozenset[str]:
        """An inspector data request (`/ui/api/*`): authenticated (401) and charged to the tenant's request rate
        (429) before any work, counted and logged like the API's; returns the collections the tenant reads."""
        tenant = self.auth.tenant(http.headers)
        self.metrics.requests.inc(route=Route.INSPECT.value, mode="none")
        log.info("inspect tenant=%s path=%s", tenant, http.url.path)  # refused ones too: who probed what
        await self._charge_request(http, tenant)
        return self.config.auth.grant(tenant)

    async def account(self, http: Request, route: Route) -> str:
        """A request that generates nothing (a stored response's GET or DELETE): authenticated (401) and charged to
        the tenant's request rate (429) before any work, counted; returns the tenant."""
        tenant = self.auth.tenant(http.headers)
        self.metrics.requests.inc(route=route.value, mode="none")
        await self._charge_request(http, tenant)
        return tenant

    def collections(self, http: Request) -> frozenset[str]:
        """The collections the request's tenant reads (401 when keys are configured and none is given)."""
        return self.config.auth.grant(self.auth.tenant(http.headers))

    def release(self, turn: Turn | None) -> None:
        """The request's response is over (sent, failed or abandoned): its in-flight slot is free again."""
        if turn is not None and turn.slots:
            slots, turn.slots = turn.slots, 0
            tenant = turn.record.tenant
            self.in_flight[tenant] -= slots
            if self.in_flight[tenant] <= 0:
                del self.in_flight[tenant]

    def rejected(self, http: Request, status: int) -> None:
        """An error response was sent: finish its turn, or count it when it never became one (401, 422)."""
        turn = getattr(http.state, "turn", None)
        if turn is not None:
            turn.finish(status)
        else:
            route = charged_route(http.url.path)
            self.metrics.errors.inc(route=route.value if route else "other", status=str(status))

    def close(self) -> None:
        """Shutdown: write the buffered request log, drop connections."""
        if self.log is not None:
            self.log.close()
        if self.redis is not None:
            self.redis.close()
