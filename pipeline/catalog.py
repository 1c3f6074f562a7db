"""A generation's chunk catalog and entry table: what routing reads, laid out to be memory-mapped.

Written once by the job that publishes a generation (`write_chunks_dir`, `write_entries_dir`), read
by the router (`Catalog`) without loading it: Arrow IPC files and .npy arrays are memory-mapped, so
start-up costs milliseconds at any size and a request pages in only the rows it touches.

chunks dir (shared by generations whose chunk tables are identical; named by their digest):
    catalog.arrow     chunk_id, doc_id, order, chunk_key, num_text_tokens: one row per chunk, sorted by
                      (doc_id, order, chunk_id), so a document's chunks are one contiguous range
    texts.arrow       text, image_path: same rows, record batches of TEXT_BATCH_ROWS (on an object
                      store a request reads only the batches holding its rows, by range)
    embeddings.npy    float16 [rows, dim]: rerank and relevance scores
    chunk_ids.npy     [(hash, row)] sorted by hash: chunk id -> row in O(log rows)
    doc_ids.npy       [(hash, start, count)] sorted by hash: document -> its range of rows
    vectors.faiss     the vector index (pipeline/vector_index.py); search.json its SearchInfo
entries dir (named by the digest of the chunks dir and the entries):
    entries.arrow     index rows current under the generation's manifest, sorted by chunk_key
    ranges.npy        [rows, 2] (start, count) of each catalog row's entries in entries.arrow
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.vector_index import VectorIndex, build_index
from schemas.config import Variant
from schemas.generation import SearchInfo, SearchSpec

CATALOG, TEXTS, EMBEDDINGS, VECTORS = "catalog.arrow", "texts.arrow", "embeddings.npy", "vectors.faiss"
CHUNK_IDS, DOC_IDS, SEARCH = "chunk_ids.npy", "doc_ids.npy", "search.json"
ENTRIES, RANGES = "entries.arrow", "ranges.npy"
CATALOG_COLUMNS = ("chunk_id", "doc_id", "order", "chunk_key", "num_text_tokens")
TEXT_COLUMNS = ("text", "image_path")
TEXT_BATCH_ROWS = 1024
_BLOCK_ROWS = 65_536
_ID_LOOKUP = np.dtype([("hash", "<u8"), ("row", "<i8")])
_DOC_LOOKUP = np.dtype([("hash", "<u8"), ("start", "<i8"), ("count", "<i8")])


def id_hashes(ids: list[str]) -> np.ndarray:
    """64-bit blake2b of each id (stable across processes; collisions are checked on lookup)."""
    return np.array([int.from_bytes(hashlib.blake2b(i.encode(), digest_size=8).digest(), "little") for i in ids],
                    dtype=np.uint64)


def table_digest(table: pa.Table, salt: str = "") -> str:
    """sha256 of a table's Arrow IPC stream: equal tables (same rows, order and schema), equal digests."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return hashlib.sha256(salt.encode() + sink.getvalue().to_pybytes()).hexdigest()


def catalog_order(chunks: pa.Table) -> pa.Array:
    """Row indices of the chunk table in catalog order: (doc_id, order, chunk_id). Sorting indices, not
    the table: at 10^6 chunks a sorted copy of the embeddings and texts would cost gigabytes."""
    keys = chunks.select(["doc_id", "order", "chunk_id"])
    return pc.sort_indices(keys, [("doc_id", "ascending"), ("order", "ascending"), ("chunk_id", "ascending")])


def chunks_digest(chunks: pa.Table, order: pa.Array, embedder: str) -> str:
    """Identity of a catalog: its rows' ids and content keys in order (a chunk's text and embedding follow
    from its content key and the embedder)."""
    return table_digest(chunks.select(["chunk_id", "doc_id", "order", "chunk_key", "image_path"]).take(order),
                        embedder)


def _write_ipc(path: Path, table: pa.Table, batch_rows: int) -> None:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        for batch in table.combine_chunks().to_batches(max_chunksize=batch_rows):
            writer.write_batch(batch)


def _write_taken(path: Path, table: pa.Table, order: pa.Array, batch_rows: int) -> None:
    """`table.take(order)` as an IPC file, taken one batch at a time."""
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        for start in range(0, len(order), batch_rows):  # one batch of exactly batch_rows (readers index by it)
            writer.write_table(table.take(order.slice(start, batch_rows)).combine_chunks(), max_chunksize=batch_rows)


