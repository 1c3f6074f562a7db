"""`qvpic verify --repair`: the safe fixes, under the store's write lease (pipeline/store/leases.py), so no job
writes meanwhile. Nothing a live generation references is ever deleted.

  missing index parts   the lost rows are restored from the current generation's entry snapshot (the
                        entries it serves; their shards must exist), written in place of the lost parts
                        (PartLog.put_in_place_of), so the part check sees them replaced
  missing / torn / corrupt entries
                        their index rows are dropped (each affected part rewritten in place), so
                        `qvpic recompile` rebuilds exactly them; the shard files stay (a live generation
                        may still read the good entries in them) until the orphan sweep may take them
  orphan files          files in table dirs no reader reads, older than the grace period: deleted
  orphan shards         `remove_orphans(store, grace)` (pipeline/store/gc.py), the sweep recompiles run (it
                        keeps every shard an index row or a live generation references)
  missing chunk parts    the lost chunk rows are restored from the current generation's catalog, texts
                        and embeddings: ids, text, page image path exactly; the embedding as the
                        float16 serving searches with (widened to float32); `source` names the restore
"""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.store.catalog import CATALOG, CATALOG_COLUMNS, EMBEDDINGS, ENTRIES, ENTRY_COLUMNS, TEXTS
from pipeline.store.check.findings import Report
from pipeline.store.check.key_ranges import in_range, key_ranges, read_range
from pipeline.store.gc import remove_orphans
from pipeline.store.generations import current_generation
from pipeline.store.leases import StoreLease
from pipeline.store.part_log import part_stem
from pipeline.store.parts import parts_checks
from pipeline.store.snapshots import local_copy
from pipeline.store.store import KEY_COLUMNS, Store
from schemas.tables import CHUNKS_SCHEMA, INDEX_SCHEMA, conform


def repair(store: Store, report: Report, grace_s: float) -> list[str]:
    """Apply the safe fixes for what `report` (from `verify`) found; returns what was done, in words."""
    done: list[str] = []
    with StoreLease(store.blobs, f"verify-repair-{uuid.uuid4().hex[:12]}"):
        evidence = report.evidence
        if evidence.lost_index_parts:
            restored = restore_index_rows(store)
            done.append(f"restored {restored} index rows of {evidence.lost_index_parts} lost part(s) from the "
                        "current generation")
        if evidence.lost_chunk_parts:
            restored = restore_chunk_rows(store)
            done.append(f"restored {restored} chunk rows of {evidence.lost_chunk_parts} lost part(s) from the "
                        "current generation")
        parts = set(evidence.bad_rows) | evidence.parts_with_missing_shards
        if parts:
            dropped = drop_rows(store, parts, evidence.bad_rows, evidence.missing_shards)
            done.append(f"dropped {dropped} index rows pointing at missing, torn or corrupt entries "
                        f"({len(parts)} part(s) rewritten): run `qvpic recompile --store {store.uri}` to rebuild them")
        for rel in evidence.orphan_files:
            store.blobs.delete(rel)
        if evidence.orphan_files:
            done.append(f"deleted {len(evidence.orphan_files)} orphan file(s) in table dirs")
        if evidence.num_orphan_shards:
            done.append(f"deleted {remove_orphans(store, older_than_s=grace_s)} orphan shard(s) and temp file(s)")
    return done


def drop_rows(store: Store, parts: set[str], bad_rows: dict[str, set[tuple[str, str]]],
              missing_shards: set[str]) -> int:
    """Rewrite each of `parts` without its rows that name a missing shard or a bad (shard, tensor key)."""
    gone = pa.array(sorted(missing_shards), pa.string())
    dropped = 0
    for rel in sorted(parts):
        names = pa.array(sorted(f"{s}\n{k}" for s, k in bad_rows.get(rel, ())), pa.string())

        def keep(table: pa.Table, names=names) -> pa.Table:
            name = pc.binary_join_element_wise(table["shard_path"], table["tensor_key"], "\n")
            bad = pc.or_(pc.is_in(name, value_set=names), pc.is_in(table["shard_path"], value_set=gone))
            return table.filter(pc.invert(bad))

        try:
            dropped += store.tables["index"].rewrite(rel, keep)
        except FileNotFoundError:  # compacted since the scan: its rows moved to a newer part a rerun finds
            continue
    return dropped


