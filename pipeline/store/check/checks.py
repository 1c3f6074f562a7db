"""`qvpic verify`: is a store consistent — manifest ↔ serving generation ↔ table parts ↔ index rows ↔ shards?

The checks, cheapest first; each streams, so memory holds a record batch (or one key range of a join),
never a whole table:
  generation   the current generation's record, snapshot dirs and row counts (footers only)
  parts        every part the current generation was built from is still listed, unchanged
               (pipeline/store/parts.py: the check serving runs at start-up); --deep reads each footer
  orphans      files in table dirs no reader reads; shards no index row and no live generation references
  index rows   every row's shard exists and holds its byte range (one bulk listing of shards/);
               --deep reads every entry's bytes and verifies its checksum
  served       every shard a live generation's entries point at exists
  coverage     every chunk has the entries its manifest requires (chunks ⋈ index, one key range at a time)
What `--repair` may do about each finding is in pipeline/store/check/repairs.py.
"""

from __future__ import annotations

import time
from collections import defaultdict

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.store.catalog import CATALOG, ENTRIES, RowFile
from pipeline.store.check.findings import MAX_EXAMPLES, Check, Evidence, Report, Severity
from pipeline.store.check.key_ranges import key_ranges, read_range
from pipeline.store.gc import protected_shards
from pipeline.store.generations import current_generation_number, read_generation
from pipeline.store.part_log import PART_PREFIX, PART_SUFFIX
from pipeline.store.parts import parts_checks
from pipeline.store.seal import SealError, check_seal
from pipeline.store.shards import ShardCorruptError
from pipeline.store.slots import entry_slots
from pipeline.store.snapshots import is_complete
from pipeline.store.store import Store
from schemas.store import ORPHAN_GRACE_S, Manifest

TABLES = ("index", "chunks", "quarantine")
_READ_ROWS = 16_384
_SCAN = ["shard_path", "tensor_key", "byte_offset", "nbytes"]
_DEEP = [*_SCAN, "dtype", "shape", "checksum"]


def verify(store: Store, deep: bool = False, grace_s: float = ORPHAN_GRACE_S, hmac_key: bytes | None = None
           ) -> Report:
    """The store's findings; with `hmac_key`, the current generation's seal is checked too."""
    report = Report(store=store.uri, deep=deep)
    manifest = store.load_manifest_or_raise()
    check_generation(store, report)
    if hmac_key is not None:
        check_current_seal(store, report, hmac_key)
    check_parts(store, report, deep)
    check_table_dirs(store, report, grace_s)
    shards = {store.blobs.rel(i.path): i for i in store.blobs.list("shards", recursive=True)}
    report.counts["shards"] = len(shards)
    referenced = check_index_rows(store, report, shards, deep)
    served = protected_shards(store)
    gone = sorted(served - shards.keys())
    report.add(Check.SERVED_SHARD_MISSING, len(gone), "shards a live serving generation reads are gone: its requests "
               "rebuild those entries from source on the request path until a recompile publishes", gone,
               "none here: drops the index rows (missing_shard), then run `qvpic recompile`")
    check_coverage(store, manifest, report)
    cutoff_ns = time.time_ns() - int(grace_s * 1e9)
    orphans = sorted(rel for rel, info in shards.items()
                     if rel not in referenced and rel not in served and (info.mtime_ns or 0) <= cutoff_ns)
    report.evidence.num_orphan_shards = len(orphans)
    report.add(Check.ORPHAN_SHARD, len(orphans), f"shards older than {grace_s:g} s that no index row and no live "
               "generation references", orphans, "deleted (remove_orphans, the recompile's own sweep)")
    return report


def check_current_seal(store: Store, report: Report, key: bytes) -> None:
    number = current_generation_number(store)
    try:
        if number is None:
            raise SealError("no serving generation is published, so none is sealed")
        check_seal(store, read_generation(store, number), key)
        report.counts["sealed generation"] = number
    except (FileNotFoundError, ValueError) as e:  # SealError is a ValueError; an unreadable record too
        report.add(Check.SEAL, 1, str(e), repair="none: check the store, then `qvpic publish --hmac-key-file` "
                   "seals a new generation of what it holds now")


def check_generation(store: Store, report: Report) -> None:
    number = current_generation_number(store)
    if number is None:
        report.add(Check.GENERATION, 1, "no serving generation published yet (`qvpic publish` makes one): parts "
                   "cannot be checked against one", severity=Severity.NOTE)
        return
    try:
        record = read_generation(store, number)
    except (FileNotFoundError, ValueError) as e:
        report.add(Check.GENERATION, 1, f"serving/current.json names generation {number}, which is unreadable: {e}",
                   repair="none: `qvpic publish` publishes a new one")
        return
    report.counts["generation"] = number
    for rel, name, claimed in ((record.chunks_dir, CATALOG, record.num_chunks),
                               (record.entries_dir, ENTRIES, record.num_entries)):
        if not is_complete(store, rel):
            report.add(Check.GENERATION, 1, f"generation {number}'s snapshot dir {rel} is incomplete", [rel],
                       "none: `qvpic publish` publishes a new one")
            continue
        try:
            rows = RowFile(store.blobs.open_input(f"{rel}/{name}")).num_rows
        except (OSError, pa.ArrowException) as e:
            rows = f"unreadable ({e})"
        if rows != claimed:
            report.add(Check.GENERATION, 1, f"generation {number}'s {name} holds {rows} rows, its record says "
                       f"{claimed}", [f"{rel}/{name}"], "none: `qvpic publish` publishes a new one")


