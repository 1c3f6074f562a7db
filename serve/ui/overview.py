"""`GET /ui/api/store`'s body: what the store holds (read by the inspector deployment) and how the caches
in front of it are doing (one loader replica's host LRU, one generator replica's device hot tier)."""

from __future__ import annotations

from datetime import datetime

from schemas.config import KVQuant
from schemas.modes import Variant
from schemas.service import CacheStats
from schemas.wire import Strict


class EntryGroup(Strict):
    tier: str | None  # null for text variants
    variant: Variant
    entries: int
    nbytes: int


class QuarantineReason(Strict):
    reason: str
    count: int
    samples: list[str]  # "source: detail" of the first few inputs refused for it


class StoreOverview(Strict):
    fingerprint: str
    model_id: str
    tiers: dict[str, int]  # tier name -> DPI
    kv_quant: KVQuant
    generation: int  # the serving generation
    published_at: datetime  # when the last ingest or recompile published it
    job_id: str  # the job that published it
    num_documents: int
    num_chunks: int
    num_entries: int | None  # null (and `entries`, `quarantine` empty) for a key not reading every collection
    entries: list[EntryGroup]  # per (tier, variant)
    quarantine: list[QuarantineReason]  # most frequent first


class CacheTier(Strict):
    stats: CacheStats
    hit_rate: float | None  # hits / (hits + misses); null before any lookup

    @classmethod
    def of(cls, stats: CacheStats) -> CacheTier:
        lookups = stats.hits + stats.misses
        return cls(stats=stats, hit_rate=stats.hits / lookups if lookups else None)


class UiStore(Strict):
    store: StoreOverview
    host_cache: CacheTier
    device_cache: CacheTier
