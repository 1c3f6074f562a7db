"""One small interface for every KV cache tier, and the fall-through over them.

A cache tier holds compiled entries by entry key (content-addressed: chunk text hash + resolution tier + variant +
model fingerprint, so a hit anywhere is the store's own bytes). Fastest first:

    device   the generator's hot tier (serve/kv/hot_tier.py): KV on the device, ready to re-anchor
    host     the loader's LRU in host memory (serve/kv/loader.py `HostTier`): the wire form, numpy
    store    the store's shards (serve/kv/loader.py `StoreTier`): read, checked against their checksums

Each answers `get_many` with what it holds (a hit) and what it can never give (`failed`: a corrupt shard, a pending
entry of a lazily compiled tier; no slower tier is asked for those), and keeps what a slower tier found when it is
handed it (`put_many`). `fall_through` is the walk: each entry from the fastest tier that holds it, every faster tier
filled on the way back — LMCache's storage backend seam (`contains / get / put`, batched), over qvpic's entries.

The generator's own walk has the same three steps, with a process boundary in the middle: the device tier here, the
loader's host and store tiers behind its `KVSource` (serve/kv/source.py), and what none could read compiled again by
the generator's model (serve/engine/repair.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from schemas.report import KVOrigin
from serve.plan import Entry

V = TypeVar("V")


@dataclass
class TierRead(Generic[V]):
    """What one tier answered for a batch of entries (both keyed by entry key)."""

    found: dict[str, V] = field(default_factory=dict)  # hits: the tier's value
    failed: dict[str, str] = field(default_factory=dict)  # why it can never give these (no slower tier is asked)


class KVTier(Protocol[V]):
    """One cache tier: a batched look-up and a batched fill."""

    origin: KVOrigin  # what a hit here is reported as (serve/plan.py `LoadResult.sources`, the answer report)

    def get_many(self, entries: Sequence[Entry]) -> TierRead[V]:
        """The entries this tier holds (misses are simply absent), and those it can never give."""
        ...

    def put_many(self, values: Mapping[str, V]) -> None:
        """Keep these values, found by a slower tier (a tier that keeps nothing ignores them)."""
        ...


@dataclass
class Walk(Generic[V]):
    """Where each entry of a fall-through came from."""

    found: dict[str, V] = field(default_factory=dict)  # entry key -> value
    failed: dict[str, str] = field(default_factory=dict)  # entry key -> why no tier could give it
    origins: dict[str, KVOrigin] = field(default_factory=dict)  # entry key -> the tier that gave it


def fall_through(tiers: Sequence[KVTier[V]], entries: Sequence[Entry]) -> Walk[V]:
    """Each of `entries` (duplicates read once) from the fastest of `tiers` that holds it; what a slower tier found
    is put in every faster one. An entry no tier holds and none failed is absent from the walk."""
    wanted = {entry.key: entry for entry in entries}
    walk: Walk[V] = Walk()
    for depth, tier in enumerate(tiers):
        if not wanted:
            break
        read = tier.get_many(list(wanted.values()))
        for faster in tiers[:depth]:
            faster.put_many(read.found)
        walk.found.update(read.found)
        walk.failed.update(read.failed)
        walk.origins.update(dict.fromkeys(read.found, tier.origin))
        wanted = {key: entry for key, entry in wanted.items() if key not in read.found and key not in read.failed}
    return walk
