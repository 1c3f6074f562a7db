"""Serving generations: what a job publishes, how a running router switches to it, and garbage
collection that never removes what a live service may still read (leases)."""

from __future__ import annotations

import asyncio
import shutil
import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from jobs.publish import main
from pipeline.ingest import RecompileConfig
from pipeline.ingest.recompile_job import target_manifest
from pipeline.ingest.stages import compile_in_process
from pipeline.store import Store, collect_generations, entry_slots, publish_generation, read_generation, remove_orphans
from pipeline.store.gc import live_generations, protected_shards
from pipeline.store.generations import current_generation
from pipeline.store.leases import write_lease
from schemas.api import AnswerRequest
from schemas.generation import LEASES_DIR, Generation, Lease, ReloadSpec
from schemas.render import RenderSpec, TierSpec
from schemas.store import StoreSpec
from serve.config import LoaderConfig, RouterConfig
from serve.kv import CacheLoader
from serve.plan import Plan
from serve.routing import Router
from serve.routing.retrieval import open_snapshot
from tests.support.fixtures_s3 import s3_bucket, s3_server  # noqa: F401  (fixtures)
from tests.support.store_factory import MAX_CHUNKS, ServingStore, loader_of, serving_store  # noqa: F401  (fixture)

QUERY = "When does part XK-4471-B ship?"
NEW_RENDER = RenderSpec(tiers=(TierSpec(name="low", dpi=72), TierSpec(name="high", dpi=100)))  # high tier changes
NO_POLL = ReloadSpec(enabled=False, retain_s=0.0)  # switches only on `router.reload()`; leaves at once


def copy_store(serving: ServingStore, root: Path) -> Path:
    shutil.copytree(serving.uri, root)
    shutil.rmtree(root / LEASES_DIR, ignore_errors=True)  # the copied replicas' leases are not ours
    return root


def recompile_in_process(root: Path, serving: ServingStore, render: RenderSpec) -> Generation:
    """pipeline/ingest/recompile_job.py's steps without Ray Data: compile what the new manifest lacks, publish the
    manifest and a generation, drop stale rows, collect orphan shards with no grace period."""
    store = Store.open(str(root))
    new, _ = target_manifest(store.load_manifest_or_raise(), RecompileConfig(store=store.spec, render=render))
    sources = [(r["chunk_key"], r["text"], r["image_path"]) for r in store.chunks().to_pylist()]
    assert not compile_in_process(store, new, serving.vlm, sources)  # only what the new manifest lacks
    store.write_manifest(new)
    generation = publish_generation(store, "recompile-test")
    store.compact(keep_fingerprints={new.entry_fingerprint(v, t) for t, v in entry_slots(new, new.variants)})
    remove_orphans(store, older_than_s=0.0)
    return generation


def plan(router: Router, **fields) -> Plan:
    fields = {"query": QUERY, "doc_ids": ["invoices", "manual"], "tau": 1.0, "max_high_res": 4, **fields}
    return asyncio.run(router.plan(AnswerRequest(**fields)))


def assert_one_generation(root: Path, planned: Plan) -> None:
    """Every entry of the plan is the one its generation's manifest serves for that slot."""
    manifest = read_generation(Store.open(str(root)), planned.generation).manifest
    for chunk in planned.chunks:
        for entry in (chunk.entry, chunk.fallback):
            if entry is not None:
                assert entry.cache_key.fingerprint == manifest.entry_fingerprint(entry.variant, entry.tier)


def test_publish_snapshots_what_the_store_serves(serving_store, tmp_path):
    root = copy_store(serving_store, tmp_path / "store")
    store = Store.open(str(root))
    first = current_generation(store)
    assert first.num_chunks == store.chunks().num_rows and first.num_entries == store.index().num_rows
    again = publish_generation(store, "rerun")
    assert again.generation == first.generation + 1
    assert (again.chunks_dir, again.entries_dir) == (first.chunks_dir, first.entries_dir)  # nothing rebuilt
    assert first.generation not in live_generations(store)  # nobody leases it: collected
    with pytest.raises(FileNotFoundError):
        read_generation(store, first.generation)


