"""Store contracts (fingerprints, cache keys, manifest) and the store itself on a local dir and on S3."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from pipeline.store import ShardCorruptError, Store, StoreError, remove_orphans, shards
from schemas.config import DType, ModelFamily
from schemas.modes import ChunkKind, Variant
from schemas.render import RenderSpec, TierSpec
from schemas.store import (
    SCHEMA_VERSION,
    CacheKey,
    CacheKeyError,
    Manifest,
    ManifestError,
    StoredModel,
    entry_fingerprint,
    model_fingerprint,
)
from schemas.tables import INDEX_SCHEMA, RowsError, conform
from tests.support.fixtures_s3 import s3_bucket, s3_server  # noqa: F401  (pytest fixtures)

MODEL = StoredModel(id="tiny-qwen", revision="local", dtype=DType.BFLOAT16, family=ModelFamily.QWEN2_5_VL)
PREFIX = "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n"
NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def make_manifest(**overrides) -> Manifest:
    fields = dict(render=RenderSpec(), variants=(Variant.TEMPLATE, Variant.TEXT), embedder="minilm", embedding_dim=4,
                  created_at=NOW, updated_at=NOW, job_ids=("job-1",))
    return Manifest.create(MODEL, PREFIX, **{**fields, **overrides})


def index_row(store: Store, tensor: torch.Tensor, text: str, tier: str | None, **overrides) -> dict:
    """Write `tensor` as its own shard and return the index row that points at it."""
    variant = Variant.TEXT if tier is None else Variant.TEMPLATE
    (entry,) = store.write_shard({"kv": tensor})
    fingerprint = make_manifest().entry_fingerprint(variant, tier)
    row = dict(chunk_key=sha(text), tier=tier, variant=variant, fingerprint=fingerprint,
               kind=ChunkKind.TEXT if tier is None else ChunkKind.IMAGE, num_tokens=tensor.shape[3], position_span=3,
               compile_start=17, grid_thw=[] if tier is None else [[1, 2, 4]],
               image_sizes_px=[] if tier is None else [[56, 112]], vision_tokens=0 if tier is None else 8,
               **entry.index_fields())
    return {**row, **overrides}


def kv(seed: int, dtype: torch.dtype = torch.bfloat16, num_tokens: int = 5) -> torch.Tensor:
    # [layers, 2, kv_heads, tokens, head_dim]
    return torch.randn(2, 2, 2, num_tokens, 8, generator=torch.Generator().manual_seed(seed)).to(dtype)


def flip_byte(store: Store, rel: str, offset: int) -> None:
    data = bytearray(store.blobs.get(rel))
    data[offset] ^= 0xFF
    store.blobs.put(rel, bytes(data))


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path: Path) -> Store:
    if request.param == "local":
        return Store.open(str(tmp_path / "store"), create=True)
    server = request.getfixturevalue("s3_server")
    bucket = server.new_bucket()
    return Store.open(f"s3://{bucket}/stores/a", filesystem=server.filesystem(), create=True)


# ---- contracts ---------------------------------------------------------------------------------
def test_cache_key_round_trip_seeded() -> None:
    rng = random.Random(0)
    for _ in range(300):
        variant = rng.choice(list(Variant))
        tier = None if variant.kind is ChunkKind.TEXT else rng.choice(["low", "high", "t", "x_1" * 10])
        key = CacheKey(f"{rng.getrandbits(256):064x}", tier, variant, f"{rng.getrandbits(256):064x}")
        assert CacheKey.parse(key.to_str()) == key
        assert len({key, CacheKey.parse(key.to_str())}) == 1


GOOD = CacheKey(sha("a"), "low", Variant.TEMPLATE, sha("fp")).to_str()


@pytest.mark.parametrize("text", [
    "", "kv1", GOOD + "/", "/" + GOOD, GOOD + "\n", GOOD.upper(), GOOD.replace("kv1", "kv2", 1),
    GOOD.replace("/low/", "/Low/"), GOOD.replace("/low/", "/../"), GOOD.replace("/low/", "/-/"),
    GOOD.replace("/low/", "//"), GOOD.replace("/template/", "/text/"), GOOD.replace("/template/", "/TEMPLATE/"),
    GOOD.replace("/template/", "/bogus/"), GOOD[:-1], GOOD + "0", GOOD.replace(sha("a"), "٠" * 64),
    GOOD.replace("low", "l" * 40), GOOD + "x" * 300, None, b"kv1", 123,
])
def test_cache_key_rejects_hostile_strings(text) -> None:
    with pytest.raises(CacheKeyError):
        CacheKey.parse(text)


def test_cache_key_fields_are_validated() -> None:
    for text_variant in (Variant.TEXT, Variant.TEXT_PLAIN):
        with pytest.raises(CacheKeyError, match="text variant .* has no tier"):
            CacheKey(sha("a"), "low", text_variant, sha("b"))
    with pytest.raises(CacheKeyError, match="needs a tier"):
        CacheKey(sha("a"), None, Variant.PLAIN, sha("b"))
    with pytest.raises(CacheKeyError, match="Variant"):
        CacheKey(sha("a"), "low", "template", sha("b"))  # type: ignore[arg-type]
    assert issubclass(CacheKeyError, ValueError)


def test_fingerprints_are_stable_across_processes() -> None:
    code = ("from schemas.store import *; from schemas.config import *; "
            f"m = model_fingerprint('m', 'r', DType.BFLOAT16, {PREFIX!r}); "
            "print(m, entry_fingerprint(m, Variant.TEMPLATE, RenderSpec(), TierSpec(name='low', dpi=72)))")
    outputs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}).stdout.split() for seed in ("1", "2")]
    model_fp = model_fingerprint("m", "r", DType.BFLOAT16, PREFIX)
    here = [model_fp, entry_fingerprint(model_fp, Variant.TEMPLATE, RenderSpec(), TierSpec(name="low", dpi=72))]
    assert outputs == [here, here]


def test_entry_slots_cover_every_variant() -> None:
    """What ingest and recompile build per chunk: templated pages at every tier, the baselines' pages at the
    lowest, each text variant once."""
    from pipeline.store import entry_slots

    manifest = make_manifest(render=RenderSpec(tiers=(TierSpec(name="high", dpi=120), TierSpec(name="low", dpi=72))))
    assert entry_slots(manifest, tuple(Variant)) == [
        ("high", Variant.TEMPLATE), ("low", Variant.TEMPLATE), ("low", Variant.PLAIN), ("low", Variant.DUMMY),
        (None, Variant.TEXT), (None, Variant.TEXT_PLAIN)]


def test_entry_fingerprint_depends_on_exactly_what_changes_the_kv() -> None:
    model_fp = model_fingerprint("m", "r", DType.BFLOAT16, PREFIX)
    low, render = TierSpec(name="low", dpi=72), RenderSpec()
    base = entry_fingerprint(model_fp, Variant.TEMPLATE, render, low)
    same = [entry_fingerprint(model_fp, Variant.TEMPLATE, RenderSpec(tiers=(low,)), low),
            entry_fingerprint(model_fp, Variant.TEMPLATE, render, TierSpec(name="small", dpi=72))]
    differ = [entry_fingerprint(model_fp, Variant.TEMPLATE, render, TierSpec(name="low", dpi=73)),
              entry_fingerprint(model_fp, Variant.TEMPLATE, RenderSpec(font_size_pt=10), low),
              entry_fingerprint(model_fp, Variant.PLAIN, render, low),
              entry_fingerprint(model_fp, Variant.DUMMY, render, low),
              entry_fingerprint(model_fingerprint("m", "r", DType.FLOAT32, PREFIX), Variant.TEMPLATE, render, low)]
    assert same == [base, base] and base not in differ and len(set(differ)) == len(differ)
    text_fp = entry_fingerprint(model_fp, Variant.TEXT, None, None)
    assert entry_fingerprint(model_fp, Variant.TEXT, RenderSpec(font_size_pt=12), low) == text_fp
    plain_text_fp = entry_fingerprint(model_fp, Variant.TEXT_PLAIN, None, None)
    assert plain_text_fp != text_fp == entry_fingerprint(model_fp, Variant.TEXT, render, low)
    every_variant = {entry_fingerprint(model_fp, v, render, low) for v in Variant}
    assert len(every_variant) == len(Variant)  # each variant has a fingerprint of its own
    with pytest.raises(ValueError, match="needs a RenderSpec"):
        entry_fingerprint(model_fp, Variant.TEMPLATE, None, low)
    variations = [("m", "r", DType.BFLOAT16, PREFIX), ("m2", "r", DType.BFLOAT16, PREFIX),
                  ("m", "r2", DType.BFLOAT16, PREFIX), ("m", "r", DType.BFLOAT16, PREFIX + " ")]
    assert len({model_fingerprint(*args) for args in variations}) == 4


def test_manifest_round_trip_and_integrity() -> None:
    manifest = make_manifest()
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert manifest.tiers == RenderSpec().tiers
    with pytest.raises(ManifestError, match="does not match"):
        Manifest.from_json(manifest.to_json().replace("You are helpful", "You are evil"))
    with pytest.raises(ManifestError, match="schema version 99 is not supported"):
        Manifest.from_json(manifest.to_json().replace(f'"schema_version": {SCHEMA_VERSION}', '"schema_version": 99'))
    manifest.check_model(MODEL.id, MODEL.revision, MODEL.dtype, PREFIX)
    with pytest.raises(ManifestError, match="refusing to serve"):
        manifest.check_model(MODEL.id, MODEL.revision, DType.FLOAT32, PREFIX)
    with pytest.raises(KeyError):
        manifest.entry_fingerprint(Variant.TEMPLATE, "ultra")


def test_conform_rejects_missing_extra_and_null_columns() -> None:
    row = {name: None for name in INDEX_SCHEMA.names}
    with pytest.raises(RowsError, match="missing \\['tier'\\]"):
        conform([{k: v for k, v in row.items() if k != "tier"}], INDEX_SCHEMA, "index")
    with pytest.raises(RowsError, match="unexpected \\['bogus'\\]"):
        conform([{**row, "bogus": 1}], INDEX_SCHEMA, "index")
    with pytest.raises(RowsError, match="must not contain nulls"):
        conform([row], INDEX_SCHEMA, "index")
    with pytest.raises(RowsError, match="do not fit"):
        conform([{**row, "num_tokens": "many"}], INDEX_SCHEMA, "index")


# ---- the store, on a local directory and on S3 ---------------------------------------------------
def test_kv_round_trip_is_exact(store: Store) -> None:
    tensors = {"bf16": kv(1), "fp32": kv(2, torch.float32), "fp16": kv(3, torch.float16)}
    batch = torch.stack([kv(4), kv(5)])  # views of one batched KV share storage, as a compile stage makes them
    tensors.update(first=batch[0], second=batch[1], tokens=kv(6, num_tokens=12)[:, :, :, 3:9])
    entries = store.write_shard(tensors)
    assert len({e.shard_path for e in entries}) == 1 and [e.tensor_key for e in entries] == list(tensors)
    assert [e.dtype for e in entries] == [DType.BFLOAT16, DType.FLOAT32, DType.FLOAT16] + [DType.BFLOAT16] * 3
    assert store.write_shard(tensors) == entries  # content-named: a rewrite is idempotent
    rows = [e.index_fields() for e in entries]
    loaded = store.load_many(list(reversed(rows)))
    for key, tensor in zip(reversed(list(tensors)), loaded):
        assert tensor.dtype == tensors[key].dtype and torch.equal(tensor, tensors[key]), key
    assert torch.equal(store.load_kv(rows[0]), tensors["bf16"])


def test_manifest_round_trip_and_open(store: Store) -> None:
    assert store.read_manifest() is None
    with pytest.raises(StoreError, match="has no manifest.json"):
        store.load_manifest_or_raise()
    with pytest.raises(StoreError, match="manifest.json is missing"):
        Store.open(store.uri, filesystem=store.blobs.fs)
    manifest = make_manifest()
    store.write_manifest(manifest)
    later = manifest.model_copy(update={"updated_at": NOW + timedelta(hours=1), "job_ids": ("job-1", "job-2")})
    store.write_manifest(later)
    reopened = Store.open(store.uri, filesystem=store.blobs.fs)
    assert reopened.load_manifest_or_raise() == later
    text = later.to_json().replace(f'"schema_version": {SCHEMA_VERSION}', '"schema_version": 99')
    store.blobs.put("manifest.json", text.encode())
    with pytest.raises(StoreError, match="schema version 99 is not supported"):
        Store.open(store.uri, filesystem=store.blobs.fs)


def test_corrupted_shard_is_detected(store: Store) -> None:
    rows = [index_row(store, kv(1), "a", "low"), index_row(store, kv(2), "b", "low")]
    store.publish_index(rows)
    flip_byte(store, rows[0]["shard_path"], -1)  # last byte of tensor data
    with pytest.raises(ShardCorruptError, match=rows[0]["shard_path"]):
        store.load_many(rows)
    assert torch.equal(store.load_kv(rows[1]), kv(2))
    flip_byte(store, rows[1]["shard_path"], rows[1]["byte_offset"])  # first byte of the tensor
    with pytest.raises(ShardCorruptError, match=rows[1]["shard_path"]):
        store.load_kv(rows[1])
    with pytest.raises(ShardCorruptError, match="torn"):  # a row claiming bytes past the end of its file
        store.load_kv({**rows[0], "byte_offset": rows[0]["byte_offset"] + 8})


def test_missing_shard_is_detected(store: Store) -> None:
    row = index_row(store, kv(1), "a", "low")
    store.publish_index([row])
    store.blobs.delete(row["shard_path"])
    with pytest.raises(ShardCorruptError, match=f"{row['shard_path']} is missing"):
        store.load_kv(store.index().to_pylist()[0])
    with pytest.raises(StoreError, match="no valid shard_path"):
        store.load_kv({**row, "shard_path": "../../etc/passwd"})


def test_rerun_dedupes_keeping_the_newest(store: Store) -> None:
    first = [index_row(store, kv(i), f"chunk {i}", tier, created_at=NOW) for i in range(3) for tier in ("low", None)]
    assert store.publish_index(first) == 6
    store.publish_index(first)  # a plain rerun
    newer = index_row(store, kv(9), "chunk 0", "low", created_at=NOW + timedelta(seconds=1))
    store.publish_index([newer])
    store.publish_index([index_row(store, kv(8), "chunk 0", "low", created_at=NOW - timedelta(days=1))])  # stale writer
    index = store.index()
    assert index.num_rows == 6
    assert len({tuple(r[c] for c in ("chunk_key", "tier", "variant", "fingerprint")) for r in index.to_pylist()}) == 6
    (row,) = store.lookup(chunk_keys=[sha("chunk 0")], tiers=["low"]).to_pylist()
    assert row["checksum"] == newer["checksum"] and torch.equal(store.load_kv(row), kv(9))
    chunk = dict(chunk_id="c0", doc_id="d", order=0, chunk_key=sha("x"), text="x", num_text_tokens=1,
                 embedding=[0.0] * 4, source="f.txt", image_path=None)
    store.publish_chunks([chunk])
    store.publish_chunks([{**chunk, "text": "x "}])
    assert store.chunks().to_pylist() == [{**chunk, "text": "x ", "collection": None}]  # optional, left out: null


def test_publish_accepts_an_arrow_table(store: Store) -> None:
    rows = [index_row(store, kv(i), f"t{i}", "low") for i in range(3)]
    before = datetime.now(timezone.utc)
    assert store.publish_index(pa.Table.from_pylist(rows)) == 3  # no created_at column: stamped now
    index = store.index()
    assert index.num_rows == 3 and min(index.column("created_at").to_pylist()) >= before
    loaded = store.load_many(store.lookup(chunk_keys=[sha(f"t{i}") for i in range(3)]))
    assert all(torch.equal(tensor, kv(i)) for i, tensor in enumerate(loaded))


def test_lookup_filters_and_keeps_requested_order(store: Store) -> None:
    store.publish_index([index_row(store, kv(i), f"chunk {i}", t) for i in range(4) for t in ("low", "high", None)])
    order = [sha("chunk 2"), sha("chunk 0"), sha("chunk 3")]
    table = store.lookup(chunk_keys=order, tiers=["low", None])
    assert table.column("chunk_key").to_pylist() == [k for k in order for _ in range(2)]
    assert store.lookup(tiers=[None]).column("variant").to_pylist() == ["text"] * 4
    assert store.lookup(variants=[Variant.TEMPLATE], tiers=["high"]).num_rows == 4
    assert store.lookup(fingerprints=[sha("other model")]).num_rows == 0
    loaded = store.load_many(table)
    assert torch.equal(loaded[0], kv(2)) and torch.equal(loaded[-1], kv(3))
    fp = make_manifest().entry_fingerprint(Variant.TEMPLATE, "low")
    present = CacheKey(sha("chunk 1"), "low", Variant.TEMPLATE, fp)
    absent = [CacheKey(sha("chunk 9"), "low", Variant.TEMPLATE, fp), CacheKey(sha("chunk 1"), "low", Variant.PLAIN, fp),
              CacheKey(sha("chunk 1"), "low", Variant.TEMPLATE, sha("stale"))]
    assert store.has_entries({present, *absent}) == {present}


def test_chunks_for_keeps_requested_order(store: Store) -> None:
    store.write_manifest(make_manifest())
    rows = [dict(chunk_id=f"{doc}-{i}", doc_id=doc, order=i, chunk_key=sha(f"{doc}{i}"), text=f"{doc}{i}",
                 num_text_tokens=2, embedding=[float(i)] * 4, source=f"{doc}.txt", image_path=None)
            for doc in "ab" for i in (2, 0, 1)]
    store.publish_chunks(rows[:3])
    store.publish_chunks(rows[3:])
    assert store.chunks_for(chunk_ids=["b-1", "a-2", "b-1"]).column("chunk_id").to_pylist() == ["b-1", "a-2", "b-1"]
    by_doc = store.chunks_for(doc_ids=["b", "a"]).column("chunk_id").to_pylist()
    assert by_doc == [f"{d}-{i}" for d in "ba" for i in range(3)]
    with pytest.raises(StoreError, match="unknown chunk_ids.*'zz'"):
        store.chunks_for(chunk_ids=["a-0", "zz"])
    with pytest.raises(ValueError, match="exactly one"):
        store.chunks_for()
    with pytest.raises(RowsError, match="4 dims"):
        store.publish_chunks([{**rows[0], "embedding": [1.0] * 3}])


def test_crash_between_shard_and_publish_leaves_only_an_orphan(store: Store) -> None:
    kept = index_row(store, kv(1), "kept", "low")
    store.publish_index([kept])
    crashed = index_row(store, kv(2), "crashed", "low")  # shard written, job died before publishing
    assert store.index().num_rows == 1
    assert remove_orphans(store) == 0  # inside the grace period for in-flight jobs
    assert remove_orphans(store, older_than_s=0) == 1
    with pytest.raises(RowsError, match="missing shards"):
        store.publish_index([crashed])  # a row for the vanished shard is refused, never dangling
    assert store.index().num_rows == 1 and torch.equal(store.load_kv(store.index().to_pylist()[0]), kv(1))


def test_publish_validates_rows(store: Store) -> None:
    row = index_row(store, kv(1), "a", "low")
    for bad, message in [({"tier": None}, "tier must be null exactly"), ({"variant": "fancy"}, "Variant"),
                         ({"chunk_key": "A" * 64}, "sha256 hex"), ({"tier": "Low"}, "tier name"),
                         ({"shard_path": "shards/../x.safetensors"}, "come from write_shard")]:
        with pytest.raises(RowsError, match=message):
            store.publish_index([{**row, **bad}])
    assert store.index().num_rows == 0
    with pytest.raises(ValueError, match="tensor key"):
        store.write_shard({"a/b c": kv(1)})
    with pytest.raises(ValueError, match="float32/bfloat16/float16"):
        store.write_shard({"ids": torch.arange(3)})


def test_quarantine_stats_and_compact(store: Store) -> None:
    store.publish_index([index_row(store, kv(i), f"c{i}", tier) for i in range(3) for tier in ("low", None)])
    store.publish_index([index_row(store, kv(0), "c0", "low")])
    store.publish_chunks([dict(chunk_id="x", doc_id="d", order=0, chunk_key=sha("c0"), text="c0", num_text_tokens=1,
                               embedding=[0.0] * 4, source="s", image_path=None)])
    assert store.quarantine([{"source": "bad.pdf", "doc_id": None, "reason": "unreadable", "detail": "not utf-8"}],
                            job_id="job-7") == 1
    assert store.quarantined(job_id="job-7").column("source").to_pylist() == ["bad.pdf"]
    assert store.quarantined(job_id="job-8").num_rows == 0
    stats = store.stats()
    assert (stats.num_chunks, stats.num_documents, stats.num_entries, stats.num_quarantined) == (1, 1, 6, 1)
    nbytes = kv(0).nbytes
    assert [(g.tier, g.variant, g.num_entries, g.nbytes) for g in stats.groups] == [
        (None, Variant.TEXT, 3, 3 * nbytes), ("low", Variant.TEMPLATE, 3, 3 * nbytes)]
    before = store.index().sort_by("chunk_key").to_pylist()
    store.compact()
    parts = store.blobs.list("index")
    assert len(parts) == 1 and store.index().sort_by("chunk_key").to_pylist() == before
    assert remove_orphans(store, older_than_s=0) == 0  # the rerun wrote identical bytes: same shard


# ---- local-only: crash injection --------------------------------------------------------------
def test_manifest_replace_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store.open(str(tmp_path), create=True)
    store.write_manifest(make_manifest())

    def crash(*args):
        raise OSError("power cut")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="power cut"):
        store.write_manifest(make_manifest(job_ids=("job-1", "job-2")))
    assert store.read_manifest() == make_manifest()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]  # the temp file is cleaned up


def test_torn_part_write_is_invisible_and_swept(tmp_path: Path) -> None:
    store = Store.open(str(tmp_path), create=True)
    row = index_row(store, kv(1), "a", "low")
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / ".tmp-deadbeef").write_bytes(b"PAR1 half a parquet file")  # a writer killed mid-write
    assert store.index().num_rows == 0
    store.publish_index([row])
    assert store.index().num_rows == 1
    assert remove_orphans(store, older_than_s=0) == 1 and not (tmp_path / "index" / ".tmp-deadbeef").exists()


def test_load_many_reads_each_shard_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store.open(str(tmp_path), create=True)
    entries = store.write_shard({f"t{i}": kv(i) for i in range(4)})
    rows = [{**e.index_fields()} for e in entries] + [index_row(store, kv(9), "other", "low")]
    reads: list[str] = []
    original = store.shards._read
    monkeypatch.setattr(store.shards, "_read", lambda rel, rows: reads.append(rel) or original(rel, rows))
    loaded = store.load_many(rows[::-1])
    assert len(reads) == 2 and torch.equal(loaded[-1], kv(0)) and torch.equal(loaded[0], kv(9))


def test_a_large_load_checks_every_entry_on_several_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past `PARALLEL_SHA256_MIN_NBYTES` a load's checksums run on the hashing threads; a corrupt entry anywhere in
    the load, here the fourth of six over two shards, still fails it, naming its shard."""
    store = Store.open(str(tmp_path), create=True)
    entries = store.write_shard({f"t{i}": kv(i, num_tokens=50) for i in range(4)})
    rows = [{**e.index_fields()} for e in entries]
    rows += [index_row(store, kv(9 + i), f"other {i}", "low") for i in range(2)]
    monkeypatch.setattr(shards, "PARALLEL_SHA256_MIN_NBYTES", 0)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)  # the CPUs a replica may use: three hashing tasks
    hashed_on: list[str] = []
    sha256 = hashlib.sha256
    monkeypatch.setattr(shards.hashlib, "sha256", lambda data: hashed_on.append(threading.current_thread().name)
                        or sha256(data))
    loaded = store.load_many(rows)
    assert all(torch.equal(a, b) for a, b in zip(loaded, [kv(i, num_tokens=50) for i in range(4)] + [kv(9), kv(10)]))
    assert len(hashed_on) == 6 and all(name.startswith("qvpic-sha256") for name in hashed_on)
    flip_byte(store, rows[3]["shard_path"], rows[3]["byte_offset"] + 5)
    with pytest.raises(ShardCorruptError, match=r"'t3' of shard .*" + rows[3]["shard_path"]):
        store.load_many(rows)
    monkeypatch.setattr(shards, "PARALLEL_SHA256_MIN_NBYTES", 1 << 40)  # the sequential path finds it too
    with pytest.raises(ShardCorruptError, match="'t3'"):
        store.load_many(rows)
