"""The top KV tier: chunk KV resident on the generator's device, a byte-capped LRU, and the compact
summary of what it holds that the generator reports to the request router across its replicas.

Tiers, fastest first: this one (device memory of the generator replica), the loader's host-memory LRU
(serve/kv/loader.py), the store. A hot chunk crosses host→device once, then every request that links it
re-anchors it on the device (assembly never modifies the stored keys). Entries are kept as compiled
(keys at their compile-time positions), keyed by the entry's cache key, which is content-addressed
(chunk text hash + tier + variant + model fingerprint): a hit is the same bytes the store holds.

How misses are fetched: the generator asks the loader only for the entries this tier lacks (the rest
of the plan's chunks go with no entry), so a request whose chunks are all hot makes no loader call
and moves no KV at all; the loader answers its misses from its LRU or the store, and the generator
copies what arrives onto its device here. A request whose entries another request is already fetching
waits for that copy (serve/engine/context.py) and finds them here: they cross host→device once and count
as hits.

What it reports (`routing_stats`, read by serve/dispatch/affinity.py): a Bloom filter of the resident
entry keys, sized from how many there are — `BITS_PER_KEY` = 10 bits and `NUM_HASHES` = 7 probes per key,
a false-positive rate of about 0.8 % — so 1M resident chunk entries take 1.25 MB (1,000 entries 1.25 kB);
the hot tier's byte cap bounds its entry count, and so the filter. Alongside go this tier's cumulative
hit and miss counts (entries and bytes) and the wall-clock time it was recorded, so a router can tell
stale stats from fresh ones.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.runtime import ChunkKV
from schemas.report import KVOrigin
from schemas.service import CacheStats
from serve.kv.lru import ByteLRU
from serve.kv.tier import TierRead
from serve.metrics import serve_metrics
from serve.plan import Entry

BITS_PER_KEY = 10
NUM_HASHES = 7  # ≈ BITS_PER_KEY · ln 2: the count that minimises false positives at that size
STATS_KEY = "hot_tier"  # where `routing_stats` puts this tier's summary in the replica's routing stats


def key_hash(key: str) -> tuple[int, int]:
    """Two independent 64-bit hashes of an entry key (blake2b: stable across processes, unlike `hash()`);
    probe i of a key is (h1 + i·h2) mod num_bits (Kirsch–Mitzenmacher double hashing)."""
    digest = hashlib.blake2b(key.encode(), digest_size=16).digest()
    return int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little") | 1


@dataclass(frozen=True)
class KeySketch:
    """A Bloom filter of entry keys: `contains` never misses a key that was added, and says yes to
    one that was not with probability ≈0.8 % (at `BITS_PER_KEY`)."""

    bits: bytes  # packed, little bit order: bit j is byte j // 8, bit j % 8
    num_bits: int

    @classmethod
    def of(cls, keys: Iterable[str]) -> KeySketch:
        hashes = np.array([key_hash(k) for k in keys], dtype=np.uint64).reshape(-1, 2)  # [keys, 2]
        num_bits = max(64, 8 * math.ceil(len(hashes) * BITS_PER_KEY / 8))
        set_bits = np.zeros(num_bits, dtype=bool)
        probes = np.arange(NUM_HASHES, dtype=np.uint64)
        with np.errstate(over="ignore"):  # the probes wrap modulo 2**64 before the modulo num_bits, on purpose
            positions = (hashes[:, :1] + probes * hashes[:, 1:]) % np.uint64(num_bits)  # [keys, NUM_HASHES]
        set_bits[positions.ravel().astype(np.int64)] = True
        return cls(np.packbits(set_bits, bitorder="little").tobytes(), num_bits)

    def contains(self, hashed: tuple[int, int]) -> bool:
        h1, h2 = hashed
        for i in range(NUM_HASHES):
            position = (h1 + i * h2) % (1 << 64) % self.num_bits
            if not self.bits[position >> 3] >> (position & 7) & 1:
                return False
        return True


@dataclass(frozen=True)
class HotTierReport:
    """One replica's hot tier as its routing stats carry it (plain types: Serve ships them to every
    router with each replica's info)."""

    sketch: KeySketch
    entries: int
    recorded_at_s: float  # time.time() on the replica
    lookups: int = 0  # requests that looked their entries up here
    hit_entries: int = 0
    miss_entries: int = 0
    hit_nbytes: int = 0
    miss_nbytes: int = 0

    def to_stats(self) -> dict[str, Any]:
        return {STATS_KEY: {"bits": self.sketch.bits, "num_bits": self.sketch.num_bits, "entries": self.entries,
                            "recorded_at_s": self.recorded_at_s, "lookups": self.lookups,
                            "hit_entries": self.hit_entries, "miss_entries": self.miss_entries,
                            "hit_nbytes": self.hit_nbytes, "miss_nbytes": self.miss_nbytes}}

    @classmethod
    def from_stats(cls, stats: dict[str, Any] | None) -> HotTierReport | None:
        """The report in a replica's routing stats; None when there is none or it does not parse (a
        replica that has not reported yet, or another version's): the router then knows nothing of it."""
        try:
            s = stats[STATS_KEY]
            sketch = KeySketch(bytes(s["bits"]), int(s["num_bits"]))
            if sketch.num_bits <= 0 or len(sketch.bits) * 8 < sketch.num_bits:
                return None
            return cls(sketch, int(s["entries"]), float(s["recorded_at_s"]), int(s["lookups"]),
                       int(s["hit_entries"]), int(s["miss_entries"]), int(s["hit_nbytes"]), int(s["miss_nbytes"]))
        except (KeyError, TypeError, ValueError):
            return None


