"""Response caches: answers served again with zero model work.

Every key lives under a namespace derived from the store's fingerprint (model, template, renderer,
tiers), so a fingerprint change invalidates everything at once; TTLs retire the rest. What a key
covers is the routed plan, so it is looked up after routing (which embeds the query, but runs no VLM)
and before any KV is loaded:
- `context`: mode, every chunk in request order with its tier and content (the KV entry key, which
  holds the chunk's text hash and entry fingerprint; for online modes a hash of its text or image),
  and the sampling parameters.
- l1 (exact): context + the normalised query (NFKC, runs of whitespace as one space).
- l3 (task): context + the task type, whatever the query's wording — only for task types that the config
  declares query-independent (`task_types: {summarize: {query_independent: true}}`), never for a free
  question, whose answer depends on what was asked.
- l2 (semantic): a bucket per context holding up to `l2_candidates` (query embedding, answer) pairs;
  a hit is the best cosine ≥ `l2_threshold`. A member is `[u32 nbytes][float32 unit embedding][answer
  JSON]`, so a lookup reads every embedding but parses one answer.
Every key holds the tenant, so no tenant reads another's answers or learns (from Cache-Status or latency)
what another asked; a task type declared `shared` opts its entries in to crossing tenants.
Lookup order l1 → l3 → l2. Sampled requests (temperature > 0 and no seed) are neither served nor
stored; neither are answers that needed a tier fallback (a degraded context should not outlive the fix).
A request steers the cache with HTTP's `Cache-Control` (RFC 9111): `no-cache` (or `max-age=0`, or
`Pragma: no-cache`) is never answered from the cache nor written to it: the model computes it and a stored
entry stays as it was (else any caller could replace what later callers read); `no-store` keeps its answer
out of the cache. Benchmarks and the demo send `no-cache`, so that what they time is model work.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
import unicodedata
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from pydantic import BaseModel

from schemas.report import AnswerReport, ResponseCacheLevel
from schemas.sampling import Sampling
from serve.governance.config import ResponseCacheConfig
from serve.governance.shared_state import RedisConnection, SharedStateUnavailable
from serve.plan import Answer, Plan


class CachedAnswer(BaseModel):
    """What a cache entry holds (JSON)."""

    text: str
    report: AnswerReport


_EMBEDDING_NBYTES = struct.Struct("<I")


def l2_member(unit_embedding: np.ndarray, answer_json: bytes) -> bytes:
    vector = unit_embedding.astype(np.float32).tobytes()
    return _EMBEDDING_NBYTES.pack(len(vector)) + vector + answer_json


def l2_embedding(member: bytes) -> np.ndarray:
    (nbytes,) = _EMBEDDING_NBYTES.unpack_from(member)
    return np.frombuffer(member, dtype=np.float32, count=nbytes // 4, offset=_EMBEDDING_NBYTES.size)


def l2_answer(member: bytes) -> CachedAnswer:
    (nbytes,) = _EMBEDDING_NBYTES.unpack_from(member)
    return CachedAnswer.model_validate_json(member[_EMBEDDING_NBYTES.size + nbytes:])


@dataclass(frozen=True)
class Put:
    key: str
    value: bytes
    ttl_s: float
    max_members: int | None = None  # set: prepend `value` to the member list at `key`, keep the newest max_members


class CacheBackend(Protocol):
    """Batched, so that a lookup and a fill each cost one round trip to a remote backend."""

    async def read(self, keys: Sequence[str], members_key: str | None) -> tuple[list[bytes | None], list[bytes]]:
        """The values of `keys` (None where absent or expired) and the members at `members_key`, newest first."""

    async def write(self, puts: Sequence[Put]) -> None: ...


class MemoryBackend:
    """LRU of `max_entries` keys (a value or a member list each), with expiry times."""

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._items: OrderedDict[str, tuple[float, bytes | list[bytes]]] = OrderedDict()

    def _live(self, key: str) -> bytes | list[bytes] | None:
        item = self._items.get(key)
        if item is None or item[0] <= time.monotonic():
            self._items.pop(key, None)
            return None
        self._items.move_to_end(key)
        return item[1]

    async def read(self, keys: Sequence[str], members_key: str | None) -> tuple[list[bytes | None], list[bytes]]:
        values = [value if isinstance(value := self._live(key), bytes) else None for key in keys]
        members = self._live(members_key) if members_key is not None else None
        return values, list(members) if isinstance(members, list) else []

    async def write(self, puts: Sequence[Put]) -> None:
        for put in puts:
            value: bytes | list[bytes] = put.value
            if put.max_members is not None:
                members = self._live(put.key)
                value = [put.value, *(members if isinstance(members, list) else [])][:put.max_members]
            self._items[put.key] = (time.monotonic() + put.ttl_s, value)
            self._items.move_to_end(put.key)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)


class RedisBackend:
    """Values as strings with PX; member lists as LPUSH + LTRIM + PEXPIRE; one pipeline per call."""

    USE = "response_cache"

    def __init__(self, redis: RedisConnection):
        self.redis = redis

    async def read(self, keys: Sequence[str], members_key: str | None) -> tuple[list[bytes | None], list[bytes]]:
        def run(client) -> list:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.get(key)
            if members_key is not None:
                pipe.lrange(members_key, 0, -1)
            return pipe.execute()

        replies = await self.redis.call(self.USE, run)
        return replies[:len(keys)], replies[len(keys)] if members_key is not None else []

    async def write(self, puts: Sequence[Put]) -> None:
        def run(client) -> None:
            pipe = client.pipeline(transaction=True)  # a member list is never seen half-trimmed
            for put in puts:
                ttl_ms = int(put.ttl_s * 1e3)
                if put.max_members is None:
                    pipe.set(put.key, put.value, px=ttl_ms)
                else:
                    pipe.lpush(put.key, put.value).ltrim(put.key, 0, put.max_members - 1).pexpire(put.key, ttl_ms)
            pipe.execute()

        await self.redis.call(self.USE, run)


@dataclass(frozen=True)
class CacheDirectives:
    """What a request's `Cache-Control` (or HTTP/1.0 `Pragma`) header asks of the response cache."""

    lookup: bool = True  # False: compute the answer even when one is stored
    store: bool = True  # False: do not keep this request's answer

    @classmethod
    def of(cls, headers: Mapping[str, str]) -> CacheDirectives:
        values = headers.getlist("cache-control") if hasattr(headers, "getlist") else [headers.get("cache-control", "")]
        directives = {part.split("=", 1)[0].strip().lower(): part.partition("=")[2].strip().strip('"')
                      for value in values for part in value.split(",") if part.strip()}
        no_cache = "no-cache" in directives or directives.get("max-age") == "0"
        if not directives and "no-cache" in headers.get("pragma", "").lower():
            no_cache = True  # RFC 9111 §5.4: Pragma counts only without Cache-Control
        return cls(lookup=not no_cache, store="no-store" not in directives)


