"""Token budgets and per-tenant rate limits, all decided from the plan's prices before any KV moves.

A request's price comes from index columns the router already read (O(1) per chunk): context tokens
split into vision and text, query tokens, chunks at the highest tier. The token budget is the lower of the
`X-Max-Token-Budget` header and the tenant's default, and it covers the whole request: every prompt token (the
template, the user's own text and images, the retrieved chunks, the question) and the `n × max_tokens` the answer
may add. Those completion tokens are set aside first — a request whose completion alone takes the whole budget is a
400 naming `max_tokens`, not clamped: the client chose a length and is told, not given a shorter answer — the
router promotes only what fits in the rest, and a request whose prompt exceeds it even with every chunk at its
lowest tier is a 413 that names the minimum.

Rate limits are token buckets per tenant: one for requests/s (charged on arrival, before the body is read), one for
tokens/s (context + query + n × max_new_tokens, checked once the price is known and the response cache missed, so
cache hits cost no tokens; an estimate is charged the prompt text the router read, an embeddings request a bound on
its inputs' tokens before they are embedded, a prompt refused as longer than the context the tokens the router
counted). A request costing more than the bucket holds is admitted only against a full bucket and leaves it in debt,
so it is slowed, never refused forever; while in debt the tenant is refused on arrival (a cache hit included: its
plan needs the router's reading). With `backend: memory` the
buckets live in this ingress replica: with N ingress replicas a tenant gets up to N times its limits.
With `backend: redis` every replica shares them (one Lua script per check, Redis's clock); when Redis
is unreachable, the replica-local buckets take over until it is back.
"""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from schemas.errors import BudgetExceededError, InvalidHeaderError, InvalidRequestError, RateLimitedError
from serve.governance.config import Limit, RateLimitConfig, StateBackend, TenantPolicy
from serve.governance.shared_state import RedisConnection, SharedStateUnavailable
from serve.metrics import serve_metrics
from serve.plan import Plan

MAX_TOKEN_BUDGET_HEADER = re.compile(r"[0-9]{1,18}")  # X-Max-Token-Budget: a positive integer that fits int64

MAX_LOCAL_BUCKETS = 65_536  # tenants tracked per replica; the least recently seen is forgotten (= a full bucket)


@dataclass(frozen=True)
class Price:
    """What a plan puts in context, from the index alone."""

    context_tokens: int  # template prefix + every chunk at its planned tier
    vision_tokens: int
    query_tokens: int
    num_chunks: int
    high_res_chunks: int

    @property
    def text_tokens(self) -> int:
        return self.context_tokens - self.vision_tokens

    @property
    def prompt_tokens(self) -> int:
        """The whole prompt: what the token budget covers besides the completion."""
        return self.context_tokens + self.query_tokens

    @classmethod
    def of(cls, plan: Plan, high_tier: str) -> Price:
        return cls(context_tokens=plan.prefix_tokens + sum(c.num_tokens for c in plan.chunks),
                   vision_tokens=sum(c.vision_tokens for c in plan.chunks), query_tokens=plan.query_tokens,
                   num_chunks=len(plan.chunks), high_res_chunks=sum(c.tier == high_tier for c in plan.chunks))

    def headers(self) -> dict[str, str]:
        return {"X-Vision-Tokens": str(self.vision_tokens), "X-Text-Tokens": str(self.text_tokens),
                "X-High-Res-Chunks": str(self.high_res_chunks)}


def token_budget(headers: Mapping[str, str], policy: TenantPolicy) -> int | None:
    """The request's token budget (prompt and completion): `X-Max-Token-Budget`, capped by the tenant's default."""
    value = headers.get("x-max-token-budget")
    if value is None:
        return policy.token_budget
    # ASCII digits only, bounded: str.isdigit() takes "²" (a Latin-1 header byte) and int() refuses it,
    # and int() refuses over 4,300 digits; either was a 500
    if not MAX_TOKEN_BUDGET_HEADER.fullmatch(value.strip()) or int(value) < 1:
        raise InvalidHeaderError(f"X-Max-Token-Budget must be a positive integer, got {value[:40]!r}")
    return int(value) if policy.token_budget is None else min(int(value), policy.token_budget)


def prompt_budget(budget_tokens: int | None, completion_tokens: int, param: str) -> int | None:
    """What of the token budget the prompt may use: the budget less the `completion_tokens` (n × max_tokens) the
    answer may add; a 400 naming `param` when those alone take it all (before any work)."""
    if budget_tokens is None:
        return None
    if completion_tokens >= budget_tokens:
        serve_metrics().budget_rejections.inc()
        error = InvalidRequestError(f"{param} × n = {completion_tokens} completion tokens leave no room for the prompt "
                                    f"in the token budget of {budget_tokens} (X-Max-Token-Budget or the tenant's "
                                    f"token_budget); ask for fewer")
        error.param = param
        raise error
    return budget_tokens - completion_tokens


