"""Retrieval: one serving generation opened for routing, and which of its chunks a request selects.

A `Snapshot` is everything a plan reads about the store: the generation's manifest, its catalog
(memory-mapped; texts read only for the selected rows) and vector index. It is immutable: the router
swaps whole snapshots on hot reload, and a plan uses the one it started with throughout.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np

from pipeline.store import Store, local_copy, read_generation
from pipeline.store.catalog import TEXTS, Catalog
from schemas.api import AnswerRequest
from schemas.errors import TooLargeError, UnknownIdsError
from schemas.generation import Generation, ScanSpec
from schemas.modes import ChunkOrder
from schemas.render import TierSpec
from schemas.store import Manifest
from serve.routing.placement import ChunkEntries, EntrySlots

ENTRY_CACHE_ROWS = 4096  # chunks whose index rows and entries a router keeps made: a working set of conversations
SERVING_CACHE = Path(os.environ.get("QVPIC_SERVING_CACHE", Path.home() / ".cache" / "qvpic" / "serving"))


def check_count(selected: int, max_chunks: int) -> None:
    if selected > max_chunks:
        raise TooLargeError(f"{selected} chunks selected; this server takes at most {max_chunks} per request "
                            "(max_chunks)")


def require_known(field: str, missing: list[str]) -> None:
    if missing:
        more = f" (+{len(missing) - 10} more)" if len(missing) > 10 else ""
        raise UnknownIdsError(f"unknown {field}: {missing[:10]}{more}")


class EntryCache:
    """Each catalog row's `ChunkEntries` (its index rows, and the entries placement makes of them), the last
    `max_rows` rows used, for one snapshot's life (a generation's entries never change). A conversation's
    follow-up places every earlier question's chunks again, and reading the index rows and making entries of
    them was most of what placing a group cost (docs/BENCHMARKS.md `routing`, the follow-ups' table)."""

    def __init__(self, max_rows: int = ENTRY_CACHE_ROWS):
        self.max_rows = max_rows
        self._rows: OrderedDict[int, ChunkEntries] = OrderedDict()
        self._lock = threading.Lock()  # plans run on the replica's event loop and on worker threads
        self.loads = 0  # catalog reads, for tests

    def get(self, rows: list[int], load: Callable[[list[int]], list[EntrySlots]]) -> list[ChunkEntries]:
        """`rows`' entries, in order; the rows not kept are read with one `load` call."""
        with self._lock:
            found = {row: self._rows.get(row) for row in rows}
            for row, entries in found.items():
                if entries is not None:
                    self._rows.move_to_end(row)
        missing = [row for row, entries in found.items() if entries is None]
        if missing:
            self.loads += 1
            made = dict(zip(missing, map(ChunkEntries, load(missing))))
            found.update(made)
            with self._lock:
                for row, entries in made.items():
                    if self.max_rows > 0:
                        self._rows[row] = entries
                while len(self._rows) > self.max_rows:
                    self._rows.popitem(last=False)
        return [found[row] for row in rows]


@dataclass(frozen=True)
class Snapshot:
    record: Generation
    catalog: Catalog
    entry_cache: EntryCache = field(default_factory=EntryCache, compare=False, repr=False)

    @property
    def generation(self) -> int:
        return self.record.generation

    @property
    def manifest(self) -> Manifest:
        return self.record.manifest

    @property
    def published_at(self) -> datetime:
        return self.record.published_at

    @property
    def low(self) -> TierSpec:
        return self.manifest.render.lowest_tier

    @property
    def high(self) -> TierSpec:
        return self.manifest.render.highest_tier

    def chunk_entries(self, rows: list[int]) -> list[ChunkEntries]:
        """Each catalog row's stored entries, ready for placement (kept: `EntryCache`)."""
        return self.entry_cache.get(rows, self.catalog.entries_of)

    @contextlib.contextmanager
    def using(self, cache: EntryCache) -> Iterator[EntryCache]:
        """Place with `cache` for the block, then the snapshot's own again (a benchmark's or a test's control:
        `EntryCache(0)` keeps nothing, as the router placed before entries were kept)."""
        kept = self.entry_cache
        object.__setattr__(self, "entry_cache", cache)  # frozen: a snapshot is shared by the plans in flight
        try:
            yield cache
        finally:
            object.__setattr__(self, "entry_cache", kept)

    def select(self, request: AnswerRequest, query_vector: np.ndarray, max_chunks: int,
               collections: frozenset[str] | None = None) -> tuple[list[int], list[float]]:
        """Catalog rows the request names (chunk_ids, or doc_ids' chunks in order) or retrieves (top_k,
        best first, ties by catalog order; `ChunkOrder.SOURCE`: in catalog order, which keeps each document's
        chunks contiguous and in document order), with their cosine relevance to the query.

        Only rows in `collections` exist for the request (None: every collection — offline callers; the
        HTTP surface always passes the tenant's grant): a named id outside them is unknown, exactly as one the
        store never held, and retrieval is the top-k within them.

        Named ids are deduplicated (first mention wins) and their chunk count is checked against `max_chunks`
        before any row list is built: one small request naming many large documents costs a lookup, not
        arrays of every chunk they hold."""
        readable = self.catalog.readable(collections)
        if request.chunk_ids is not None:
            chunk_ids = list(dict.fromkeys(request.chunk_ids))
            check_count(len(chunk_ids), max_chunks)
            rows, missing = self.catalog.rows_of_chunks(chunk_ids, readable)
            require_known("chunk_ids", missing)
        elif request.doc_ids is not None:
            spans, missing = self.catalog.doc_spans(list(dict.fromkeys(request.doc_ids)), readable)
            require_known("doc_ids", missing)
            check_count(sum(count for _, count in spans), max_chunks)
            rows = [row for start, count in spans for row in range(start, start + count)]
        else:  # top_k is bounded by the schema
            found, scores = self.catalog.vectors.search(query_vector, request.top_k, readable)
            check_count(len(found), max_chunks)
            if request.order is ChunkOrder.SOURCE:
                by_row = np.argsort(found, kind="stable")
                found, scores = found[by_row], scores[by_row]
            return found.tolist(), scores.tolist()
        scores = self.catalog.vectors.scores(np.asarray(rows, np.int64), query_vector) if rows else []
        return rows, [float(s) for s in scores]


def open_snapshot(store: Store, generation: int, scan: ScanSpec = ScanSpec(),
                  cache_root: Path = SERVING_CACHE) -> Snapshot:
    """Open `generation` of `store` for routing (local stores in place; remote ones cached locally once,
    texts read by range), its vector index searched as `scan` says."""
    record = read_generation(store, generation)
    chunks_dir = local_copy(store, record.chunks_dir, cache_root)
    entries_dir = local_copy(store, record.entries_dir, cache_root)
    texts = store.blobs.open_input(f"{record.chunks_dir}/{TEXTS}")
    return Snapshot(record, Catalog(chunks_dir, entries_dir, texts, scan))
