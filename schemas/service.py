"""Wire contracts of the service's own routes: `GET /healthz` (liveness; readiness: schemas/health.py) and
`GET /v1/store` (what the store holds and how its caches are doing)."""

from __future__ import annotations

from typing import Literal

from schemas.config import KVQuant
from schemas.modes import Mode, Variant
from schemas.wire import Strict


class Health(Strict):
    status: Literal["ok"] = "ok"


class CacheStats(Strict):
    entries: int
    nbytes: int
    max_nbytes: int
    hits: int
    misses: int
    evictions: int


class StoreInfo(Strict):
    fingerprint: str
    model_id: str
    tiers: dict[str, int]  # tier name -> DPI
    variants: list[Variant]
    embedder: str
    embedding_dim: int  # of the embedder's vectors (POST /v1/embeddings)
    num_chunks: int  # within the collections the caller's key reads
    num_documents: int
    # KV entries are shared by content across collections: counted only for a key that reads every collection
    num_entries: int | None
    modes: list[Mode]  # the modes the store's variants can serve
    kv_quant: KVQuant = KVQuant.NONE  # how the store keeps its KV (dequantised on the generator's device)


class StoreStatus(StoreInfo):
    """`GET /v1/store`: what the store holds and how its caches are doing right now."""

    cache: CacheStats  # the loader's host-memory LRU (one replica's)
    device_cache: CacheStats | None = None  # the generator's device hot tier (one replica's)