def check_budget(price: Price, budget_tokens: int | None, completion_tokens: int = 0) -> None:
    """413 when the placed plan's prompt and its `completion_tokens` exceed the budget: the router already kept
    every chunk low that did not fit, so what it placed is the least this request needs."""
    needed = price.prompt_tokens + completion_tokens
    if budget_tokens is not None and needed > budget_tokens:
        serve_metrics().budget_rejections.inc()
        raise BudgetExceededError(
            f"request needs at least {needed} tokens: a prompt of {price.prompt_tokens} (its mode's cheapest "
            f"placement: qvpic keeps every chunk low; the user's text and images included) and {completion_tokens} "
            f"completion tokens (n × max_tokens); the token budget is {budget_tokens}", min_context_tokens=needed,
            budget_tokens=budget_tokens)


@dataclass
class TokenBucket:
    rate_per_s: float
    capacity: float
    level: float
    at_s: float

    def take(self, cost: float, now_s: float, force: bool = False) -> float:
        """Seconds until `cost` would be admitted; 0.0 means it was, and the bucket was charged (`force`: charged
        whatever it holds, debt included)."""
        self.level = min(self.capacity, self.level + max(0.0, now_s - self.at_s) * self.rate_per_s)
        self.at_s = now_s
        need = min(cost, self.capacity)  # more than a full bucket: admitted when full, the rest is debt
        if force or self.level >= need:
            self.level -= cost
            return 0.0
        return (need - self.level) / self.rate_per_s


# The same bucket as TokenBucket.take, atomically in Redis on Redis's clock. KEYS[1] = bucket;
# ARGV = rate per s, capacity, cost, force ("1": charged whatever the bucket holds). Returns the wait in seconds as
# a string (Lua numbers are truncated).
_TAKE_LUA = """
local rate, capacity, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local force = ARGV[4] == '1'
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local state = redis.call('HMGET', KEYS[1], 'level', 'at')
local level = tonumber(state[1]) or capacity
local at = tonumber(state[2]) or now
level = math.min(capacity, level + math.max(0, now - at) * rate)
local need = math.min(cost, capacity)
local wait = 0
if force or level >= need then level = level - cost else wait = (need - level) / rate end
redis.call('HSET', KEYS[1], 'level', tostring(level), 'at', tostring(now))
redis.call('EXPIRE', KEYS[1], math.ceil((capacity - level) / rate) + 1)
return tostring(wait)
"""


class RateLimiter:
    def __init__(self, config: RateLimitConfig, redis: RedisConnection | None, key_prefix: str = "qvpic:rl"):
        if config.backend is StateBackend.REDIS and redis is None:
            raise ValueError("rate limits with backend 'redis' need a redis_url")
        self.config, self.key_prefix = config, key_prefix
        self.redis = redis if config.backend is StateBackend.REDIS else None
        self._script = self.redis.client.register_script(_TAKE_LUA) if self.redis else None
        self._local: OrderedDict[tuple[str, Limit], TokenBucket] = OrderedDict()

    async def take(self, tenant: str, limit: Limit, cost: float, force: bool = False) -> None:
        """Charge `cost` to the tenant's `limit` bucket, or raise `RateLimitedError` (429 + Retry-After). A cost of 0
        checks that the bucket is not in debt. `force`: work already done, charged whatever the bucket holds (the
        debt slows the tenant's next requests), never refused."""
        rate = self.config.policy(tenant).rate(limit)
        if rate is None:
            return
        rate_per_s, capacity = rate
        wait_s = None
        if self._script is not None:
            key = f"{self.key_prefix}:{limit.value}:{tenant}"
            try:
                wait_s = float(await self.redis.call("rate_limits", lambda _: self._script(
                    keys=[key], args=[rate_per_s, capacity, cost, "1" if force else "0"])))
            except SharedStateUnavailable:
                wait_s = None  # Redis is down: this replica's own buckets decide meanwhile
        if wait_s is None:
            wait_s = self._bucket(tenant, limit, rate_per_s, capacity).take(cost, time.monotonic(), force)
        if wait_s > 0:
            serve_metrics().rate_limit_rejections.inc(limit=limit.value)
            unit = "requests" if limit is Limit.REQUESTS else "tokens"
            this = f"this request: {cost:g}" if cost else "earlier requests left it in debt"
            raise RateLimitedError(f"tenant {tenant!r} is over its limit of {rate_per_s:g} {unit}/s "
                                   f"({this}); retry in {wait_s:.2f} s", retry_after_s=wait_s)

    def _bucket(self, tenant: str, limit: Limit, rate_per_s: float, capacity: float) -> TokenBucket:
        key = (tenant, limit)
        bucket = self._local.get(key)
        if bucket is None:
            bucket = self._local[key] = TokenBucket(rate_per_s, capacity, capacity, time.monotonic())
            if len(self._local) > MAX_LOCAL_BUCKETS:
                self._local.popitem(last=False)
        self._local.move_to_end(key)
        return bucket
