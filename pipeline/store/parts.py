"""Which table parts a serving generation was built from, and the cheap check that they are all still there.

A table's part log is its directory listing (pipeline/store/part_log.py), so a part deleted by hand or by a
storage lifecycle rule leaves no trace in the listing itself: the next publish would silently serve
fewer entries. Each generation's snapshot dirs therefore record the parts they were built from
(`parts.json`: name, size, rows — the preimage of the dir's content digest). Comparing that record
with a fresh listing costs one listing per table and one small read, O(parts), never O(chunks).

Parts legitimately leave the listing only through compaction (and `qvpic verify --repair`), which writes
their replacement first, named with the stem of the newest part it replaces plus a `-c<ns>-<NNNN>`
suffix (`part_stem`). A recorded part that is gone is therefore *explained* when a part that is not in
the record and is compacted has a stem at or after it, with no surviving recorded part in between
(a compaction replaces a consecutive run of parts). Anything else is a missing part.

`parts_checks` runs that check against the current generation: `qvpic serve` and every publish refuse a
store that lost parts (`require_recorded_parts`), and `qvpic verify` reports them.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

from pipeline.store.blobs import StoreError
from pipeline.store.generations import current_generation
from pipeline.store.part_log import PartLog, is_compacted, part_stem
from pipeline.store.store import Store

PARTS = "parts.json"  # in a snapshot dir: the table parts it was built from


@dataclass(frozen=True)
class PartRecord:
    name: str
    size: int  # bytes
    num_rows: int


@dataclass(frozen=True)
class PartsCheck:
    """One table's parts against what the current generation recorded."""

    table: str
    generation: int | None  # None: no generation, or one published before parts were recorded
    num_recorded: int
    num_present: int
    missing: tuple[PartRecord, ...]  # recorded, gone, and no compaction replaced them
    changed: tuple[tuple[PartRecord, int], ...]  # (recorded, size now): parts are written once, never changed
    unpublished: tuple[str, ...]  # present, not recorded, not replacements: a later job's, not yet published
    recorded: tuple[PartRecord, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.missing and not self.changed


def write_parts_record(log: PartLog, parts: list[pafs.FileInfo], out: Path) -> None:
    """Record `parts` of `log` (with the row count from each footer: one small ranged read a part) in
    snapshot dir `out`."""
    records = [{"name": part.base_name, "size": part.size,
                "num_rows": log.num_rows(f"{log.directory}/{part.base_name}")}
               for part in parts]
    (out / PARTS).write_text(json.dumps({"parts": records}))


def read_parts_record(store: Store, snapshot_rel: str) -> list[PartRecord] | None:
    """The parts snapshot dir `snapshot_rel` was built from; None for a dir written before they were recorded."""
    payload = store.blobs.get_json(f"{snapshot_rel}/{PARTS}")
    return None if payload is None else [PartRecord(**p) for p in payload["parts"]]


def parts_checks(store: Store) -> list[PartsCheck]:
    """The index and chunk parts now listed against those the current generation was built from: one
    listing per table and two small reads. Unchecked (generation None) when no generation exists or it
    predates part records."""
    record = current_generation(store)
    checks = []
    for table, rel in (("index", record and record.entries_dir), ("chunks", record and record.chunks_dir)):
        recorded = read_parts_record(store, rel) if rel else None
        listed = store.tables[table].parts()
        checks.append(compare_parts(table, record.generation if recorded is not None else None, recorded, listed))
    return checks


def require_recorded_parts(store: Store, refusal: str) -> None:
    """Raise `StoreError` naming every missing or changed part (`parts_checks`), with `refusal` and the fix."""
    damaged = [check for check in parts_checks(store) if not check.ok]
    if damaged:  # list once more: a compaction during a listing (paginated on S3) can look like a loss
        damaged = [check for check in parts_checks(store) if not check.ok]
    if damaged:
        raise StoreError(f"store {store.uri}: {describe(damaged)}; {refusal}. Run `qvpic verify --store {store.uri} "
                         "--repair`: it restores lost index rows from the current generation")


def compare_parts(table: str, generation: int | None, recorded: list[PartRecord] | None,
                  present: list[pafs.FileInfo]) -> PartsCheck:
    """`present` (a listing) against `recorded`; see the module docstring for what counts as missing."""
    if recorded is None:
        return PartsCheck(table, None, 0, len(present), (), (), tuple(p.base_name for p in present))
    size_now = {p.base_name: p.size for p in present}
    recorded_names = {r.name for r in recorded}
    survivors = sorted(part_stem(r.name) for r in recorded if r.name in size_now)
    replacements = sorted(part_stem(n) for n in size_now if n not in recorded_names and is_compacted(n))
    missing = tuple(r for r in recorded if r.name not in size_now
                    and not _replaced(part_stem(r.name), survivors, replacements))
    changed = tuple((r, size_now[r.name]) for r in recorded if r.name in size_now and size_now[r.name] != r.size)
    unpublished = tuple(n for n in sorted(size_now) if n not in recorded_names and not is_compacted(n))
    return PartsCheck(table, generation, len(recorded), len(present), missing, changed, unpublished, tuple(recorded))


def _replaced(stem: str, survivors: list[str], replacements: list[str]) -> bool:
    """Whether a replacement with a stem ≥ `stem` exists with no surviving recorded part strictly after
    `stem` and at or before the replacement's stem (both lists sorted)."""
    i = bisect.bisect_left(replacements, stem)
    if i == len(replacements):
        return False
    j = bisect.bisect_right(survivors, stem)
    return j == len(survivors) or survivors[j] > replacements[i]


def describe(checks: list[PartsCheck], limit: int = 5) -> str:
    """One paragraph naming what is missing or changed, and what to run."""
    lines = []
    for check in checks:
        if check.missing:
            names = ", ".join(r.name for r in check.missing[:limit]) + (" …" if len(check.missing) > limit else "")
            rows = sum(r.num_rows for r in check.missing)
            lines.append(f"{len(check.missing)} {check.table} part(s) recorded by generation {check.generation} are "
                         f"missing ({rows} rows): {names}")
        if check.changed:
            names = ", ".join(f"{r.name} ({r.size} → {now} bytes)" for r, now in check.changed[:limit])
            lines.append(f"{len(check.changed)} {check.table} part(s) changed size since generation "
                         f"{check.generation}: {names}")
    return "; ".join(lines)
