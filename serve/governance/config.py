"""Typed configuration of the ingress's governance: API-key auth, token budgets and rate limits, response
caches, the request log, and where their shared state lives (memory or Redis).

`GovernanceConfig` nests in serve/config.py's `IngressConfig` (`ingress.governance` of a Serve config). This
module imports nothing of ours but `schemas`, so serve/config.py can import it without a cycle, and the
ingress replica holds it without loading a model stack.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, StringConstraints, field_validator, model_validator

from schemas.api import Label
from schemas.config import Frozen
from schemas.corpus import ALL_COLLECTIONS, COLLECTION_PATTERN, DEFAULT_COLLECTION
from schemas.redis_url import RedisUrlField
from schemas.report import ResponseCacheLevel
from schemas.store import StoreSpec


class StateBackend(str, Enum):
    MEMORY = "memory"  # per ingress replica
    REDIS = "redis"  # shared by every ingress replica (needs `redis_url`)


class Limit(str, Enum):
    REQUESTS = "requests"
    TOKENS = "tokens"


class TenantPolicy(Frozen):
    token_budget: int | None = Field(None, ge=1, description=(
        "default cap on a request's tokens: its whole prompt (the user's text and images, the chunks) and n × "
        "max_tokens (serve/governance/budget.py)"))
    requests_per_s: float | None = Field(None, gt=0)
    request_burst: int | None = Field(None, ge=1, description="default: one second's worth, at least 1")
    tokens_per_s: float | None = Field(None, gt=0, description="context + query + max_new_tokens per second")
    token_burst: int | None = Field(None, ge=1, description="default: one second's worth, at least 1")
    max_in_flight: int | None = Field(None, ge=1, description=(
        "requests of the tenant in progress at once on one ingress replica (streams until they end); past it 429 "
        "with Retry-After: one tenant's long requests cannot fill every slot"))

    def rate(self, limit: Limit) -> tuple[float, float] | None:
        """(refill per second, capacity) of one bucket, or None when that rate is unlimited."""
        rate, burst = ((self.requests_per_s, self.request_burst) if limit is Limit.REQUESTS
                       else (self.tokens_per_s, self.token_burst))
        return None if rate is None else (rate, float(burst or max(1, math.ceil(rate))))


class RateLimitConfig(Frozen):
    """Token budgets and rate limits per tenant (serve/governance/budget.py)."""

    default: TenantPolicy = TenantPolicy()
    tenants: dict[Label, TenantPolicy] = Field(default_factory=dict, description=(
        "a tenant listed here gets exactly this policy instead of `default` (unset fields: unlimited)"))
    backend: StateBackend = StateBackend.MEMORY
    refusal_hold_s: float = Field(1.0, ge=0, le=10, description=(
        "a request refused on arrival (its tenant's request rate spent, or its token rate in debt) gets its 429 "
        "after the wait it names, at most "
        "this long: a client that ignores Retry-After sends at most one request per connection per hold, not a "
        "flood of refused requests whose bodies the server still receives (0: answered at once)"))
    max_held_refusals: int = Field(4, ge=0, le=64, description=(
        "refusals of one tenant held at once on one ingress replica; more are answered at once, so a tenant's "
        "held refusals take at most this many of the replica's `max_ongoing_requests`"))
    max_held_refusals_total: int = Field(4, ge=0, le=1024, description=(
        "refusals held at once on one ingress replica, every tenant's together; more are answered at once. Each "
        "takes one of the replica's `max_ongoing_requests` (ingress_deployment, 16 by default) while held, so "
        "hostile keys together take at most this many (a quarter); it must stay below `max_ongoing_requests`"))

    def policy(self, tenant: str) -> TenantPolicy:
        return self.tenants.get(tenant, self.default)


class TaskCachePolicy(Frozen):
    """How the response cache treats one declared task type (`task_type` / `X-Task-Type`)."""

    query_independent: bool = Field(False, description=(
        "its answer depends on the context alone, not on the query's wording (e.g. summarize): with level l3 "
        "one entry per context answers every wording. Any caller's wording fills that entry, so declare only "
        "task types whose callers send a fixed prompt"))
    shared: bool = Field(False, description=(
        "its entries cross tenants: one tenant's answer, and the fact that it was asked, reach every tenant "
        "(Cache-Status and latency show a hit). Opt in only where tenants trust each other, e.g. a public "
        "corpus's summaries; every other entry is keyed by its tenant"))


class ResponseCacheConfig(Frozen):
    """Response caches (serve/governance/response_cache.py). Entries are per tenant unless a task type opts in
    to sharing; l3 serves only task types declared query-independent, never a free question."""

    levels: frozenset[ResponseCacheLevel] = frozenset({ResponseCacheLevel.L1})
    backend: StateBackend = StateBackend.MEMORY
    max_entries: int = Field(4096, ge=1, description="memory backend: entries per ingress replica (LRU)")
    ttl_s: dict[ResponseCacheLevel, float] = Field(
        default_factory=lambda: {ResponseCacheLevel.L1: 3600.0, ResponseCacheLevel.L2: 600.0,
                                 ResponseCacheLevel.L3: 86400.0})
    l2_threshold: float = Field(0.95, gt=0.0, le=1.0, description="least cosine of query embeddings for an l2 hit")
    l2_candidates: int = Field(32, ge=1, le=1024, description="(query, answer) pairs kept per l2 context")
    task_types: dict[Label, TaskCachePolicy] = Field(default_factory=dict, description=(
        "declared task types: which are query-independent (l3) and which share entries across tenants; "
        "an undeclared task type is a free question, cached per tenant at l1/l2 only"))

    @model_validator(mode="before")
    @classmethod
    def _per_tenant_is_gone(cls, data: Any) -> Any:
        # A config written for the old shared-by-default cache must not silently change meaning.
        if isinstance(data, Mapping) and "per_tenant" in data:
            raise ValueError("per_tenant was removed: entries are per tenant by default; share a task type's "
                             "entries across tenants with task_types: {<name>: {shared: true}}")
        return data

    @model_validator(mode="after")
    def _every_level_has_a_ttl(self) -> ResponseCacheConfig:
        missing = [level.value for level in self.levels if level not in self.ttl_s]
        if missing or any(ttl <= 0 for ttl in self.ttl_s.values()):
            raise ValueError(f"every enabled level needs a positive ttl_s; missing or non-positive: {missing}")
        return self

    def policy(self, task_type: str | None) -> TaskCachePolicy:
        return self.task_types.get(task_type, _FREE_QUESTION) if task_type else _FREE_QUESTION


_FREE_QUESTION = TaskCachePolicy()


class RequestLogConfig(Frozen):
    """The request log (serve/governance/request_log.py)."""

    location: StoreSpec | None = Field(None, description="directory or s3:// prefix of the part files; null = off")
    batch_rows: int = Field(256, ge=1)
    flush_interval_s: float = Field(30.0, gt=0)


Sha256Hex = str  # 64 lowercase hex digits, checked by AuthConfig


# A collection a tenant may read, or "*" for every collection (an operator's key).
CollectionGrant = Annotated[str, StringConstraints(pattern=rf"^(\{ALL_COLLECTIONS}|{COLLECTION_PATTERN[1:-1]})$")]


class AuthConfig(Frozen):
    """API-key auth (serve/governance/auth.py): sha256 hex digests of the keys, never the keys."""

    api_key_sha256: dict[Sha256Hex, Label] = Field(
        default_factory=dict, description="sha256 hex of an API key -> its tenant; empty = no auth, and the tenant "
        "is whatever X-Tenant says: for loopback and development only")
    api_key_sha256_file: Path | None = Field(None, description=(
        "a file of `<sha256 hex> <tenant>` lines (a mounted Kubernetes Secret), read at each replica's start and "
        "merged with api_key_sha256: rotate keys by updating it and restarting (or redeploying) the ingress"))
    trusted_proxy_sha256: frozenset[Sha256Hex] = Field(frozenset(), description=(
        "sha256 hex of the keys of trusted gateways that act for many tenants: a request with one names its tenant "
        "in X-Tenant (required); with any other key X-Tenant is ignored and the tenant is the key's"))
    open_paths: frozenset[str] = Field(frozenset({"/healthz", "/readyz", "/health"}), description=(
        "paths answered without a key when keys are configured (the probes by default, vLLM's /health among them; add "
        "/metrics for a scraper without a key, /docs and /openapi.json to publish the API docs); every other route "
        "needs one"))
    insecure_no_auth: bool = Field(False, description=(
        "serve beyond loopback with no API keys (anyone who reaches the port spends any tenant's budget); "
        "`qvpic serve` refuses such a bind without it and warns at every start with it"))
    collections: dict[Label, frozenset[CollectionGrant]] = Field(default_factory=dict, description=(
        "tenant -> the document collections it reads (`*`: all): retrieval, chunk_ids, doc_ids, the inspector "
        "and /v1/store see only those; a chunk outside them is unknown (404), like one that does not exist. "
        "Resolved from the authenticated tenant (without keys: X-Tenant or default_tenant, so not isolation)"))
    default_collections: frozenset[CollectionGrant] = Field(frozenset({DEFAULT_COLLECTION}), description=(
        "what a tenant not listed in `collections` reads"))

    def grant(self, tenant: str) -> frozenset[str]:
        """The collections `tenant` reads."""
        return self.collections.get(tenant, self.default_collections)

    @field_validator("api_key_sha256", "trusted_proxy_sha256")
    @classmethod
    def _digests(cls, keys):
        bad = [k for k in keys if len(k) != 64 or k.strip("0123456789abcdef")]
        if bad:
            raise ValueError(f"keys must be 64 lowercase hex digits (sha256 of the API key), got {bad[:3]}")
        return keys


class GovernanceConfig(Frozen):
    """Defaults keep an ungoverned server's behaviour: in-process l1 cache only, no limits, no log, no auth."""

    default_tenant: Label = "anonymous"
    redis_url: RedisUrlField | None = Field(None, description=(
        "shared state for backend: redis (redis:// or rediss://); shown redacted wherever it is printed"))
    limits: RateLimitConfig = RateLimitConfig()
    response_cache: ResponseCacheConfig = ResponseCacheConfig()
    request_log: RequestLogConfig = RequestLogConfig()
    auth: AuthConfig = AuthConfig()

    @model_validator(mode="after")
    def _redis_when_used(self) -> GovernanceConfig:
        uses = [name for name, backend in (("limits", self.limits.backend),
                                           ("response_cache", self.response_cache.backend))
                if backend is StateBackend.REDIS]
        if uses and self.redis_url is None:
            raise ValueError(f"{uses} use backend 'redis' but redis_url is not set")
        return self