Resident = tuple[ChunkKV, Entry]  # an entry's KV on the device, and the entry it is


class HotTier:
    """The device cache tier (serve/kv/tier.py `KVTier`): a least-recently-used map of entry key → (device KV, the
    entry); summed KV bytes ≤ `max_nbytes` (serve/kv/lru.py, the loader's policy too). A KV larger than the whole
    cap is not kept. Thread-safe (requests share it). Hits and misses are counted in entries and in device bytes (a
    miss's bytes when its KV is put), here and in the replica's metrics (`qvpic_hot_tier_entries` / `_bytes`)."""

    origin = KVOrigin.DEVICE

    def __init__(self, max_nbytes: int):
        self._lru: ByteLRU[Resident] = ByteLRU(max_nbytes, lambda item: item[0].nbytes)
        self._lock = threading.Lock()
        self._lookups = self._hit_nbytes = self._miss_nbytes = 0
        self._metrics = serve_metrics()

    @property
    def max_nbytes(self) -> int:
        return self._lru.max_nbytes

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes

    def get_many(self, entries: Sequence[Entry]) -> TierRead[Resident]:
        """The resident ones among `entries` (each distinct one counted as a hit or a miss once)."""
        with self._lock:
            found = {key: self._lru.get(key) for key in dict.fromkeys(e.key for e in entries)}
            hits = {key: item for key, item in found.items() if item is not None}
            hit_nbytes = sum(kv.nbytes for kv, _ in hits.values())
            self._hit_nbytes += hit_nbytes
            self._lookups += 1
        self._metrics.hot_tier_entries.inc(len(hits), outcome="hit")
        self._metrics.hot_tier_entries.inc(len(found) - len(hits), outcome="miss")
        self._metrics.hot_tier_bytes.inc(hit_nbytes, outcome="hit")
        return TierRead(hits)

    def put_many(self, values: Mapping[str, Resident]) -> None:
        """Keep missed entries' KV, already on the device (their bytes count as missed bytes)."""
        nbytes = sum(kv.nbytes for kv, _ in values.values())
        with self._lock:
            for key, item in values.items():
                self._lru.put(key, item)
            self._miss_nbytes += nbytes
        self._metrics.hot_tier_bytes.inc(nbytes, outcome="miss")

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

    def report(self) -> HotTierReport:
        """What this tier holds and has served, for the replica's routing stats."""
        with self._lock:
            keys, lookups, hits, misses = self._lru.keys(), self._lookups, self._lru.hits, self._lru.misses
            hit_nbytes, miss_nbytes = self._hit_nbytes, self._miss_nbytes
        return HotTierReport(KeySketch.of(keys), len(keys), time.time(), lookups, hits, misses, hit_nbytes,
                             miss_nbytes)