def normalise_query(query: str) -> str:
    return " ".join(unicodedata.normalize("NFKC", query).split())


def cacheable(sampling: Sampling) -> bool:
    """Greedy, or sampled with a seed: the same request gives the same answer."""
    if sampling.logprobs is not None or sampling.n > 1:  # an entry holds one answer, no log-probabilities
        return False
    return sampling.temperature == 0.0 or sampling.seed is not None


def context_material(plan: Plan, sampling: Sampling) -> str:
    chunks = []
    for c in plan.chunks:
        content = (c.entry.key if c.entry is not None
                   else hashlib.sha256((c.text or c.image_path or "").encode()).hexdigest())
        chunks.append([c.chunk_id, c.tier, content])
    return json.dumps([plan.mode.value, plan.instruction, plan.query_prompt, plan.conversation, chunks,
                       sampling.max_new_tokens, sampling.temperature, sampling.top_p, sampling.seed,
                       sampling.stop, sampling.presence_penalty, sampling.frequency_penalty, sampling.logit_bias,
                       sampling.grammar, sampling.top_k, sampling.min_p, sampling.repetition_penalty,
                       sampling.min_tokens, sampling.stop_token_ids, sampling.ignore_eos, sampling.skip_special_tokens,
                       sampling.include_stop_str_in_output])


