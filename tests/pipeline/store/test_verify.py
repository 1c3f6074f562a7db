"""`qvpic verify [--repair] [--deep]` and the parts check serving runs at start-up: each kind of damage is
found (exit 1, named), --repair fixes what it says it does, and a clean store verifies clean (exit 0)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pytest

from jobs.verify import main as verify_main
from pipeline.ingest.stages import compile_in_process
from pipeline.store import Store, StoreError, parts_checks, publish_generation
from pipeline.store.parts import PartRecord, compare_parts
from schemas.store import StoreSpec
from serve.app import preflight
from serve.config import AppConfig
from tests.support.fixtures_s3 import s3_bucket, s3_server  # noqa: F401  (fixtures)
from tests.support.store_factory import corrupt_entry, serving_store  # noqa: F401  (pytest fixture)

OLD_NS = 1_000_000_000 * 1_000_000_000  # an mtime far in the past (2001), past any grace period


@pytest.fixture
def store_copy(serving_store, tmp_path) -> Path:
    """A private copy of the session's tiny-qwen store (published, every entry compiled) to damage."""
    root = tmp_path / "store"
    shutil.copytree(serving_store.uri, root, ignore=shutil.ignore_patterns("leases"))  # other tests' replicas
    return root


def run_verify(capsys, root: Path, *flags: str) -> tuple[int, dict]:
    code = verify_main(["--store", str(root), "--json", *flags])
    return code, json.loads(capsys.readouterr().out)


def problems(report: dict) -> dict[str, dict]:
    return {f["check"]: f for f in report["findings"] if f["severity"] == "problem"}


def rebuild_missing(store: Store, serving_store) -> None:
    """What `qvpic recompile` does for a store that lost entries, in-process: compile exactly what is
    lacking, then publish."""
    chunks = store.chunks().to_pylist()
    errors = compile_in_process(store, store.load_manifest_or_raise(), serving_store.vlm,
                                [(c["chunk_key"], c["text"], None) for c in chunks])
    assert not errors
    publish_generation(store, "tests-recompile")


def test_a_clean_store_verifies_clean_shallow_and_deep(store_copy, capsys):
    for flags in ((), ("--deep",)):
        code, report = run_verify(capsys, store_copy, "--grace-s", "0", *flags)
        assert code == 0 and report["ok"] and not problems(report), report
        assert report["counts"]["index_rows"] > 0 and report["counts"]["shards"] > 0


def test_a_deleted_index_part_is_found_refused_at_start_up_and_restored(store_copy, serving_store, capsys):
    store = Store.open(str(store_copy))
    before = store.index().sort_by("checksum").select(["chunk_key", "tier", "variant", "checksum"])
    lost = store.tables["index"].part_paths()[0]
    (store_copy / lost).unlink()

    code, report = run_verify(capsys, store_copy)
    assert code == 1 and lost.split("/")[1] in problems(report)["missing_part"]["examples"][0]
    with pytest.raises(StoreError, match=lost.split("/")[1]):  # serving start-up refuses, naming the part
        preflight(AppConfig(store={"uri": str(store_copy)}, model=serving_store.model))
    with pytest.raises(StoreError, match="not publishing"):  # and no job publishes the smaller store
        publish_generation(Store.open(str(store_copy)), "tests")

    code, report = run_verify(capsys, store_copy, "--repair")
    assert code == 0 and report["ok"], report
    assert any("restored" in line for line in report["repaired"])
    after = Store.open(str(store_copy)).index().sort_by("checksum").select(before.column_names)
    assert after.equals(before)  # every served entry is back, bit for bit
    preflight(AppConfig(store={"uri": str(store_copy)}, model=serving_store.model))  # starts again
    publish_generation(Store.open(str(store_copy)), "tests")


def test_a_deleted_chunk_part_is_restored_from_the_generation(store_copy, serving_store, capsys):
    store = Store.open(str(store_copy))
    before = store.chunks().sort_by("chunk_id")
    lost = store.tables["chunks"].part_paths()[0]
    (store_copy / lost).unlink()

    code, report = run_verify(capsys, store_copy)
    assert code == 1 and lost.split("/")[1] in problems(report)["missing_part"]["examples"][0]
    with pytest.raises(StoreError, match=lost.split("/")[1]):
        preflight(AppConfig(store={"uri": str(store_copy)}, model=serving_store.model))

    code, report = run_verify(capsys, store_copy, "--repair")
    assert code == 0, report
    after = Store.open(str(store_copy)).chunks().sort_by("chunk_id")
    exact = [c for c in before.column_names if c not in ("embedding", "source")]
    assert after.select(exact).equals(before.select(exact))
    as_served = np.array(before["embedding"].to_pylist(), np.float16).astype(np.float32)  # what search reads
    assert np.array_equal(np.array(after["embedding"].to_pylist(), np.float32), as_served)
    publish_generation(Store.open(str(store_copy)), "tests")