def check_parts(store: Store, report: Report, deep: bool) -> None:
    recorded: dict[str, int] = {}  # part -> rows the generation recorded
    for check in parts_checks(store):
        recorded.update({f"{check.table}/{r.name}": r.num_rows for r in check.recorded})
        report.counts[f"{check.table}_parts"] = check.num_present
        if check.generation is None and "generation" in report.counts:
            report.add(Check.GENERATION, 1, "parts unchecked: the current generation was published before "
                       "generations recorded their parts (`qvpic publish` records them)", severity=Severity.NOTE)
        missing = [f"{check.table}/{r.name} ({r.num_rows} rows)" for r in check.missing]
        restore = ("rows restored from the current generation's entries (those whose shard exists)"
                   if check.table == "index" else "rows restored from the current generation's chunk snapshot")
        report.add(Check.MISSING_PART, len(missing), f"{check.table} parts generation {check.generation} was built "
                   "from are gone (the next publish would silently serve less)", missing, restore)
        if check.table == "index":
            report.evidence.lost_index_parts = len(check.missing)
        else:
            report.evidence.lost_chunk_parts = len(check.missing)
        report.add(Check.CHANGED_PART, len(check.changed), f"{check.table} parts changed size since generation "
                   f"{check.generation} (parts are written once)",
                   [f"{check.table}/{r.name}" for r, _ in check.changed])
        if check.generation is not None:
            report.add(Check.UNPUBLISHED_PART, len(check.unpublished), f"{check.table} parts written after generation "
                       f"{check.generation}, not yet published", check.unpublished, severity=Severity.NOTE)
    if deep:
        bad = []
        for table in TABLES:
            for rel in store.tables[table].part_paths():
                try:
                    rows = store.tables[table].num_rows(rel)
                except FileNotFoundError:
                    continue  # compacted meanwhile
                except (OSError, pa.ArrowException) as e:
                    bad.append(f"{rel}: unreadable ({e})")
                    continue
                if rel in recorded and recorded[rel] != rows:
                    bad.append(f"{rel}: {rows} rows, recorded {recorded[rel]}")
        report.add(Check.UNREADABLE_PART, len(bad), "parts whose footer is unreadable or whose rows differ from "
                   "the generation's record", bad)


def check_table_dirs(store: Store, report: Report, grace_s: float) -> None:
    """Files in table dirs that no reader reads (temp files of crashed writes, strays), older than `grace_s`."""
    cutoff_ns = time.time_ns() - int(grace_s * 1e9)
    stray = []
    for table in TABLES:
        for info in store.blobs.list(table):
            is_part = info.base_name.startswith(PART_PREFIX) and info.base_name.endswith(PART_SUFFIX)
            if not is_part and (info.mtime_ns or 0) <= cutoff_ns:
                stray.append(store.blobs.rel(info.path))
    report.evidence.orphan_files = stray
    report.add(Check.ORPHAN_FILE, len(stray), f"files in table dirs that no reader reads, older than {grace_s:g} s",
               stray, "deleted")


