"""Writes a generation's chunks dir and entries dir (layout: pipeline/store/catalog/reader.py) from the store's
table parts, streaming: memory holds one bucket of rows, whatever the store's size.

Both tables are append-only logs of Parquet parts in which the newest row per key wins. One pass
reads every part a record batch at a time and spills each row into one of a few bucket files by a
hash that orders the output (the document's hash for chunks, the content key's prefix for entries);
then each bucket is read back alone, deduplicated, sorted and appended to the snapshot files. The
catalog is therefore sorted by (document hash, document, order, chunk id): each document's chunks
are one contiguous range, as lookups need.

The parts come from the table's part log (`PartLog.parts`), listed once by the caller: the snapshot's
name is a digest of that same listing.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.store.blobs import StoreError
from pipeline.store.catalog.collections import write_collections
from pipeline.store.catalog.embedding_rows import EmbeddingRows
from pipeline.store.catalog.reader import (
    BATCH_ROWS,
    CATALOG,
    CATALOG_COLUMNS,
    CHUNK_IDS,
    DOC_IDS,
    EMBEDDINGS,
    ENTRIES,
    RANGES,
    SEARCH,
    TEXT_COLUMNS,
    TEXTS,
    id_hashes,
)
from pipeline.store.catalog.spill import ExactBatches, NpyRows, Spill, bucket_of, newest
from pipeline.store.catalog.vector_index import build_index
from pipeline.store.store import Store
from schemas.corpus import DEFAULT_COLLECTION
from schemas.generation import SearchInfo, SearchSpec
from schemas.modes import Variant
from schemas.tables import CHUNKS_SCHEMA, INDEX_SCHEMA, optional_names, with_optional

LAYOUT_VERSION = "2"  # part of every snapshot's name: a new layout never reuses an old snapshot
BUCKET_ROWS = 65_536  # rows per bucket, about: what a pass holds in memory at once
_MAX_BUCKETS = 512
_READ_ROWS = 16_384
ENTRY_COLUMNS = tuple(n for n in INDEX_SCHEMA.names if n != "created_at")


# ---- the store's parts ---------------------------------------------------------------------------
def parts_digest(parts: list[pafs.FileInfo], salt: str) -> str:
    """Identity of a table's content: parts are immutable and uniquely named, so equal lists of part
    names and sizes hold equal rows (a compaction renames them: the next publish rebuilds once)."""
    listing = "\n".join(f"{p.base_name} {p.size}" for p in parts)
    return hashlib.sha256(f"{LAYOUT_VERSION}\n{salt}\n{listing}".encode()).hexdigest()


def _read(store: Store, parts: list[pafs.FileInfo], schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    """Non-empty record batches of `schema`'s columns of every part, in write order."""
    for part in parts:
        with store.blobs.open_input(store.blobs.rel(part.path)) as f:
            try:
                parquet = pq.ParquetFile(f)
                present = set(parquet.schema_arrow.names)  # an optional column may postdate the part
                columns = [n for n in schema.names if n in present or n not in optional_names(schema)]
                for batch in parquet.iter_batches(batch_size=_READ_ROWS, columns=columns):
                    if batch.num_rows:
                        table = with_optional(pa.Table.from_batches([batch]), schema)
                        yield table.select(schema.names).cast(schema).combine_chunks().to_batches()[0]
            except (KeyError, pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
                raise StoreError(f"part {part.path} does not fit {schema.names}: {e}") from e


def _bucket_count(parts: list[pafs.FileInfo], store: Store, table: str) -> int:
    rows = sum(store.tables[table].num_rows(store.blobs.rel(part.path)) for part in parts)  # footers only
    return int(min(max(1, -(-rows // BUCKET_ROWS)), _MAX_BUCKETS))


# ---- chunks dir -----------------------------------------------------------------------------------
def write_chunks_dir(store: Store, parts: list[pafs.FileInfo], dim: int, spec: SearchSpec,
                     out: Path) -> tuple[SearchInfo, int, int, dict[str, dict]]:
    """Write the chunks dir of the chunk table held by `parts` into `out`; returns (search info, chunks,
    documents, {collection: its counts})."""
    read_schema = pa.schema([CHUNKS_SCHEMA.field(c) for c in ("chunk_id", "doc_id", "order", "chunk_key",
                                                               "num_text_tokens", "text", "image_path", "embedding",
                                                               "collection")])
    spilled = pa.schema([pa.field("doc_hash", pa.uint64()), pa.field("chunk_hash", pa.uint64()),
                         pa.field("seq", pa.int64()), *[CHUNKS_SCHEMA.field(c) for c in CATALOG_COLUMNS],
                         *[CHUNKS_SCHEMA.field(c) for c in TEXT_COLUMNS], pa.field("embedding", pa.binary(2 * dim)),
                         CHUNKS_SCHEMA.field("collection")])
    work = Path(tempfile.mkdtemp(prefix="spill-", dir=out))
    try:
        spill = Spill(work, _bucket_count(parts, store, "chunks"))
        owners: list[np.ndarray] = []  # per spilled row: 128-bit chunk id hash, doc hash, seq
        seq = 0
        for batch in _read(store, parts, read_schema):
            chunk_ids, doc_ids = batch["chunk_id"].to_pylist(), batch["doc_id"].to_pylist()
            doc_hash, chunk_hash = id_hashes(doc_ids), id_hashes(chunk_ids)
            seqs = np.arange(seq, seq + batch.num_rows)
            seq += batch.num_rows
            owners.append(np.stack([*_wide_hashes(chunk_ids).T, doc_hash, seqs.astype(np.uint64)], axis=1))
            spill.add(pa.RecordBatch.from_arrays(
                [pa.array(doc_hash), pa.array(chunk_hash), pa.array(seqs),
                 *[batch[c] for c in CATALOG_COLUMNS], *[batch[c] for c in TEXT_COLUMNS],
                 _float16_rows(batch["embedding"], dim), batch["collection"]], schema=spilled),
                bucket_of(doc_hash, spill.count))
        moved = _moved_chunk_rows(np.concatenate(owners) if owners else np.empty((0, 4), np.uint64))
        del owners
        catalog_schema = pa.schema([CHUNKS_SCHEMA.field(c) for c in CATALOG_COLUMNS])
        catalog = ExactBatches(out / CATALOG, catalog_schema, BATCH_ROWS[CATALOG])
        texts = ExactBatches(out / TEXTS, pa.schema([CHUNKS_SCHEMA.field(c) for c in TEXT_COLUMNS]), BATCH_ROWS[TEXTS])
        embeddings = NpyRows(out / EMBEDDINGS, np.float16, dim)
        chunk_lookup, doc_lookup, rows = [], [], 0
        names: dict[str, int] = {}  # collection -> its code, in order of first appearance
        codes: list[np.ndarray] = []
        for table in spill.tables():
            if len(moved):  # a chunk id republished under another document: only its newest row counts
                table = table.filter(pc.invert(pc.is_in(table["seq"], pa.array(moved))))
            table = newest(table, ["chunk_id"], ["seq"])
            if table.num_rows == 0:
                continue
            table = table.sort_by([("doc_hash", "ascending"), ("doc_id", "ascending"), ("order", "ascending"),
                                   ("chunk_id", "ascending")])
            catalog.append(table.select(list(CATALOG_COLUMNS)))
            texts.append(table.select(list(TEXT_COLUMNS)))
            embeddings.append(_fixed_rows(table["embedding"], dim))
            chunk_lookup.append(np.stack([table["chunk_hash"].to_numpy().view(np.int64),
                                          np.arange(rows, rows + table.num_rows)], 1))
            doc_lookup.append(_doc_ranges(table, rows))
            # a row of a part written before collections existed (null) is in the default collection
            collections = pc.fill_null(table["collection"], DEFAULT_COLLECTION).to_pylist()
            codes.append(np.array([names.setdefault(c, len(names)) for c in collections], np.int32))
            rows += table.num_rows
        catalog.close()
        texts.close()
        embeddings.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _save_lookup(out / CHUNK_IDS, chunk_lookup, [("hash", "<u8"), ("row", "<i8")])
    documents = _save_lookup(out / DOC_IDS, doc_lookup, [("hash", "<u8"), ("start", "<i8"), ("count", "<i8")])
    row_codes = np.concatenate(codes) if codes else np.empty(0, np.int32)
    doc_starts = np.concatenate([d[:, 1] for d in doc_lookup]) if doc_lookup else np.empty(0, np.int64)
    counts = write_collections(out, row_codes, list(names) or [DEFAULT_COLLECTION], row_codes[doc_starts])
    vectors = EmbeddingRows(path=out / EMBEDDINGS)
    try:
        info = build_index(vectors, spec, out)
    finally:
        vectors.close()
    (out / SEARCH).write_text(info.model_dump_json(indent=2))
    return info, rows, documents, counts


def _wide_hashes(ids: list[str]) -> np.ndarray:
    """[ids, 2] uint64: 128-bit blake2b of each id (collisions beyond any store's size)."""
    digests = b"".join(hashlib.blake2b(i.encode(), digest_size=16).digest() for i in ids)
    return np.frombuffer(digests, np.uint64).reshape(len(ids), 2)


def _moved_chunk_rows(owners: np.ndarray) -> np.ndarray:
    """Seqs of chunk rows superseded by a newer row of the same chunk id under another document (buckets
    are by document, so those are not deduplicated inside one): [rows, (hash hi, hash lo, doc hash, seq)]."""
    if not len(owners):
        return np.empty(0, np.int64)
    owners = owners[np.lexsort((owners[:, 3], owners[:, 1], owners[:, 0]))]  # by chunk id, then seq
    same_id = (owners[1:, 0] == owners[:-1, 0]) & (owners[1:, 1] == owners[:-1, 1])
    last_of_id = np.r_[~same_id, True]
    newest_doc = np.repeat(owners[last_of_id, 2], np.diff(np.r_[0, np.flatnonzero(last_of_id) + 1]))
    return owners[owners[:, 2] != newest_doc, 3].astype(np.int64)


def _float16_rows(embeddings: pa.ListArray | pa.ChunkedArray, dim: int) -> pa.Array:
    """list<float32> rows as fixed-width float16 bytes (what embeddings.npy stores)."""
    lengths = pc.list_value_length(embeddings).to_numpy(zero_copy_only=False)
    if len(lengths) and (lengths != dim).any():
        raise ValueError(f"chunk embeddings must have {dim} values, found {sorted(set(lengths.tolist()) - {dim})[:5]}")
    values = pc.list_flatten(embeddings).to_numpy(zero_copy_only=False).astype(np.float16)
    return pa.Array.from_buffers(pa.binary(dim * 2), len(lengths), [None, pa.py_buffer(values)])


def _fixed_rows(column: pa.ChunkedArray, dim: int) -> np.ndarray:
    """[rows, dim] float16 of a fixed-width binary column written by `_float16_rows`."""
    array = column.combine_chunks()
    data = np.frombuffer(array.buffers()[1], np.float16)
    return data[array.offset * dim:(array.offset + len(array)) * dim].reshape(len(array), dim)


def _doc_ranges(table: pa.Table, first_row: int) -> np.ndarray:
    """[(doc hash, start, count)] of the documents in a sorted bucket."""
    if table.num_rows == 0:
        return np.empty((0, 3), np.int64)
    doc_ids = table["doc_id"].to_numpy(zero_copy_only=False)
    starts = np.flatnonzero(np.r_[True, doc_ids[1:] != doc_ids[:-1]])
    hashes = table["doc_hash"].to_numpy()[starts]
    return np.stack([hashes.view(np.int64), starts + first_row, np.diff(np.r_[starts, table.num_rows])], 1)


def _save_lookup(path: Path, blocks: list[np.ndarray], fields: list[tuple[str, str]]) -> int:
    """Save [(hash, ...)] rows as a structured array sorted by its fields; returns its length."""
    stacked = np.concatenate(blocks) if blocks else np.empty((0, len(fields)), np.int64)
    lookup = np.empty(len(stacked), np.dtype(fields))
    for i, (name, _) in enumerate(fields):
        lookup[name] = stacked[:, i].view(np.uint64) if name == "hash" else stacked[:, i]
    np.save(path, np.sort(lookup, order=[name for name, _ in fields]))
    return len(lookup)


# ---- entries dir ----------------------------------------------------------------------------------
def write_entries_dir(store: Store, parts: list[pafs.FileInfo],
                      fingerprint_of: Callable[[str | None, Variant], str | None],
                      catalog: pa.ipc.RecordBatchFileReader, out: Path) -> int:
    """Write the entries dir into `out`: the index rows of `parts` whose fingerprint is the one
    `fingerprint_of(tier, variant)` names (None: slot not served), newest per key, sorted by
    (chunk_key, tier, variant), and each catalog row's range of them. Returns the number of entries."""
    schema = pa.schema([INDEX_SCHEMA.field(c) for c in (*ENTRY_COLUMNS, "created_at")])
    spilled = schema.append(pa.field("seq", pa.int64()))
    served: dict[tuple[str | None, str], str | None] = {}
    work = Path(tempfile.mkdtemp(prefix="spill-", dir=out))
    try:
        spill, seq = Spill(work, _bucket_count(parts, store, "index")), 0
        for batch in _read(store, parts, schema):
            slots = list(zip(batch["tier"].to_pylist(), batch["variant"].to_pylist()))
            for slot in set(slots) - set(served):
                served[slot] = fingerprint_of(slot[0], Variant(slot[1]))
            wanted = pa.array([served[s] for s in slots], pa.string())
            keep = pc.fill_null(pc.equal(batch["fingerprint"], wanted), False)
            kept = pa.RecordBatch.from_arrays([*batch.columns, pa.array(np.arange(seq, seq + batch.num_rows))],
                                              schema=spilled).filter(keep)
            seq += batch.num_rows
            prefixes = pc.utf8_slice_codeunits(kept["chunk_key"], 0, 8).to_pylist()
            hashes = np.array([int(p, 16) << 32 for p in prefixes], np.uint64)  # content keys are sha256 hex
            spill.add(kept, bucket_of(hashes, spill.count))
        entries = ExactBatches(out / ENTRIES, pa.schema([INDEX_SCHEMA.field(c) for c in ENTRY_COLUMNS]),
                               BATCH_ROWS[ENTRIES])
        keys, starts, counts, written = [], [], [], 0
        for table in spill.tables():
            table = newest(table, ["chunk_key", "tier", "variant", "fingerprint"], ["created_at", "seq"])
            table = table.sort_by([("chunk_key", "ascending"), ("tier", "ascending"), ("variant", "ascending")])
            entries.append(table.select(list(ENTRY_COLUMNS)))
            chunk_keys = table["chunk_key"].to_numpy(zero_copy_only=False).astype("S64")
            first = np.flatnonzero(np.r_[True, chunk_keys[1:] != chunk_keys[:-1]])
            keys.append(chunk_keys[first])
            starts.append(first + written)
            counts.append(np.diff(np.r_[first, len(chunk_keys)]))
            written += table.num_rows
        entries.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    none = np.empty(0, np.int64)
    _write_ranges(catalog, np.concatenate(keys) if keys else np.empty(0, "S64"),
                  np.concatenate(starts) if starts else none, np.concatenate(counts) if counts else none, out / RANGES)
    return written


def _write_ranges(catalog: pa.ipc.RecordBatchFileReader, keys: np.ndarray, starts: np.ndarray, counts: np.ndarray,
                  path: Path) -> None:
    """[catalog rows, 2] (start, count) of each catalog row's entries, the catalog streamed in order."""
    ranges = NpyRows(path, np.int64, 2)
    for i in range(catalog.num_record_batches):
        wanted = catalog.get_batch(i)["chunk_key"].to_numpy(zero_copy_only=False).astype("S64")
        at = np.minimum(np.searchsorted(keys, wanted), max(len(keys) - 1, 0))
        found = keys[at] == wanted if len(keys) else np.zeros(len(wanted), bool)
        block = np.zeros((len(wanted), 2), np.int64)
        block[found, 0], block[found, 1] = starts[at[found]], counts[at[found]]
        ranges.append(block)
    ranges.close()
