"""A generation's chunk catalog and entry table: what routing reads, laid out for reads by row.

Written once, streaming, by the job that publishes a generation (pipeline/store/catalog/writer.py), read by
the router (`Catalog`) without loading it: the .npy lookups are memory-mapped, rows of the Arrow IPC
files and embeddings are read by `pread` (`RowFile`, `EmbeddingRows`), so start-up costs
milliseconds at any size and a request reads only the record batches holding the rows it uses.

chunks dir (shared by generations whose chunk tables are identical; named by a digest of its parts):
    catalog.arrow     chunk_id, doc_id, order, chunk_key, num_text_tokens: one row per chunk, sorted by
                      (hash of doc_id, doc_id, order, chunk_id), so a document's chunks are one
                      contiguous range
    texts.arrow       text, image_path: same rows (not downloaded from an object store: read by range)
    embeddings.npy    float16 [rows, dim]: rerank and relevance scores (pipeline/store/catalog/embedding_rows.py)
    chunk_ids.npy     [(hash, row)] sorted by hash: chunk id -> row in O(log rows)
    doc_ids.npy       [(hash, start, count)] sorted by hash: document -> its range of rows
    vectors-*.faiss   the vector index (pipeline/store/catalog/vector_index.py; its files are listed in search.json,
                      with its SearchInfo)
    collections.npy   int32 [rows]: each row's collection, as a code of collections.json (names and counts);
                      absent from a dir written before collections existed (pipeline/store/catalog/collections.py)
entries dir (named by a digest of the chunks dir, the index parts and the served fingerprints):
    entries.arrow     index rows current under the generation's manifest, sorted by chunk_key
    ranges.npy        [rows, 2] (start, count) of each catalog row's entries in entries.arrow
The .arrow files hold record batches of exactly BATCH_ROWS rows (the last fewer): row r is in batch
r // BATCH_ROWS, so a reader finds it without reading anything else.
"""

from __future__ import annotations

import hashlib
import mmap
import threading
from collections import OrderedDict, defaultdict
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa

from pipeline.store.catalog.collections import RowCollections, RowFilter
from pipeline.store.catalog.embedding_rows import EmbeddingRows
from pipeline.store.catalog.vector_index import VectorIndex
from schemas.generation import ScanSpec, SearchInfo
from schemas.modes import Variant

CATALOG, TEXTS, EMBEDDINGS = "catalog.arrow", "texts.arrow", "embeddings.npy"
CHUNK_IDS, DOC_IDS, SEARCH = "chunk_ids.npy", "doc_ids.npy", "search.json"
COUNTS = "counts.json"  # in both dirs: the row counts a generation record carries
ENTRIES, RANGES = "entries.arrow", "ranges.npy"
CATALOG_COLUMNS = ("chunk_id", "doc_id", "order", "chunk_key", "num_text_tokens")
TEXT_COLUMNS = ("text", "image_path")
BATCH_ROWS = {CATALOG: 256, TEXTS: 128, ENTRIES: 128}  # rows per record batch: one batch read per row used


def id_hashes(ids: list[str]) -> np.ndarray:
    """64-bit blake2b of each id (stable across processes; collisions are checked on lookup)."""
    return np.array([int.from_bytes(hashlib.blake2b(i.encode(), digest_size=8).digest(), "little") for i in ids],
                    dtype=np.uint64)