def write_chunks_dir(chunks: pa.Table, order: pa.Array, dim: int, spec: SearchSpec, out: Path) -> SearchInfo:
    """Write the chunks dir of `chunks` (CHUNKS_SCHEMA rows) in catalog `order` into `out`."""
    rows = chunks.num_rows
    _write_taken(out / CATALOG, chunks.select(list(CATALOG_COLUMNS)), order, _BLOCK_ROWS)
    _write_taken(out / TEXTS, chunks.select(list(TEXT_COLUMNS)), order, TEXT_BATCH_ROWS)
    embeddings = np.lib.format.open_memmap(out / EMBEDDINGS, mode="w+", dtype=np.float16, shape=(rows, dim))
    for start in range(0, rows, _BLOCK_ROWS):  # list<float32> -> [block, dim] float16, a block at a time
        block = chunks["embedding"].take(order.slice(start, _BLOCK_ROWS)).combine_chunks()
        values = block.flatten().to_numpy(zero_copy_only=False)
        embeddings[start:start + len(block)] = values.reshape(len(block), dim)
    embeddings.flush()
    ordered = _mapped(out / CATALOG)  # the id columns in catalog order, from the file just written
    chunk_lookup = np.empty(rows, _ID_LOOKUP)
    chunk_lookup["hash"], chunk_lookup["row"] = id_hashes(ordered["chunk_id"].to_pylist()), np.arange(rows)
    np.save(out / CHUNK_IDS, np.sort(chunk_lookup, order=["hash", "row"]))
    doc_ids = ordered["doc_id"].to_numpy(zero_copy_only=False)
    starts = np.flatnonzero(np.r_[True, doc_ids[1:] != doc_ids[:-1]]) if rows else np.empty(0, np.int64)
    doc_lookup = np.empty(len(starts), _DOC_LOOKUP)
    doc_lookup["hash"], doc_lookup["start"] = id_hashes(doc_ids[starts].tolist()), starts
    doc_lookup["count"] = np.diff(np.r_[starts, rows])
    np.save(out / DOC_IDS, np.sort(doc_lookup, order=["hash", "start"]))
    info = build_index(_npy(out / EMBEDDINGS), spec, out / VECTORS)
    (out / SEARCH).write_text(info.model_dump_json(indent=2))
    return info


def current_entries(index: pa.Table, fingerprint_of: Callable[[str | None, Variant], str | None]) -> pa.Table:
    """Index rows whose fingerprint is the one `fingerprint_of(tier, variant)` names (None: slot not
    served), sorted by (chunk_key, tier, variant); stale rows (another model, template, renderer or a
    tier no longer configured) are left out."""
    slots = index.select(["tier", "variant"]).group_by(["tier", "variant"]).aggregate([]).to_pylist()
    keep = pa.array([False] * index.num_rows)
    for slot in slots:
        fingerprint = fingerprint_of(slot["tier"], Variant(slot["variant"]))
        if fingerprint is None:
            continue
        tier_matches = pc.is_null(index["tier"]) if slot["tier"] is None else pc.equal(index["tier"], slot["tier"])
        match = pc.and_(pc.and_(tier_matches, pc.equal(index["variant"], slot["variant"])),
                        pc.equal(index["fingerprint"], fingerprint))
        keep = pc.or_(keep, pc.fill_null(match, False))
    current = index.filter(keep)
    current = current.drop_columns([c for c in ("created_at",) if c in current.column_names])
    return current.take(pc.sort_indices(current, [("chunk_key", "ascending"), ("tier", "ascending"),
                                                  ("variant", "ascending")]))


def write_entries_dir(entries: pa.Table, catalog_chunk_keys: np.ndarray, out: Path) -> None:
    """Write `entries` (sorted by chunk_key) and each catalog row's range of them into `out`."""
    _write_ipc(out / ENTRIES, entries, _BLOCK_ROWS)
    keys = entries["chunk_key"].to_numpy(zero_copy_only=False).astype("S64")
    wanted = catalog_chunk_keys.astype("S64")
    ranges = np.stack([np.searchsorted(keys, wanted, "left"), np.searchsorted(keys, wanted, "right")], axis=1)
    ranges[:, 1] -= ranges[:, 0]
    np.save(out / RANGES, ranges.astype(np.int64))


class _Batches:
    """A mapped table's record batches and where each starts, to read rows from the batch holding them."""

    def __init__(self, table: pa.Table):
        self.batches = table.to_batches()
        self.starts = np.cumsum([0] + [b.num_rows for b in self.batches])


def _slice(batches: _Batches, start: int, count: int) -> list[dict[str, Any]]:
    """Rows [start, start + count) as dicts, touching only the batches that hold them."""
    out: list[dict[str, Any]] = []
    while count > 0:
        index = int(np.searchsorted(batches.starts, start, "right")) - 1
        batch, offset = batches.batches[index], start - int(batches.starts[index])
        piece = batch.slice(offset, min(count, batch.num_rows - offset)).to_pylist()
        out += piece
        start, count = start + len(piece), count - len(piece)
    return out