def test_router_switches_generations_and_every_plan_uses_one(serving_store, tmp_path):
    root = copy_store(serving_store, tmp_path / "store")
    router = Router(RouterConfig(store=str(root), model=serving_store.model, max_chunks=MAX_CHUNKS,
                                 reload=ReloadSpec(enabled=False)))
    loader = loader_of(str(root))
    before = router.generation
    plans: list[Plan] = []
    stop = threading.Event()

    def keep_planning() -> None:
        while not stop.is_set():
            plans.append(plan(router))

    workers = [threading.Thread(target=keep_planning) for _ in range(2)]
    for worker in workers:
        worker.start()
    try:
        published = recompile_in_process(root, serving_store, NEW_RENDER)
        assert router.reload() and router.generation == published.generation
        while sum(p.generation == published.generation for p in plans) < 3:
            threading.Event().wait(0.05)
    finally:
        stop.set()
        for worker in workers:
            worker.join()
    assert {p.generation for p in plans} == {before, published.generation}
    for planned in plans:
        assert_one_generation(root, planned)
        assert not loader.load(planned).unreadable  # the old generation's shards outlived the switch
    high = {p.generation: {c.vision_tokens for c in p.chunks if c.tier == "high"} for p in plans}
    assert high[before] != high[published.generation]  # the switch changed what is served
    router.close()
    loader.keeper.close()


@pytest.mark.parametrize("leased", [True, False])
def test_recompile_keeps_shards_a_live_router_serves(serving_store, tmp_path, leased):
    """`recompile --orphan-grace-s 0` under a live router: its generation's shards stay until it moves
    on. Without the lease (the negative control) they are deleted under it, as they used to be."""
    root = copy_store(serving_store, tmp_path / "store")
    router = Router(RouterConfig(store=str(root), model=serving_store.model, max_chunks=MAX_CHUNKS, reload=NO_POLL))
    # no LRU: every load reads the shards
    loader = CacheLoader(LoaderConfig(store=str(root), max_nbytes=0, reload=NO_POLL))
    old_plan = plan(router)
    old_shards = {c.entry.row.stored.shard_path for c in old_plan.chunks if c.tier == "high"}
    assert old_shards
    if not leased:
        router.close()  # a replica that serves without leasing
    recompile_in_process(root, serving_store, NEW_RENDER)
    still_there = {p for p in old_shards if (root / p).exists()}
    if not leased:
        assert not still_there and loader.load(old_plan).unreadable
        return
    assert still_there == old_shards and not loader.load(old_plan).unreadable
    assert old_shards <= protected_shards(Store.open(str(root)))
    assert router.reload()  # moves on; NO_POLL retains nothing, and the loader's touch lapses at once too
    router.keeper.renew()
    loader.keeper.renew()
    store = Store.open(str(root))
    collect_generations(store)
    remove_orphans(store, older_than_s=0.0)
    assert not {p for p in old_shards if (root / p).exists()}  # collected once nothing can read them
    router.close()


def test_expired_and_torn_leases_protect_nothing(serving_store, tmp_path):
    root = copy_store(serving_store, tmp_path / "store")
    store = Store.open(str(root))
    first = current_generation(store).generation
    now = datetime.now(timezone.utc)
    write_lease(store, Lease(holder="gone", generations=(first,), expires_at=now - timedelta(seconds=1)))
    write_lease(store, Lease(holder="alive", generations=(first,), expires_at=now + timedelta(minutes=5)))
    (root / LEASES_DIR / "torn.json").write_text('{"holder": "torn", "generations": [')
    second = publish_generation(store, "next").generation
    assert live_generations(store) == {first, second}  # the live lease keeps the first
    assert not (root / LEASES_DIR / "gone.json").exists()  # expired leases are removed
    (root / LEASES_DIR / "alive.json").unlink()
    collect_generations(store)
    assert live_generations(store) == {second}
    with pytest.raises(FileNotFoundError):
        read_generation(store, first)


