"""`qvpic verify --repair`: the safe fixes, under the store's write lease (pipeline/lease.py), so no job
writes meanwhile. Nothing a live generation references is ever deleted.

  missing index parts   the lost rows are restored from the current generation's entry snapshot (the
                        entries it serves; their shards must exist), written in place of the lost parts
                        (PartLog.put_in_place_of), so the part check sees them replaced
  missing / torn / corrupt entries
                        their index rows are dropped (each affected part rewritten in place), so
                        `qvpic recompile` rebuilds exactly them; the shard files stay (a live generation
                        may still read the good entries in them) until the orphan sweep may take them
  orphan files          files in table dirs no reader reads, older than the grace period: deleted
  orphan shards         `Store.remove_orphans(grace)`, the sweep recompiles run (it keeps every shard an
                        index row or a live generation references)
Chunk-table parts are not restored (the snapshot keeps embeddings in float16 and no source): re-ingest.
"""

from __future__ import annotations

import uuid

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.catalog import ENTRIES
from pipeline.catalog_writer import ENTRY_COLUMNS
from pipeline.findings import Report
from pipeline.generations import current_generation, parts_checks
from pipeline.key_ranges import in_range, key_ranges, read_range
from pipeline.lease import StoreLease
from pipeline.part_log import part_stem
from pipeline.serving_blobs import abs_path
from pipeline.store import KEY_COLUMNS, Store
from schemas.store import INDEX_SCHEMA


def repair(store: Store, report: Report, grace_s: float) -> list[str]:
    """Apply the safe fixes for what `report` (from `verify`) found; returns what was done, in words."""
    done: list[str] = []
    with StoreLease(store.blobs, f"verify-repair-{uuid.uuid4().hex[:12]}"):
        evidence = report.evidence
        if evidence.lost_index_parts:
            restored = restore_index_rows(store)
            done.append(f"restored {restored} index rows of {evidence.lost_index_parts} lost part(s) from the "
                        "current generation")
        if evidence.bad_rows:
            dropped = drop_rows(store, evidence.bad_rows, evidence.missing_shards)
            done.append(f"dropped {dropped} index rows pointing at missing or corrupt entries "
                        f"({len(evidence.bad_rows)} part(s) rewritten): run `qvpic recompile --store {store.uri}` "
                        "to rebuild them")
        for rel in evidence.orphan_files:
            store.blobs.delete(rel)
        if evidence.orphan_files:
            done.append(f"deleted {len(evidence.orphan_files)} orphan file(s) in table dirs")
        if evidence.num_orphan_shards:
            done.append(f"deleted {store.remove_orphans(older_than_s=grace_s)} orphan shard(s) and temp file(s)")
    return done


def drop_rows(store: Store, bad_rows: dict[str, set[tuple[str, str]]], missing_shards: set[str]) -> int:
    """Rewrite each part in `bad_rows` without the rows naming a (shard, tensor key) in it."""
    dropped = 0
    for rel, bad in sorted(bad_rows.items()):
        names = pa.array(sorted(f"{s}\n{k}" for s, k in bad), pa.string())

        def keep(table: pa.Table, names=names) -> pa.Table:
            name = pc.binary_join_element_wise(table["shard_path"], table["tensor_key"], "\n")
            return table.filter(pc.invert(pc.is_in(name, value_set=names)))

        dropped += store.tables["index"].rewrite(rel, keep)
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
    with store.fs.open_input_file(abs_path(store, f"{record.entries_dir}/{ENTRIES}")) as f:
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
        rows = rows.select(list(ENTRY_COLUMNS)).append_column("created_at", stamp).cast(INDEX_SCHEMA)
    log = store.tables["index"]
    for name in lost[:-1]:
        log.put_in_place_of(part_stem(name), INDEX_SCHEMA.empty_table())
    log.put_in_place_of(part_stem(lost[-1]), rows if rows is not None else INDEX_SCHEMA.empty_table())
    return 0 if rows is None else rows.num_rows


def _keys(table: pa.Table) -> pa.Array:
    """One string per row naming its entry (KEY_COLUMNS; a null tier as "-")."""
    columns = [pc.fill_null(table[c], "-") if c == "tier" else table[c] for c in KEY_COLUMNS]
    joined = pc.binary_join_element_wise(*columns, "\n")
    return joined.combine_chunks() if isinstance(joined, pa.ChunkedArray) else joined