def _npy(path: Path) -> np.ndarray:
    return np.load(path, mmap_mode="r", allow_pickle=False)


def _mapped(path: Path) -> pa.Table:
    return pa.ipc.open_file(pa.memory_map(str(path))).read_all()  # zero-copy over the mapped file


class Catalog:
    """One generation's chunks and entries, opened for routing; immutable and thread-safe.

    `texts` is a random-access Arrow IPC reader of texts.arrow (memory-mapped locally, ranged reads
    on an object store); everything else lives in `chunks_dir` / `entries_dir` on local disk.
    """

    def __init__(self, chunks_dir: Path, entries_dir: Path, texts: pa.ipc.RecordBatchFileReader,
                 rerank_candidates: int = 64):
        self.table = _mapped(chunks_dir / CATALOG)
        self.chunk_lookup = _npy(chunks_dir / CHUNK_IDS)
        self.doc_lookup = _npy(chunks_dir / DOC_IDS)
        info = SearchInfo.model_validate_json((chunks_dir / SEARCH).read_text())
        embeddings = _npy(chunks_dir / EMBEDDINGS)
        with contextlib.suppress(AttributeError, OSError):  # rows are read at random: no readahead around them
            embeddings._mmap.madvise(mmap.MADV_RANDOM)
        self.vectors = VectorIndex(chunks_dir / VECTORS, embeddings, info, rerank_candidates)
        self.entries = _mapped(entries_dir / ENTRIES)
        # Rows are read from the record batch that holds them: a `take` on the whole mapped table would
        # concatenate its batches, paging in (and copying) every row for a handful.
        self.table_batches, self.entry_batches = _Batches(self.table), _Batches(self.entries)
        self.ranges = _npy(entries_dir / RANGES)
        self.texts_reader = texts
        if not (self.table.num_rows == len(self.ranges) == len(self.vectors)):
            raise ValueError(f"catalog {chunks_dir} and entries {entries_dir} disagree on the number of chunks")

    @property
    def num_rows(self) -> int:
        return self.table.num_rows

    def rows_of_chunks(self, chunk_ids: list[str]) -> tuple[list[int], list[str]]:
        """Catalog rows of `chunk_ids` in request order, and the ids not in the catalog."""
        return self._find(chunk_ids, self.chunk_lookup, lambda entry: [int(entry["row"])], "chunk_id")

    def rows_of_docs(self, doc_ids: list[str]) -> tuple[list[int], list[str]]:
        """Every chunk row of each document in `doc_ids`, by (document in request order, order)."""
        return self._find(doc_ids, self.doc_lookup,
                          lambda entry: list(range(int(entry["start"]), int(entry["start"] + entry["count"]))),
                          "doc_id")

    def _find(self, ids: list[str], lookup: np.ndarray, rows_of: Callable, column: str) -> tuple[list[int], list[str]]:
        found, missing = [], []
        hashes = id_hashes(ids)
        lefts = np.searchsorted(lookup["hash"], hashes, "left")
        rights = np.searchsorted(lookup["hash"], hashes, "right")
        for wanted, left, right in zip(ids, lefts, rights):
            for entry in lookup[left:right]:  # usually one; more only on a 64-bit hash collision
                rows = rows_of(entry)
                if self.table[column][rows[0]].as_py() == wanted:
                    found += rows
                    break
            else:
                missing.append(wanted)
        return found, missing

    def chunk_rows(self, rows: list[int]) -> list[dict[str, Any]]:
        """CATALOG_COLUMNS of `rows`, in their order."""
        return [_slice(self.table_batches, row, 1)[0] for row in rows]

    def texts(self, rows: list[int]) -> list[dict[str, Any]]:
        """TEXT_COLUMNS of `rows`, reading only the record batches that hold them."""
        batches = {row // TEXT_BATCH_ROWS for row in rows}
        loaded = {b: self.texts_reader.get_batch(b) for b in sorted(batches)}
        return [{c: loaded[r // TEXT_BATCH_ROWS][c][r % TEXT_BATCH_ROWS].as_py() for c in TEXT_COLUMNS} for r in rows]

    def entries_of(self, rows: list[int]) -> list[dict[tuple[str | None, Variant], dict[str, Any]]]:
        """Each row's current entries keyed by (tier, variant), with their full index rows."""
        out = []
        for row in rows:
            start, count = int(self.ranges[row, 0]), int(self.ranges[row, 1])
            group = _slice(self.entry_batches, start, count) if count else []
            out.append({(e["tier"], Variant(e["variant"])): e for e in group})
        return out


def read_search_info(chunks_dir: Path) -> SearchInfo:
    return SearchInfo.model_validate(json.loads((chunks_dir / SEARCH).read_text()))