def restore_index_rows(store: Store) -> int:
    """Rows of the current generation's entries that the index lacks (by key) and whose shard exists,
    appended in place of the lost parts: the newest lost part's stem takes the rows, each older one an
    empty part, so every lost part reads as replaced. One range of content keys in memory at a time."""
    record = current_generation(store)
    lost = sorted(r.name for check in parts_checks(store) if check.table == "index" for r in check.missing)
    if record is None or not lost:
        return 0
    restored = []
    with store.blobs.open_input(f"{record.entries_dir}/{ENTRIES}") as f:
        reader = pa.ipc.open_file(f)
        for lo, hi in key_ranges(record.num_entries):  # one pass over the snapshot a range: memory holds one
            wanted = [b.filter(in_range(b["chunk_key"], lo, hi)) for b in map(reader.get_batch,
                                                                            range(reader.num_record_batches))]
            wanted = pa.Table.from_batches([b for b in wanted if b.num_rows], reader.schema)
            if not wanted.num_rows:
                continue
            present = _keys(read_range(store, "index", list(KEY_COLUMNS), lo, hi))
            absent = wanted.filter(pc.invert(pc.is_in(_keys(wanted), value_set=present)))
            if absent.num_rows:
                restored.append(absent)
    rows = pa.concat_tables(restored) if restored else None
    if rows is not None:
        shard_paths = pc.unique(rows["shard_path"]).to_pylist()
        existing = pa.array([p for p, ok in zip(shard_paths, store.blobs.exists(shard_paths)) if ok], pa.string())
        rows = rows.filter(pc.is_in(rows["shard_path"], value_set=existing))
        stamp = pa.array([record.published_at] * rows.num_rows, INDEX_SCHEMA.field("created_at").type)
        rows = conform(rows.select(list(ENTRY_COLUMNS)).append_column("created_at", stamp), INDEX_SCHEMA, "index")
    return _put_in_place(store, "index", lost, rows)


def restore_chunk_rows(store: Store) -> int:
    """Rows of the current generation's chunk snapshot whose chunk id the chunk table lacks, appended in
    place of the lost parts. Reads the snapshot a record batch at a time; holds the table's chunk ids."""
    record = current_generation(store)
    lost = sorted(r.name for check in parts_checks(store) if check.table == "chunks" for r in check.missing)
    if record is None or not lost:
        return 0
    present = pa.array(sorted(store.tables["chunks"].distinct("chunk_id")), pa.string())
    restored = []
    with tempfile.TemporaryDirectory(prefix="qvpic-repair-") as tmp, \
            store.blobs.open_input(f"{record.chunks_dir}/{TEXTS}") as texts_file:
        local = local_copy(store, record.chunks_dir, Path(tmp))  # itself for a local store
        catalog, texts = pa.ipc.open_file(local / CATALOG), pa.ipc.open_file(texts_file)
        embeddings = np.load(local / EMBEDDINGS, mmap_mode="r", allow_pickle=False)  # [rows, dim] float16
        rows_per = catalog.get_batch(0).num_rows if catalog.num_record_batches else 1
        text_rows = texts.get_batch(0).num_rows if texts.num_record_batches else 1
        for i in range(catalog.num_record_batches):
            batch = catalog.get_batch(i)
            lacking = pc.invert(pc.is_in(batch["chunk_id"], value_set=present))
            if not pc.any(lacking).as_py():
                continue
            start, n = i * rows_per, batch.num_rows
            text = pa.Table.from_batches([texts.get_batch(j) for j in range(start // text_rows,
                                                                            (start + n - 1) // text_rows + 1)])
            text = text.slice(start % text_rows, n)
            vectors = np.asarray(embeddings[start:start + n], dtype=np.float32)
            table = pa.table({**{c: batch[c] for c in CATALOG_COLUMNS}, "text": text["text"],
                              "image_path": text["image_path"],
                              "embedding": pa.FixedSizeListArray.from_arrays(vectors.reshape(-1), vectors.shape[1])
                              .cast(pa.list_(pa.float32())),
                              "source": pa.array([f"restored from generation {record.generation}"] * n)})
            restored.append(table.filter(lacking))
    rows = conform(pa.concat_tables(restored), CHUNKS_SCHEMA, "chunks") if restored else None
    return _put_in_place(store, "chunks", lost, rows)


def _put_in_place(store: Store, table: str, lost: list[str], rows: pa.Table | None) -> int:
    """`rows` in place of the newest lost part, an empty part in place of each older one: every lost part
    then reads as replaced (pipeline/store/parts.py)."""
    log = store.tables[table]
    for name in lost[:-1]:
        log.put_in_place_of(part_stem(name), log.schema.empty_table())
    log.put_in_place_of(part_stem(lost[-1]), rows if rows is not None else log.schema.empty_table())
    return 0 if rows is None else rows.num_rows


def _keys(table: pa.Table) -> pa.Array:
    """One string per row naming its entry (KEY_COLUMNS; a null tier as "-")."""
    columns = [pc.fill_null(table[c], "-") if c == "tier" else table[c] for c in KEY_COLUMNS]
    joined = pc.binary_join_element_wise(*columns, "\n")
    return joined.combine_chunks() if isinstance(joined, pa.ChunkedArray) else joined
