"""The append-only Parquet part log under the store's tables: newest row per key, compaction into few
large parts that never hides a row from a reader, and a compaction killed midway leaving a readable table."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from pipeline.store import Blobs
from pipeline.store.part_log import PartLog
from schemas.store import StoreSpec

SCHEMA = pa.schema([("key", pa.string()), ("value", pa.int64())])


def log(tmp_path: Path) -> PartLog:
    return PartLog(Blobs.open(StoreSpec(uri=str(tmp_path)), create=True), "t", SCHEMA, ["key"])


def rows(log_: PartLog) -> dict[str, int]:
    return dict(zip(*(log_.current()[c].to_pylist() for c in ("key", "value"))))


def append(log_: PartLog, items: dict[str, int]) -> None:
    log_.append(pa.table({"key": list(items), "value": list(items.values())}, schema=SCHEMA))


def test_newest_part_wins_and_compaction_keeps_every_row(tmp_path):
    table = log(tmp_path)
    for i in range(30):
        append(table, {f"k{j}": i for j in range(i, i + 5)})  # each part overwrites four keys of the last
    expected = rows(table)
    assert expected["k0"] == 0 and expected["k33"] == 29 and expected["k30"] == 29
    assert table.compact(target_rows=40) == 30
    assert rows(log(tmp_path)) == expected
    assert len(table.part_paths()) <= 4  # 150 rows in parts of ≤ 40, deduped within each run


def test_a_run_never_jumps_over_a_large_part(tmp_path):
    """Merging the small parts on either side of a large one would move old rows after newer ones."""
    table = log(tmp_path)
    append(table, {"a": 1})
    append(table, {f"big{i}": i for i in range(10)} | {"a": 2})  # large: stays
    append(table, {"b": 3})
    append(table, {"c": 4})
    table.compact(target_rows=10)
    assert rows(log(tmp_path))["a"] == 2 and len(table.part_paths()) == 3


def test_full_compaction_dedupes_across_parts_in_key_ranges(tmp_path):
    table = log(tmp_path)
    for i in range(8):
        append(table, {f"k{j:03d}": i for j in range(0, 100, i + 1)})
    expected = rows(table)
    assert table.compact(full=True, keep=lambda t: t.filter(pa.compute.not_equal(t["key"], "k000")),
                         target_rows=30) == 8
    del expected["k000"]
    assert rows(log(tmp_path)) == expected
    parts = [log(tmp_path)._read_part(p) for p in table.part_paths()]
    assert sum(p.num_rows for p in parts) == len(expected)  # no duplicate left anywhere
    assert len(parts) == -(-100 // 30)  # ranges of 30 distinct keys: k000 filtered out of the first


def test_killed_compaction_leaves_a_readable_table(tmp_path, monkeypatch):
    table = log(tmp_path)
    for i in range(6):
        append(table, {f"k{i}": i, "shared": i})
    expected = rows(table)

    def killed(rel: str) -> None:
        raise KeyboardInterrupt("killed after writing the compacted parts")

    monkeypatch.setattr(table.blobs, "delete", killed)
    with pytest.raises(KeyboardInterrupt):
        table.compact()
    monkeypatch.undo()
    reader = log(tmp_path)
    assert len(reader.part_paths()) == 7 and rows(reader) == expected  # old and new parts: duplicates, deduped
    table.compact()
    assert rows(log(tmp_path)) == expected and len(table.part_paths()) == 1


def test_reader_relists_when_a_part_is_compacted_away_under_it(tmp_path, monkeypatch):
    table = log(tmp_path)
    for i in range(4):
        append(table, {f"k{i}": i})
    expected = rows(table)
    reader = log(tmp_path)
    original_get, compacted = reader.blobs.get, []

    def get_during_compaction(rel: str) -> bytes:
        if not compacted:  # a compaction finishes between the reader's listing and its first read
            compacted.append(table.compact())
        return original_get(rel)

    monkeypatch.setattr(reader.blobs, "get", get_during_compaction)
    assert rows(reader) == expected and compacted == [4]
