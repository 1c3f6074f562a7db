"""A byte-capped least-recently-used map: the eviction policy of both serving KV tiers.

The loader's host-memory tier (serve/kv/loader.py) keeps numpy arrays, the generator's device tier
(serve/kv/hot_tier.py) keeps device KV; each passes how to size its values. Not thread-safe on its own:
each tier serialises access with its own lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

from schemas.service import CacheStats

V = TypeVar("V")


class ByteLRU(Generic[V]):
    """Map of key → value whose summed `nbytes(value)` never exceeds `max_nbytes`; the least recently
    used go first. A value larger than the whole cap is not kept (its caller still has it)."""

    def __init__(self, max_nbytes: int, nbytes: Callable[[V], int]):
        if max_nbytes < 0:
            raise ValueError(f"max_nbytes must be >= 0, got {max_nbytes}")
        self.max_nbytes, self.nbytes_of = max_nbytes, nbytes
        self.nbytes = 0
        self.hits = self.misses = self.evictions = 0
        self._items: OrderedDict[str, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> list[str]:
        """Cached keys, least recently used first (the next to be evicted)."""
        return list(self._items)

    def get(self, key: str) -> V | None:
        """The value (now the most recently used), counted as a hit; None, counted as a miss."""
        value = self._items.get(key)
        if value is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key: str, value: V) -> None:
        if key in self._items:
            self.nbytes -= self.nbytes_of(self._items.pop(key))
        size = self.nbytes_of(value)
        if size > self.max_nbytes:
            return
        while self.nbytes + size > self.max_nbytes:
            _, evicted = self._items.popitem(last=False)
            self.nbytes -= self.nbytes_of(evicted)
            self.evictions += 1
        self._items[key] = value
        self.nbytes += size

    def clear(self) -> None:
        self._items.clear()
        self.nbytes = 0

    def stats(self) -> CacheStats:
        return CacheStats(entries=len(self._items), nbytes=self.nbytes, max_nbytes=self.max_nbytes,
                          hits=self.hits, misses=self.misses, evictions=self.evictions)