def test_a_deleted_shard_is_found_its_rows_dropped_and_a_recompile_makes_it_clean(store_copy, serving_store, capsys):
    store = Store.open(str(store_copy))
    shard = store.index()["shard_path"][0].as_py()
    (store_copy / shard).unlink()

    code, report = run_verify(capsys, store_copy)
    found = problems(report)
    assert code == 1 and found["missing_shard"]["examples"] == [shard]
    assert found["served_shard_missing"]["examples"] == [shard]

    code, report = run_verify(capsys, store_copy, "--repair")
    found = problems(report)
    assert code == 1 and "missing_shard" not in found  # rows dropped: what is left is for a recompile
    assert set(found) == {"missing_entries", "served_shard_missing"}, found
    assert shard not in set(Store.open(str(store_copy)).index()["shard_path"].to_pylist())

    rebuild_missing(Store.open(str(store_copy)), serving_store)
    code, report = run_verify(capsys, store_copy, "--deep")
    assert code == 0, report


def test_a_corrupt_byte_is_found_by_deep_verify_and_repaired(store_copy, serving_store, capsys):
    store = Store.open(str(store_copy))
    row = store.index().to_pylist()[0]
    corrupt_entry(store_copy, row)

    code, _ = run_verify(capsys, store_copy)
    assert code == 0  # a shallow verify reads no entry bytes: it cannot see this (by design)
    code, report = run_verify(capsys, store_copy, "--deep")
    found = problems(report)
    assert code == 1 and found["corrupt_entry"]["count"] == 1
    assert found["corrupt_entry"]["examples"] == [f"{row['shard_path']} {row['tensor_key']}"]

    code, report = run_verify(capsys, store_copy, "--deep", "--repair")
    assert set(problems(report)) == {"missing_entries"}, report  # the corrupt entry's row is gone
    rebuild_missing(Store.open(str(store_copy)), serving_store)
    code, report = run_verify(capsys, store_copy, "--deep")
    assert code == 0, report


def test_a_truncated_shard_is_found_without_reading_it_and_repaired(store_copy, capsys):
    store = Store.open(str(store_copy))
    rows = store.index().to_pylist()
    shard = max(rows, key=lambda r: r["byte_offset"] + r["nbytes"])["shard_path"]  # its last entry is cut
    path = store_copy / shard
    path.write_bytes(path.read_bytes()[:-1])
    torn = [r for r in rows if r["shard_path"] == shard and r["byte_offset"] + r["nbytes"] > path.stat().st_size]

    code, report = run_verify(capsys, store_copy)  # shallow: the listing's size tells
    found = problems(report)
    assert code == 1 and found["torn_entry"]["count"] == len(torn) == 1
    assert found["torn_entry"]["examples"] == [f"{shard} {torn[0]['tensor_key']}"]
    code, report = run_verify(capsys, store_copy, "--repair")
    assert set(problems(report)) == {"missing_entries"}, report


def test_orphans_are_found_past_the_grace_period_and_removed(store_copy, capsys):
    temp = store_copy / "index" / ".tmp-0123abcd"  # a crashed write's temp file
    stray = store_copy / "chunks" / "part-00000000000000000001-x.parquet.bak"  # no reader reads it
    shard = store_copy / "shards" / "ab" / f"{'ab' * 32}.safetensors"  # no index row, no generation
    for path in (temp, stray, shard):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"orphan")
        os.utime(path, ns=(OLD_NS, OLD_NS))
    fresh = store_copy / "index" / ".tmp-fresh"  # could be a job writing now: left alone
    fresh.write_bytes(b"in flight")

    code, report = run_verify(capsys, store_copy)
    found = problems(report)
    assert code == 1
    assert sorted(found["orphan_file"]["examples"]) == ["chunks/" + stray.name, "index/" + temp.name]
    assert found["orphan_shard"]["examples"] == [f"shards/ab/{shard.name}"]

    code, report = run_verify(capsys, store_copy, "--repair")
    assert code == 0, report
    assert not temp.exists() and not stray.exists() and not shard.exists() and fresh.exists()


