"""The top KV tier: chunk KV resident on the generator's device, a byte-capped LRU.

Tiers, fastest first: this one (device memory of the generator replica), the loader's host-memory LRU
(serve/kv/loader.py), the store. A hot chunk crosses host→device once, then every request that links it
re-anchors it on the device (assembly never modifies the stored keys). Entries are kept as compiled
(keys at their compile-time positions), keyed by the entry's cache key, which is content-addressed
(chunk text hash + tier + variant + model fingerprint): a hit is the same bytes the store holds.

How misses are fetched: the generator asks the loader only for the entries this tier lacks (the rest
of the plan's chunks go with no entry), so a request whose chunks are all hot makes no loader call
and moves no KV at all; the loader answers its misses from its LRU or the store, and the generator
copies what arrives onto its device here.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from pipeline.runtime import ChunkKV
from schemas.api import CacheStats
from serve.kv.lru import ByteLRU
from serve.plan import Entry


class HotTier:
    """Least-recently-used map of entry key → (device KV, the entry); summed KV bytes ≤ `max_nbytes`
    (serve/kv/lru.py, the loader's policy too). A KV larger than the whole cap is not kept. Thread-safe
    (requests share it)."""

    def __init__(self, max_nbytes: int):
        self._lru: ByteLRU[tuple[ChunkKV, Entry]] = ByteLRU(max_nbytes, lambda item: item[0].nbytes)
        self._lock = threading.Lock()

    @property
    def max_nbytes(self) -> int:
        return self._lru.max_nbytes

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes

    def get_many(self, keys: Iterable[str]) -> dict[str, tuple[ChunkKV, Entry]]:
        """The resident ones among `keys` (each counted as a hit or a miss once)."""
        with self._lock:
            found = {key: self._lru.get(key) for key in dict.fromkeys(keys)}
        return {key: item for key, item in found.items() if item is not None}

    def put(self, key: str, kv: ChunkKV, entry: Entry) -> None:
        with self._lock:
            self._lru.put(key, (kv, entry))

    def keys(self) -> list[str]:
        """Resident keys, least recently used first."""
        with self._lock:
            return self._lru.keys()

    def clear(self) -> None:
        with self._lock:
            self._lru.clear()

    def stats(self) -> CacheStats:
        with self._lock:
            return self._lru.stats()
