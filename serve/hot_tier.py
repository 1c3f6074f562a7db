"""The top KV tier: chunk KV resident on the generator's device, a byte-capped LRU.

Tiers, fastest first: this one (device memory of the generator replica), the loader's host-memory LRU
(serve/loader.py), the store. A hot chunk crosses host→device once, then every request that links it
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
from collections import OrderedDict
from collections.abc import Iterable

from pipeline.runtime.kv import ChunkKV
from schemas.api import CacheStats
from serve.plan import Entry


class HotTier:
    """Least-recently-used map of entry key → (device KV, the entry); summed KV bytes ≤ `max_nbytes`.

    A KV larger than the whole cap is not kept. Thread-safe (requests share it).
    """

    def __init__(self, max_nbytes: int):
        if max_nbytes < 0:
            raise ValueError(f"max_nbytes must be >= 0, got {max_nbytes}")
        self.max_nbytes, self.nbytes = max_nbytes, 0
        self.hits = self.misses = self.evictions = 0
        self._items: OrderedDict[str, tuple[ChunkKV, Entry]] = OrderedDict()
        self._lock = threading.Lock()

    def get_many(self, keys: Iterable[str]) -> dict[str, tuple[ChunkKV, Entry]]:
        """The resident ones among `keys` (each counted as a hit or a miss once)."""
        found = {}
        with self._lock:
            for key in dict.fromkeys(keys):
                item = self._items.get(key)
                if item is None:
                    self.misses += 1
                    continue
                self._items.move_to_end(key)
                self.hits += 1
                found[key] = item
        return found

    def put(self, key: str, kv: ChunkKV, entry: Entry) -> None:
        with self._lock:
            if key in self._items:
                self.nbytes -= self._items.pop(key)[0].nbytes
            if kv.nbytes > self.max_nbytes:
                return
            while self.nbytes + kv.nbytes > self.max_nbytes:
                _, (evicted, _) = self._items.popitem(last=False)
                self.nbytes -= evicted.nbytes
                self.evictions += 1
            self._items[key] = (kv, entry)
            self.nbytes += kv.nbytes

    def keys(self) -> list[str]:
        """Resident keys, least recently used first."""
        with self._lock:
            return list(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.nbytes = 0

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(entries=len(self._items), nbytes=self.nbytes, max_nbytes=self.max_nbytes,
                              hits=self.hits, misses=self.misses, evictions=self.evictions)
