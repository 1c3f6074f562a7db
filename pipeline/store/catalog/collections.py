"""Which collection each catalog row is in, and which rows a set of collections may read.

A chunk's collection is its document's (schemas/corpus.py `COLLECTION_KEY`, a column of the chunk table),
written into the chunks dir as one code per catalog row (`collections.npy`, int32, memory-mapped) and the
names the codes stand for, with each collection's chunk and document counts (`collections.json`). A chunks
dir written before collections existed has neither: all its rows are in the default collection, exactly as
its chunk table's rows (which lack the column) read.

Serving never asks "is this chunk hidden": it asks for rows through a `RowFilter` of the request's
collections, and a row outside them is simply not found — the lookups, the vector search and the counts
treat it as a row that does not exist.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from schemas.corpus import DEFAULT_COLLECTION
from schemas.frozen import Frozen
from schemas.generation import CollectionCounts, reads_all

COLLECTIONS, COLLECTION_CODES = "collections.json", "collections.npy"
_FILTERS_KEPT = 64  # row filters cached per catalog: one per distinct grant in use


class CollectionsRecord(Frozen):
    """`collections.json`: the name of each code, and each collection's counts (same order)."""

    names: tuple[str, ...]
    counts: tuple[CollectionCounts, ...]


class RowFilter:
    """The catalog rows one grant reads: a mask over every row, and the rows themselves (sorted)."""

    def __init__(self, mask: np.ndarray):
        self.mask = mask
        self.rows = np.flatnonzero(mask)
        self.count = len(self.rows)

    def __len__(self) -> int:
        return self.count

    def spans_readable(self, spans: list[tuple[int, int]]) -> list[bool]:
        """Whether every row of each (start, count) span is readable."""
        return [bool(self.mask[start:start + count].all()) for start, count in spans]


class RowCollections:
    """The collection codes of one chunks dir, opened for routing; thread-safe."""

    def __init__(self, chunks_dir: Path, num_rows: int):
        self.num_rows = num_rows
        record_path = chunks_dir / COLLECTIONS
        if record_path.exists():
            self.record = CollectionsRecord.model_validate_json(record_path.read_text())
            self.codes = np.load(chunks_dir / COLLECTION_CODES, mmap_mode="r", allow_pickle=False)
            if len(self.codes) != num_rows:
                raise ValueError(f"{chunks_dir}: {len(self.codes)} collection codes for {num_rows} catalog rows")
        else:  # written before collections existed: every row is in the default collection
            self.record, self.codes = CollectionsRecord(names=(DEFAULT_COLLECTION,), counts=()), None
        self._filters: OrderedDict[frozenset[int], RowFilter | None] = OrderedDict()
        self._lock = threading.Lock()

    def filter(self, grant: frozenset[str] | None) -> RowFilter | None:
        """The rows `grant` reads; None when it reads every row (no filter to apply)."""
        if reads_all(grant):
            return None
        codes = frozenset(i for i, name in enumerate(self.record.names) if name in grant)
        if len(codes) == len(self.record.names):
            return None
        with self._lock:
            if codes in self._filters:
                self._filters.move_to_end(codes)
                return self._filters[codes]
        if self.codes is None:
            mask = np.full(self.num_rows, bool(codes))  # one collection: all rows or none
        else:
            mask = np.isin(self.codes, np.fromiter(codes, np.int32, len(codes)))
        found = RowFilter(mask)
        with self._lock:
            self._filters[codes] = found
            while len(self._filters) > _FILTERS_KEPT:
                self._filters.popitem(last=False)
        return found


def write_collections(out: Path, codes: np.ndarray, names: list[str], documents: np.ndarray) -> dict[str, dict]:
    """Write the codes (one per catalog row) and the record into chunks dir `out`; `documents` holds each
    document's code. Returns the per-collection counts, by name (what the generation record carries)."""
    np.save(out / COLLECTION_CODES, codes.astype(np.int32))
    chunks = np.bincount(codes, minlength=len(names)) if len(codes) else np.zeros(len(names), np.int64)
    docs = np.bincount(documents, minlength=len(names)) if len(documents) else np.zeros(len(names), np.int64)
    counts = [CollectionCounts(num_chunks=int(c), num_documents=int(d)) for c, d in zip(chunks, docs)]
    (out / COLLECTIONS).write_text(CollectionsRecord(names=tuple(names), counts=tuple(counts)).model_dump_json())
    return {name: c.model_dump() for name, c in zip(names, counts)}