def check_index_rows(store: Store, report: Report, shards: dict[str, pafs.FileInfo], deep: bool) -> set[str]:
    """Every index row (duplicates included) against the shard listing; with `deep`, its bytes against its
    checksum. Returns the shards the rows reference."""
    paths = pa.array(list(shards), pa.string())
    sizes = pa.array([i.size for i in shards.values()], pa.int64())
    referenced: set[str] = set()
    evidence: Evidence = report.evidence
    rows = missing = num_torn = num_corrupt = 0
    torn: list[str] = []  # examples, "shard tensor_key"
    corrupt: list[str] = []
    for rel in store.tables["index"].part_paths():
        try:
            with store.blobs.open_input(rel) as f:
                for batch in pq.ParquetFile(f).iter_batches(batch_size=_READ_ROWS, columns=_DEEP if deep else _SCAN):
                    rows += batch.num_rows
                    referenced.update(pc.unique(batch["shard_path"]).to_pylist())
                    where = pc.index_in(batch["shard_path"], value_set=paths)
                    absent = pc.is_null(where)
                    ends = pc.add(batch["byte_offset"], batch["nbytes"])
                    past_end = pc.fill_null(pc.greater(ends, pc.take(sizes, where)), False)
                    gone = batch.filter(absent)["shard_path"]
                    if len(gone):  # repair drops rows by shard: nothing per row to keep here
                        evidence.missing_shards.update(pc.unique(gone).to_pylist())
                        evidence.parts_with_missing_shards.add(rel)
                    missing += len(gone)
                    short = batch.filter(past_end)
                    pairs = set(zip(short["shard_path"].to_pylist(), short["tensor_key"].to_pylist()))
                    evidence.bad_rows.setdefault(rel, set()).update(pairs)
                    num_torn += len(pairs)
                    torn += [f"{s} {k}" for s, k in sorted(pairs)[:MAX_EXAMPLES - len(torn)]]
                    if deep:
                        failed = _verify_bytes(store, batch.filter(pc.invert(pc.or_(absent, past_end))))
                        evidence.bad_rows.setdefault(rel, set()).update(failed)
                        num_corrupt += len(failed)
                        corrupt += [f"{s} {k}" for s, k in sorted(failed)[:MAX_EXAMPLES - len(corrupt)]]
        except FileNotFoundError:
            continue  # compacted meanwhile: its rows are in a newer part, which the listing may have missed
        except (OSError, pa.ArrowException) as e:
            report.add(Check.UNREADABLE_PART, 1, f"index part unreadable: {e}", [rel])
    evidence.bad_rows = {rel: bad for rel, bad in evidence.bad_rows.items() if bad}
    report.counts["index_rows"] = rows
    drop = "index rows dropped (their parts rewritten), so `qvpic recompile` rebuilds them"
    report.add(Check.MISSING_SHARD, missing, f"index rows point at {len(evidence.missing_shards)} missing shard(s)",
               sorted(evidence.missing_shards), drop)
    report.add(Check.TORN_ENTRY, num_torn, "index rows whose byte range runs past their shard's end", torn, drop)
    report.add(Check.CORRUPT_ENTRY, num_corrupt, "entries whose bytes fail their checksum", corrupt, drop)
    return referenced


def _verify_bytes(store: Store, batch: pa.RecordBatch | pa.Table) -> set[tuple[str, str]]:
    """Read and checksum every entry of `batch` (each shard's entries with coalesced ranged reads);
    returns the (shard, tensor key) of those that fail."""
    by_shard: dict[str, list[dict]] = defaultdict(list)
    for row in batch.to_pylist():
        by_shard[row["shard_path"]].append(row)
    failures: set[tuple[str, str]] = set()
    for shard, rows in by_shard.items():
        try:
            store.shards.load_many(rows)
            continue
        except ShardCorruptError:
            pass
        for row in rows:  # isolate the failing entries
            try:
                store.shards.load_many([row])
            except ShardCorruptError:
                failures.add((shard, row["tensor_key"]))
    return failures


def check_coverage(store: Store, manifest: Manifest, report: Report) -> None:
    """Chunks lacking an entry their manifest requires: the chunk table joined with the index, one range of
    content keys at a time (pipeline/store/check/key_ranges.py)."""
    slots = entry_slots(manifest, manifest.variants)
    required = pa.array(sorted({f"{t or '-'}/{v.value}/{manifest.entry_fingerprint(v, t)}" for t, v in slots}))
    fingerprints = pa.array(sorted({manifest.entry_fingerprint(v, t) for t, v in slots}))
    try:
        lacking, examples = _lacking(store, required, fingerprints, report.counts.get("index_rows", 0))
    except (OSError, pa.ArrowException) as e:  # an unreadable part, reported by the part and row checks
        report.add(Check.MISSING_ENTRIES, 1, f"not checked: a part is unreadable ({e})", severity=Severity.NOTE)
        return
    report.add(Check.MISSING_ENTRIES, lacking, f"chunk texts lack some of the {len(required)} entries their manifest "
               "requires (`qvpic recompile` builds exactly those)", examples,
               "none here: run `qvpic recompile --store …`")


def _lacking(store: Store, required: pa.Array, fingerprints: pa.Array,
             num_index_rows: int) -> tuple[int, list[str]]:
    lacking, examples = 0, []
    for lo, hi in key_ranges(num_index_rows):
        chunk_keys = pc.unique(read_range(store, "chunks", ["chunk_key"], lo, hi)["chunk_key"])
        index = read_range(store, "index", ["chunk_key", "tier", "variant", "fingerprint"], lo, hi,
                           where=lambda b: pc.is_in(b["fingerprint"], value_set=fingerprints))  # stale rows: never held
        slot = pc.binary_join_element_wise(pc.fill_null(index["tier"], "-"), index["variant"], index["fingerprint"],
                                           "/")
        held = pa.table({"chunk_key": index["chunk_key"], "slot": slot}).filter(pc.is_in(slot, value_set=required))
        del index, slot
        counts = held.group_by("chunk_key").aggregate([("slot", "count_distinct")])
        complete = counts.filter(pc.equal(counts["slot_count_distinct"], len(required)))["chunk_key"]
        short = chunk_keys.filter(pc.invert(pc.is_in(chunk_keys, value_set=complete)))
        lacking += len(short)
        examples += short.to_pylist()[:5 - len(examples)]
    return lacking, examples