def test_the_start_up_check_is_a_listing_and_verify_reads_the_parts(store_copy, serving_store, capsys):
    """The start-up check never opens a part (O(parts), not O(rows)): parts zeroed to the same size pass it;
    a verify, which reads them, names every one."""
    store = Store.open(str(store_copy))
    preflight(AppConfig(store={"uri": str(store_copy)}, model=serving_store.model))  # negative control: starts
    parts = store.tables["index"].part_paths() + store.tables["chunks"].part_paths()
    for rel in parts:
        path = store_copy / rel
        path.write_bytes(bytes(path.stat().st_size))
    checks = parts_checks(Store.open(str(store_copy)))
    assert all(c.ok and c.num_recorded == c.num_present > 0 for c in checks)
    preflight(AppConfig(store={"uri": str(store_copy)}, model=serving_store.model))
    code, report = run_verify(capsys, store_copy, "--deep")
    assert code == 1 and problems(report)["unreadable_part"]["count"] >= len(parts), report


# ---- which vanished parts a compaction explains ----------------------------------------------------
def _info(name: str) -> pafs.FileInfo:
    return pafs.FileInfo(f"/s/index/{name}", pafs.FileType.File, size=10)


def _part(stamp: int, suffix: str = "") -> str:
    return f"part-{stamp:020d}-tok{stamp}{suffix}.parquet"


def test_compacted_runs_explain_their_parts_and_nothing_else():
    recorded = [PartRecord(_part(i), 10, 1) for i in (1, 2, 3, 4, 5)]
    compacted = _part(3, f"-c{9:020d}-0000")  # parts 1..3 were merged into it (it takes 3's stem)
    check = compare_parts("index", 7, recorded, [_info(n) for n in (compacted, _part(4), _part(5))])
    assert check.ok and check.num_present == 3
    # part 4 deleted by hand: no replacement at or after it before a surviving part
    check = compare_parts("index", 7, recorded, [_info(n) for n in (compacted, _part(5))])
    assert [r.name for r in check.missing] == [_part(4)]
    # part 1 deleted with part 2 surviving: a later compaction of 3.. does not explain it
    later = _part(5, f"-c{9:020d}-0000")
    check = compare_parts("index", 7, recorded, [_info(n) for n in (_part(2), later)])
    assert [r.name for r in check.missing] == [_part(1)]
    # a part written since is unpublished, not a replacement
    check = compare_parts("index", 7, recorded, [_info(n) for n in [*(r.name for r in recorded), _part(6)]])
    assert check.ok and check.unpublished == (_part(6),)
    # a part that changed size
    check = compare_parts("index", 7, recorded, [pafs.FileInfo(f"/s/index/{r.name}", pafs.FileType.File, size=11)
                                                 for r in recorded])
    assert len(check.changed) == 5 and not check.ok


def test_verify_and_repair_on_s3(serving_store, s3_server, s3_bucket, capsys):
    """The same checks and restores on an object store (moto on loopback): listings, ranged reads, the
    generation's snapshot downloaded to restore chunk rows."""
    uri = f"s3://{s3_bucket}/store"
    for part in ("manifest.json", "index", "chunks", "shards"):
        pafs.copy_files(f"{serving_store.uri}/{part}", f"{s3_bucket}/store/{part}",
                        source_filesystem=pafs.LocalFileSystem(), destination_filesystem=s3_server.filesystem())
    store = Store.open(StoreSpec(uri=uri, endpoint_url=s3_server.endpoint_url))
    publish_generation(store, "s3")
    before = (store.index().num_rows, store.chunks().num_rows)
    flags = ["--store", uri, "--s3-endpoint", s3_server.endpoint_url, "--json"]
    assert verify_main(flags) == 0 and json.loads(capsys.readouterr().out)["ok"]  # negative control
    lost = [store.tables["index"].part_paths()[0], store.tables["chunks"].part_paths()[0]]
    for rel in lost:
        store.blobs.delete(rel)

    assert verify_main(flags) == 1
    examples = problems(json.loads(capsys.readouterr().out))["missing_part"]["examples"]
    assert sorted(e.split(" ")[0] for e in examples) == sorted(lost)
    assert verify_main([*flags, "--repair"]) == 0, capsys.readouterr().out
    capsys.readouterr()
    store = Store.open(StoreSpec(uri=uri, endpoint_url=s3_server.endpoint_url))
    assert (store.index().num_rows, store.chunks().num_rows) == before