def test_a_generation_this_router_cannot_serve_is_refused_and_the_old_one_kept(serving_store, tmp_path):
    root = copy_store(serving_store, tmp_path / "store")
    router = Router(RouterConfig(store=str(root), model=serving_store.model, max_chunks=MAX_CHUNKS, reload=NO_POLL))
    store = Store.open(str(root))
    manifest = store.load_manifest_or_raise()
    store.write_manifest(manifest.model_copy(update={"embedder": "another-embedder"}))
    refused = publish_generation(store, "other-embedder").generation
    before = router.generation
    assert not router.reload()
    assert router.generation == before and "another-embedder" in router.watcher.refused[refused]
    assert plan(router).generation == before
    router.close()


def test_a_generation_on_s3_is_published_cached_locally_and_texts_read_by_range(serving_store, s3_server,
                                                                                s3_bucket, tmp_path):
    local = Store.open(serving_store.uri)
    uri = f"s3://{s3_bucket}/store"
    for part in ("manifest.json", "index", "chunks", "shards"):
        pafs.copy_files(f"{serving_store.uri}/{part}", f"{s3_bucket}/store/{part}",
                        source_filesystem=pafs.LocalFileSystem(), destination_filesystem=s3_server.filesystem())
    store = Store.open(StoreSpec(uri=uri, endpoint_url=s3_server.endpoint_url))
    record = publish_generation(store, "s3")
    snapshot = open_snapshot(store, record.generation, cache_root=tmp_path / "cache")
    assert (tmp_path / "cache" / record.chunks_dir / "catalog.arrow").exists()
    assert not (tmp_path / "cache" / record.chunks_dir / "texts.arrow").exists()  # read by range instead
    rows, missing = snapshot.catalog.rows_of_docs(["manual", "ghost"])
    assert missing == ["ghost"]
    chunks = local.chunks_for(doc_ids=["manual"]).to_pylist()
    assert [t["text"] for t in snapshot.catalog.texts(rows)] == [c["text"] for c in chunks]
    assert [c["chunk_id"] for c in snapshot.catalog.chunk_rows(rows)] == [c["chunk_id"] for c in chunks]
    assert all(slots for slots in snapshot.catalog.entries_of(rows))
    assert main(["--store", uri, "--s3-endpoint", s3_server.endpoint_url]) == 0  # qvpic publish
    assert current_generation(store).generation == record.generation + 1


def test_a_serving_lease_is_dropped_once_and_an_unreachable_store_does_not_raise(tmp_path, monkeypatch, caplog):
    """An owner's `close` and its `__del__` both close the keeper: the lease file goes at the first and the store
    is not asked again; a store that cannot be reached at shutdown leaves the lease to lapse, with a warning."""
    from pipeline.store.leases import LeaseKeeper

    store = Store.open(str(tmp_path / "store"), create=True)
    keeper = LeaseKeeper(store, "router", NO_POLL)
    keeper.hold(7)
    lease_file = tmp_path / "store" / LEASES_DIR / f"{keeper.holder}.json"
    assert lease_file.exists()
    deletes: list[str] = []
    delete = store.blobs.delete
    monkeypatch.setattr(store.blobs, "delete", lambda rel: (deletes.append(rel), delete(rel)))
    keeper.close()
    keeper.close()
    assert not lease_file.exists() and deletes == [f"{LEASES_DIR}/{keeper.holder}.json"]

    unreachable = LeaseKeeper(store, "loader", NO_POLL)
    unreachable.hold(7)

    def refuse(rel: str) -> None:
        raise OSError("Could not connect to server")

    monkeypatch.setattr(store.blobs, "delete", refuse)
    with caplog.at_level("WARNING", logger="pipeline.store.leases"):
        unreachable.close()
    assert "could not drop lease" in caplog.text and "lapses after" in caplog.text
    assert not unreachable.heartbeat._thread.is_alive()