class RowFile:
    """Rows of an Arrow IPC file of fixed-size record batches (the last may be shorter), each request
    reading only the batches that hold its rows, by `pread` locally or by range on an object store.

    Not memory-mapped: the page cache keeps file data in large folios here, and a mapped read of one
    row mapped 64 KB-4 MB around every column it touched (~3 MB per entry row; at 10^6 chunks the
    router's resident memory grew by 1.3 GB over 100 requests). Thread-safe.

    The last `cache_rows` rows read are kept as Python dicts (LRU): the file never changes (a generation is
    immutable), and reading a row's batch and converting it again cost ~0.1 ms a row — 1.5 ms of a new query's
    3 ms route after its embedding went on the 8 chunks' catalog and entry rows (docs/BENCHMARKS.md `routing`).
    """

    def __init__(self, source: Path | pa.NativeFile, cache_rows: int = 4096):
        self.file = pa.OSFile(str(source)) if isinstance(source, Path) else source
        self.reader = pa.ipc.open_file(self.file)
        self.schema, count = self.reader.schema, self.reader.num_record_batches
        self.batch_rows = self.reader.get_batch(0).num_rows if count else 1
        self.num_rows = (count - 1) * self.batch_rows + self.reader.get_batch(count - 1).num_rows if count else 0
        self._lock = threading.Lock()
        self.cache_rows = cache_rows
        self._cache: OrderedDict[int, dict[str, Any]] = OrderedDict()  # row -> every column; guarded by _lock

    def rows(self, rows: list[int], columns: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
        """`columns` (default: all) of `rows`, in their order, each a new dict. Rows not cached: one read and
        one conversion per record batch (converting row by row cost ~40 µs a row)."""
        out: list[dict[str, Any] | None] = [None] * len(rows)
        positions: dict[int, list[int]] = defaultdict(list)  # record batch -> positions in `rows` not cached
        with self._lock:
            for position, row in enumerate(rows):
                if (values := self._cache.get(row)) is not None:
                    self._cache.move_to_end(row)
                    out[position] = values
                else:
                    positions[row // self.batch_rows].append(position)
        for batch, where in sorted(positions.items()):
            with self._lock:  # one reader, one file position on object stores
                record = self.reader.get_batch(batch)
            offsets = pa.array([rows[p] % self.batch_rows for p in where], pa.int64())
            read = record.take(offsets).to_pylist()
            with self._lock:
                for position, values in zip(where, read):
                    out[position] = values
                    if self.cache_rows > 0:
                        self._cache[rows[position]] = values
                        if len(self._cache) > self.cache_rows:
                            self._cache.popitem(last=False)
        if columns is None:  # copies: a caller's change never reaches the cache
            return [dict(values) for values in out]
        return [{name: values[name] for name in columns} for values in out]

    def close(self) -> None:
        self.file.close()


def _npy(path: Path) -> np.ndarray:
    """A memory-mapped lookup array (binary searches touch a few pages; the files are 16 bytes a chunk)."""
    array = np.load(path, mmap_mode="r", allow_pickle=False)
    array._mmap.madvise(mmap.MADV_RANDOM)
    return array


class Catalog:
    """One generation's chunks and entries, opened for routing; immutable and thread-safe.

    `texts` is texts.arrow opened for random access (a local file, or ranged reads on an object
    store); everything else lives in `chunks_dir` / `entries_dir` on local disk.
    """

    def __init__(self, chunks_dir: Path, entries_dir: Path, texts: pa.NativeFile, scan: ScanSpec):
        self.catalog = RowFile(chunks_dir / CATALOG)
        self.chunk_lookup = _npy(chunks_dir / CHUNK_IDS)
        self.doc_lookup = _npy(chunks_dir / DOC_IDS)
        info = SearchInfo.model_validate_json((chunks_dir / SEARCH).read_text())
        self.vectors = VectorIndex(chunks_dir, EmbeddingRows(path=chunks_dir / EMBEDDINGS), info, scan)
        # no row cache here: the router keeps the entries it makes of these rows (serve/routing/retrieval.py
        # `EntryCache`), and a second copy of each row behind it would only hold memory
        self.entries = RowFile(entries_dir / ENTRIES, cache_rows=0)
        self.ranges = _npy(entries_dir / RANGES)
        self.text_rows = RowFile(texts)
        if not (self.catalog.num_rows == len(self.ranges) == len(self.vectors) == self.text_rows.num_rows):
            raise ValueError(f"catalog {chunks_dir} and entries {entries_dir} disagree on the number of chunks")
        self.collections = RowCollections(chunks_dir, self.catalog.num_rows)

    def readable(self, grant: frozenset[str] | None) -> RowFilter | None:
        """The rows the collections of `grant` hold (None: every row; `grant` None is every collection)."""
        return self.collections.filter(grant)

    @property
    def num_rows(self) -> int:
        return self.catalog.num_rows

    def rows_of_chunks(self, chunk_ids: list[str],
                       readable: RowFilter | None = None) -> tuple[list[int], list[str]]:
        """Catalog rows of `chunk_ids` in request order, and the ids not in the catalog — or not `readable`
        (None: every row), which are answered exactly as ids the catalog lacks."""
        spans, missing = self._find(chunk_ids, self.chunk_lookup, lambda entry: (int(entry["row"]), 1), "chunk_id",
                                    readable)
        return [start for start, _ in spans], missing

    def doc_spans(self, doc_ids: list[str],
                  readable: RowFilter | None = None) -> tuple[list[tuple[int, int]], list[str]]:
        """(first row, chunk count) of each document in `doc_ids`, in request order, and the ids not in the
        catalog (or not `readable`, as in `rows_of_chunks`): what a caller checks against its limits before
        expanding them into rows."""
        return self._find(doc_ids, self.doc_lookup, lambda entry: (int(entry["start"]), int(entry["count"])),
                          "doc_id", readable)

    def rows_of_docs(self, doc_ids: list[str], readable: RowFilter | None = None) -> tuple[list[int], list[str]]:
        """Every chunk row of each document in `doc_ids`, by (document in request order, order)."""
        spans, missing = self.doc_spans(doc_ids, readable)
        return [row for start, count in spans for row in range(start, start + count)], missing

    def _find(self, ids: list[str], lookup: np.ndarray, span_of: Callable, column: str,
              readable: RowFilter | None) -> tuple[list[tuple[int, int]], list[str]]:
        hashes = id_hashes(ids)
        lefts = np.searchsorted(lookup["hash"], hashes, "left")
        rights = np.searchsorted(lookup["hash"], hashes, "right")
        # usually one candidate an id; more only on a 64-bit hash collision. Their ids are read in one call.
        candidates = [(i, span) for i, (left, right) in enumerate(zip(lefts, rights))
                      for span in map(span_of, lookup[left:right]) if span[1]]
        names = self.catalog.rows([start for _, (start, _) in candidates], (column,))
        matched: dict[int, tuple[int, int]] = {}
        for (i, span), name in zip(candidates, names):
            if name[column] == ids[i]:
                matched.setdefault(i, span)
        if readable is not None:  # a row outside the request's collections is one the catalog does not hold
            spans = list(matched.items())
            matched = {i: span for (i, span), ok in zip(spans, readable.spans_readable([s for _, s in spans])) if ok}
        found = [matched[i] for i in range(len(ids)) if i in matched]
        return found, [wanted for i, wanted in enumerate(ids) if i not in matched]

    def chunk_rows(self, rows: list[int]) -> list[dict[str, Any]]:
        """CATALOG_COLUMNS of `rows`, in their order."""
        return self.catalog.rows(rows)

    def texts(self, rows: list[int]) -> list[dict[str, Any]]:
        """TEXT_COLUMNS of `rows`, reading only the record batches that hold them."""
        return self.text_rows.rows(rows)

    def entries_of(self, rows: list[int]) -> list[dict[tuple[str | None, Variant], dict[str, Any]]]:
        """Each row's current entries keyed by (tier, variant), with their full index rows."""
        spans = np.asarray(self.ranges[np.asarray(rows, dtype=np.int64)]).reshape(-1, 2).tolist()  # [(start, count)]
        flat = self.entries.rows([i for start, count in spans for i in range(start, start + count)])
        out, at = [], 0
        for _, count in spans:
            out.append({(e["tier"], Variant(e["variant"])): e for e in flat[at:at + count]})
            at += count
        return out
