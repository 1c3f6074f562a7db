"""Ingestion end to end on a local Ray: a mixed corpus in, every input accounted for, re-runs are no-ops,
a killed job resumes without duplicates, S3 works, and a renderer change recompiles what it must."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from PIL import Image, ImageDraw, ImageFont

from pipeline.ingest import CompileResources, IngestConfig, RecompileConfig, ingest, recompile, unchanged
from pipeline.runtime.render import resolve_font
from pipeline.store import (
    Store,
    StoreBusyError,
    current_generation_number,
    entry_slots,
    publish_generation,
    read_generation,
)
from schemas.render import RenderSpec
from schemas.store import StoreSpec
from tests.support.fixtures_s3 import S3Server, s3_bucket, s3_server  # noqa: F401  (pytest fixtures)
from tests.support.ray_fixtures import ray_session  # noqa: F401  (pytest fixture)

pytestmark = pytest.mark.e2e

GOOD = [
    ("atlas", "The Atlas pump ships with part XK-4471-B.\n\nIts warranty lasts 36 months from 12 March 2024."),
    ("boreal", "Boreal Logistics invoices are paid within 30 days. Invoice 88213 was paid by Marta Oyelaran."),
    ("cobalt", "Cobalt firmware 4.2.17 fixes the watchdog reset on boards built after week 19."),
    ("dune", "Dune Labs keeps the vault 7 access code, QX-5581-K, in the sealed envelope in room 114."),
]


def make_corpus(root: Path) -> dict[str, int]:
    """A corpus with good and bad inputs; returns the quarantine reasons it must produce."""
    root.mkdir(parents=True)
    # collections: dune's in its metadata, cobalt's as a top-level field (extras are metadata); the rest public
    extra = {"dune": {"metadata": {"collection": "acme"}}, "cobalt": {"collection": "globex"}}
    lines = [json.dumps({"doc_id": d, "text": t, **extra.get(d, {})}) for d, t in GOOD]
    lines += [
        json.dumps({"doc_id": "misfiled", "text": "x", "metadata": {"collection": "acme corp"}}),  # not a name
        json.dumps({"doc_id": "atlas-copy", "text": GOOD[0][1]}),  # same text as atlas: deduplicated
        json.dumps({"doc_id": "blank", "text": "   \n  "}),
        json.dumps({"text": "no id here"}),
        json.dumps({"doc_id": "boreal", "text": "second boreal"}),  # duplicate id within the file
        json.dumps({"doc_id": "number", "text": 42}),
        "{not json",
        json.dumps({"doc_id": "nul", "text": "binary\u0000garbage"}),
    ]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    (root / "notes").mkdir()
    (root / "notes" / "eel.md").write_text("# Eel valves\n\nEel valve EV-203 is rated for 16 bar at 90 °C.\n")
    (root / "longbench.jsonl").write_text(json.dumps({"_id": "lb-1", "context": "Fjord ferry 9 leaves at 06:45.",
                                                      "input": "When?", "answers": ["06:45"]}) + "\n")
    (root / "blob.bin").write_bytes(os.urandom(64))
    (root / "escape.txt").symlink_to("/etc/hostname")
    page = Image.new("RGB", (900, 260), "white")
    ImageDraw.Draw(page).text((20, 40), "Glacier order 5521 ships Friday.", fill="black",
                              font=ImageFont.truetype(str(resolve_font("DejaVuSans.ttf")), 40))
    page.save(root / "scan.png")
    return {"empty_text": 1, "missing_id": 1, "duplicate_id": 1, "non_string_text": 1, "malformed_record": 2,
            "control_characters": 1, "unsupported_file": 1, "path_outside_root": 1}


def assert_complete(store: Store) -> None:
    """Every chunk has every entry its manifest needs, each once, each loadable with a valid checksum."""
    manifest = store.load_manifest_or_raise()
    index = store.index()
    keys = list(zip(*(index[c].to_pylist() for c in ("chunk_key", "tier", "variant", "fingerprint"))))
    assert len(keys) == len(set(keys))
    have = set(keys)
    for chunk_key in set(store.chunks()["chunk_key"].to_pylist()):
        for tier, variant in entry_slots(manifest, manifest.variants):
            assert (chunk_key, tier, variant.value, manifest.entry_fingerprint(variant, tier)) in have
    store.load_many(index)  # raises ShardCorruptError on any missing or torn shard


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, dict[str, int]]:
    root = tmp_path_factory.mktemp("corpus") / "c"
    return root, make_corpus(root)


@pytest.fixture(scope="module")
def ingested(ray_session, corpus, tmp_path_factory):
    store_dir = tmp_path_factory.mktemp("store")
    cfg = IngestConfig(corpus=str(corpus[0]), store=StoreSpec(uri=str(store_dir)), chunk_tokens=64)
    return cfg, ingest(cfg)


def test_mixed_corpus_every_input_accounted_for(ingested, corpus):
    cfg, summary = ingested
    assert summary.balanced, summary.to_dict()
    assert summary.inputs == 17  # 12 JSONL records + 1 md + 1 LongBench + 1 binary + 1 link + 1 page image
    for reason, count in corpus[1].items():
        assert summary.quarantined.get(reason) == count, (reason, summary.quarantined)
    assert summary.deduplicated == 1 and summary.indexed == 7
    store = Store.open(cfg.store)
    assert store.quarantined(job_id=cfg.job_id).num_rows == summary.num_quarantined
    docs = set(store.chunks()["doc_id"].to_pylist())
    assert {"atlas", "atlas-copy", "boreal", "cobalt", "dune", "notes/eel.md", "lb-1", "scan.png"} <= docs
    assert_complete(store)
    scan = store.chunks_for(doc_ids=["scan.png"]).to_pylist()
    assert scan[0]["image_path"].endswith("scan.png") and "5521" in scan[0]["text"]
    # each chunk carries its document's collection from the metadata; no collection named: public
    collections = {r["doc_id"]: r["collection"] for r in store.chunks().to_pylist()}
    assert (collections["dune"], collections["cobalt"]) == ("acme", "globex")
    assert {collections[d] for d in docs - {"dune", "cobalt"}} == {"public"}
    assert "misfiled" in set(store.quarantined()["doc_id"].to_pylist())
    counts = read_generation(store, current_generation_number(store)).collections
    assert {name: c.num_documents for name, c in counts.items()} == {"acme": 1, "globex": 1, "public": 6}


def test_store_is_compacted_and_shards_are_packed(ingested):
    cfg, summary = ingested
    store_dir = Path(cfg.store.uri)
    assert [len(os.listdir(store_dir / d)) for d in ("index", "chunks", "quarantine")] == [1, 1, 1]
    shards = [f for _, _, files in os.walk(store_dir / "shards") for f in files]
    index = Store.open(cfg.store).index()
    assert 4 <= len(shards) <= index.num_rows // 2  # packed: one shard per compile batch and slot
    per_shard = index.group_by("shard_path").aggregate([("variant", "count_distinct"), ("tier", "count_distinct")])
    assert per_shard["variant_count_distinct"].to_pylist() == [1] * len(shards)  # a slot per shard: GC frees files
    assert not os.listdir(store_dir / "leases")  # released


def stage_actors() -> set[str]:
    """Ids of every actor Ray Data started for a model stage (render, embed, compile) in this session (from
    the GCS: the suite's Ray runs without the dashboard that `ray.util.state` asks)."""
    from ray._private.state import actors

    return {actor_id for actor_id, a in actors().items()
            if any(stage in a["ActorClassName"] for stage in ("RenderStage", "EmbedStage", "CompileStage"))}


def test_reingest_is_a_noop(ingested):
    cfg, first = ingested
    store_dir = Path(cfg.store.uri)
    parts = {d: sorted(os.listdir(store_dir / d)) for d in ("index", "chunks")}
    # unchanged corpus, settings and store: the recorded job's accounting, without running the pipeline
    skipped = ingest(IngestConfig(corpus=cfg.corpus, store=cfg.store, chunk_tokens=cfg.chunk_tokens))
    assert skipped.unchanged_since == first.job_id and skipped.balanced
    assert (skipped.inputs, skipped.indexed, skipped.num_chunks) == (first.inputs, first.indexed, first.num_chunks)
    # forced through the pipeline, content keys still find every chunk stored, and no model is loaded
    model_actors = stage_actors()
    assert model_actors, "the first ingest started its embed and compile actors: the control for the check below"
    again = ingest(IngestConfig(corpus=cfg.corpus, store=cfg.store, chunk_tokens=cfg.chunk_tokens, force=True))
    assert stage_actors() == model_actors  # no render, embed or compile actor started: nothing to do
    assert again.unchanged_since is None and again.balanced and again.num_chunks_compiled == 0
    assert again.num_chunks_embedded == 0 and again.num_chunks_published == 0  # nothing re-embedded or rewritten
    assert {d: sorted(os.listdir(store_dir / d)) for d in ("index", "chunks")} == parts


def test_only_new_and_changed_documents_cost_model_work(ray_session, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text("".join(json.dumps({"doc_id": d, "text": t}) + "\n" for d, t in GOOD))
    spec = StoreSpec(uri=str(tmp_path / "store"))
    first = ingest(IngestConfig(corpus=str(corpus), store=spec, chunk_tokens=64,
                                resources=CompileResources(batch_size=2)))
    assert first.num_chunks_compiled == first.num_chunks_embedded == first.num_chunk_texts == 4
    changed = [(d, t + " Revised." if d == "cobalt" else t) for d, t in GOOD]
    moved = {"dune": {"collection": "acme"}}  # same text, another collection: republished, nothing compiled
    (corpus / "a.jsonl").write_text("".join(json.dumps({"doc_id": d, "text": t, **moved.get(d, {})}) + "\n"
                                            for d, t in changed))
    (corpus / "b.jsonl").write_text(json.dumps({"doc_id": "eel", "text": "Eel valve EV-203 holds 16 bar."}) + "\n"
                                    + json.dumps({"doc_id": "atlas-again", "text": GOOD[0][1]}) + "\n")
    second = ingest(IngestConfig(corpus=str(corpus), store=spec, chunk_tokens=64))
    assert second.balanced and (second.indexed, second.deduplicated) == (5, 1)
    assert second.num_chunks_compiled == second.num_chunks_embedded == 2  # cobalt's new text and eel
    # cobalt (changed), dune (moved), eel, atlas-again (a stored text: not re-embedded)
    assert second.num_chunks_published == 4
    store = Store.open(spec)
    assert_complete(store)
    assert store.chunks_for(doc_ids=["dune"]).column("collection").to_pylist() == ["acme"]
    assert store.chunks_for(doc_ids=["cobalt"]).column("text").to_pylist()[0].endswith("Revised.")
    # the record of the last run decides a rerun: by content (a touched file is unchanged) ...
    os.utime(corpus / "b.jsonl", (0, 0))
    assert ingest(IngestConfig(corpus=str(corpus), store=spec, chunk_tokens=64)).unchanged_since == second.job_id
    # other settings make another run (asked of the decision itself: running that pipeline would prove no more)
    assert unchanged(IngestConfig(corpus=str(corpus), store=spec, chunk_tokens=32))[1] is None
    # ... by content: one character changed runs again, and the same bytes put back do not
    kept = (corpus / "b.jsonl").read_bytes()
    (corpus / "b.jsonl").write_text(json.dumps({"doc_id": "eel", "text": "Eel valve EV-204 holds 16 bar."}) + "\n")
    assert unchanged(IngestConfig(corpus=str(corpus), store=spec, chunk_tokens=64))[1] is None
    (corpus / "b.jsonl").write_bytes(kept)
    assert unchanged(IngestConfig(corpus=str(corpus), store=spec, chunk_tokens=64))[1] is not None
    # ... and only while the store serves what that run published (another job published since: run again;
    # such a run compiles nothing, as test_reingest_is_a_noop's forced one shows)
    publish_generation(store, "another-job")
    assert unchanged(IngestConfig(corpus=str(corpus), store=spec, chunk_tokens=64))[1] is None


def test_second_ingest_into_a_busy_store_refuses_naming_the_first(ray_session, corpus, tmp_path):
    spec = StoreSpec(uri=str(tmp_path / "store"))
    outcome: dict = {}

    def first() -> None:
        try:
            outcome["summary"] = ingest(IngestConfig(corpus=str(corpus[0]), store=spec, chunk_tokens=64,
                                                     job_id="ingest-first"))
        except BaseException as error:  # noqa: BLE001  re-raised on the test's thread
            outcome["error"] = error

    job = threading.Thread(target=first)
    job.start()
    deadline = time.monotonic() + 120
    while not (tmp_path / "store" / "leases" / "ingest-first.json").exists():
        assert job.is_alive() and time.monotonic() < deadline, outcome
        time.sleep(0.05)
    with pytest.raises(StoreBusyError, match="being written by job ingest-first"):
        ingest(IngestConfig(corpus=str(corpus[0]), store=spec, chunk_tokens=64, job_id="ingest-second"))
    job.join(timeout=600)
    if "error" in outcome:
        raise outcome["error"]
    assert outcome["summary"].balanced
    again = ingest(IngestConfig(corpus=str(corpus[0]), store=spec, chunk_tokens=64, job_id="ingest-second"))
    assert again.num_chunks_compiled == again.num_chunks_published == 0  # the first did it all, once
    raw = pq.read_table(tmp_path / "store" / "index", columns=["chunk_key", "tier", "variant", "fingerprint"])
    assert raw.num_rows == len({tuple(r.values()) for r in raw.to_pylist()})
    chunk_ids = pq.read_table(tmp_path / "store" / "chunks", columns=["chunk_id"])["chunk_id"].to_pylist()
    assert len(chunk_ids) == len(set(chunk_ids))


def test_recompile_after_renderer_change(ingested, tmp_path):
    cfg, _ = ingested
    store = Store.open(cfg.store)
    before = store.load_manifest_or_raise()
    num_texts = len(set(store.chunks()["chunk_key"].to_pylist()))
    summary = recompile(RecompileConfig(store=cfg.store, render=RenderSpec(font_size_pt=10.0), orphan_grace_s=0.0,
                                        images_root=cfg.corpus))  # scan.png is read again from the corpus
    after = Store.open(cfg.store).load_manifest_or_raise()
    assert after.render.font_size_pt == 10.0 and before.render.font_size_pt == 9.0
    assert summary.num_compiled == num_texts and summary.num_failed == 0
    image_slots = [s for s in entry_slots(before, before.variants) if s[0] is not None]
    assert summary.num_entries_dropped == num_texts * len(image_slots)  # text entries were kept, not rebuilt
    assert summary.num_orphans_removed > 0
    assert_complete(Store.open(cfg.store))


def test_killed_ingest_resumes_without_duplicates(ray_session, tmp_path):
    corpus = tmp_path / "big.jsonl"
    paragraphs = [f"Record {i}: batch {i * 7919 % 10007} passed inspection on day {i % 28 + 1}." for i in range(40)]
    corpus.write_text("".join(json.dumps({"doc_id": f"r{i}", "text": p}) + "\n" for i, p in enumerate(paragraphs)))
    store_dir = tmp_path / "store"
    proc = subprocess.Popen([sys.executable, "-m", "jobs.ingest", "--corpus", str(corpus), "--store", str(store_dir),
                             "--json"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 240
    while not (store_dir / "index").is_dir() or not os.listdir(store_dir / "index"):
        assert proc.poll() is None and time.monotonic() < deadline, "ingest ended before it could be killed"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and its private Ray, mid-compile
    proc.wait()
    settled, parts = time.monotonic(), os.listdir(store_dir / "index")
    while time.monotonic() - settled < 3:  # orphaned workers of the killed Ray wind down within seconds
        time.sleep(0.5)
        if (now := os.listdir(store_dir / "index")) != parts:
            settled, parts = time.monotonic(), now
    summary = ingest(IngestConfig(corpus=str(corpus), store=StoreSpec(uri=str(store_dir))))
    assert summary.balanced and summary.indexed == 40
    assert_complete(Store.open(str(store_dir)))
    # Nothing was compiled twice: the raw parts hold each key once (the store's dedupe would hide it).
    raw = pq.read_table(store_dir / "index", columns=["chunk_key", "tier", "variant", "fingerprint"]).to_pylist()
    manifest = Store.open(str(store_dir)).load_manifest_or_raise()
    assert len(raw) == len({tuple(r.values()) for r in raw}) == 40 * len(entry_slots(manifest, manifest.variants))


def test_ingest_into_s3(ray_session, corpus, s3_server: S3Server, s3_bucket: str):
    spec = StoreSpec(uri=f"s3://{s3_bucket}/stores/demo", endpoint_url=s3_server.endpoint_url)
    summary = ingest(IngestConfig(corpus=str(corpus[0] / "notes"), store=spec, chunk_tokens=64))
    assert summary.balanced and summary.indexed == 1
    assert_complete(Store.open(spec))