def _digest(*parts: str) -> str:
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()


@dataclass(frozen=True)
class CacheKeys:
    l1: str
    l2: str
    l3: str | None  # only for requests that declare a task type


@dataclass(frozen=True)
class CacheHit:
    level: ResponseCacheLevel
    answer: CachedAnswer
    similarity: float | None = None


class ResponseCache:
    def __init__(self, config: ResponseCacheConfig, namespace: str, backend: CacheBackend):
        self.config, self.namespace, self.backend = config, namespace, backend

    def keys(self, plan: Plan, sampling: Sampling, task_type: str | None, tenant: str) -> CacheKeys | None:
        """The request's keys, or None when nothing may be cached for it (no level on, or sampled)."""
        if not self.config.levels or not cacheable(sampling):
            return None
        context = context_material(plan, sampling)
        policy = self.config.policy(task_type)
        # The tenant is in every key unless the task type opted in to sharing: no answer, nor the fact that a
        # question was asked (a hit's Cache-Status, its latency), crosses tenants by default.
        scope = "shared" if policy.shared else f"t:{_digest(tenant)}"
        prefix = f"qvpic:rc:{self.namespace}:{scope}"
        return CacheKeys(l1=f"{prefix}:l1:{_digest(context, normalise_query(plan.query))}",
                         l2=f"{prefix}:l2:{_digest(context)}",
                         l3=f"{prefix}:l3:{_digest(context, task_type)}" if policy.query_independent else None)

    async def lookup(self, keys: CacheKeys, query_embedding: np.ndarray | None) -> CacheHit | None:
        """The first hit in l1, l3, l2 order; a backend failure is a miss (counted by the connection)."""
        levels = self.config.levels
        exact = [(level, key) for level, key in ((ResponseCacheLevel.L1, keys.l1), (ResponseCacheLevel.L3, keys.l3))
                 if level in levels and key is not None]
        members_key = keys.l2 if ResponseCacheLevel.L2 in levels and query_embedding is not None else None
        try:
            values, members = await self.backend.read([key for _, key in exact], members_key)
        except SharedStateUnavailable:
            return None
        for (level, _), value in zip(exact, values):
            if value:
                return CacheHit(level, CachedAnswer.model_validate_json(value))
        return self._nearest(members, query_embedding) if members else None

    def _nearest(self, members: list[bytes], query_embedding: np.ndarray) -> CacheHit | None:
        if not members:
            return None
        candidates = np.stack([l2_embedding(m) for m in members])  # [members, dim], rows unit-norm
        cosines = candidates @ (query_embedding / np.linalg.norm(query_embedding))
        best = int(np.argmax(cosines))
        if cosines[best] < self.config.l2_threshold:
            return None
        return CacheHit(ResponseCacheLevel.L2, l2_answer(members[best]), float(cosines[best]))

    async def store(self, keys: CacheKeys, answer: Answer, query_embedding: np.ndarray | None) -> None:
        if answer.report.fallbacks:
            return
        value = CachedAnswer(text=answer.text, report=answer.report).model_dump_json().encode()
        levels, ttl = self.config.levels, self.config.ttl_s
        puts = [Put(key, value, ttl[level]) for level, key in ((ResponseCacheLevel.L1, keys.l1),
                                                                (ResponseCacheLevel.L3, keys.l3))
                if level in levels and key is not None]
        if ResponseCacheLevel.L2 in levels and query_embedding is not None:
            member = l2_member(query_embedding / np.linalg.norm(query_embedding), value)
            puts.append(Put(keys.l2, member, ttl[ResponseCacheLevel.L2], self.config.l2_candidates))
        try:
            await self.backend.write(puts)
        except SharedStateUnavailable:
            return  # counted and logged by the connection; the answer was served all the same
