"""The streamed snapshot writer: a generation's catalog and entries equal the store's own deduplicated
view (newest chunk row per id, newest entry per key, only the served fingerprints), whatever the
number of buckets — with chunks republished, a chunk id moved to another document, and entries that
are stale or superseded."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import pipeline.store.catalog.writer as catalog_writer
from pipeline.store import Store, publish_generation
from pipeline.store.catalog import RowFile
from schemas.modes import Variant
from schemas.tables import CHUNKS_SCHEMA
from serve.routing.retrieval import open_snapshot
from tests.pipeline.store.test_store import NOW, index_row, kv, make_manifest, sha

DIM = 4


def chunks(rows: list[tuple[str, int, str]], seed: int) -> pa.Table:
    """CHUNKS_SCHEMA rows of (doc_id, order, text)."""
    vectors = np.random.default_rng(seed).standard_normal((len(rows), DIM)).astype(np.float32)
    return pa.Table.from_pylist([
        dict(chunk_id=f"{doc}#{order:05d}", doc_id=doc, order=order, chunk_key=sha(text), text=text,
             num_text_tokens=len(text), embedding=(v / np.linalg.norm(v)).tolist(), source="test",
             image_path=None if order % 2 else f"pages/{doc}.png")
        for (doc, order, text), v in zip(rows, vectors)], CHUNKS_SCHEMA)


def build_store(root) -> Store:
    store = Store.open(str(root), create=True)
    store.write_manifest(make_manifest(embedding_dim=DIM))
    store.publish_chunks(chunks([(f"d{d}", o, f"text {d}.{o}") for d in range(12) for o in range(3)], seed=0))
    store.publish_chunks(chunks([("d3", o, f"rewritten {o}") for o in range(3)]  # republished: newest wins
                                + [(f"e{d}", o, f"extra {d}.{o}") for d in range(4) for o in range(2)], seed=1))
    moved = chunks([("d5", 1, "moved text")], seed=2).to_pylist()[0]
    # id under another doc
    store.publish_chunks(pa.Table.from_pylist([{**moved, "doc_id": "elsewhere"}], CHUNKS_SCHEMA))
    keys = sorted(set(store.chunks()["text"].to_pylist()))
    seed = 0
    for part in (keys[:20], keys[20:]):  # two index parts
        rows = []
        for text in part:
            for tier in ("low", "high", None):
                seed += 1
                rows.append(index_row(store, kv(seed), text, tier, created_at=NOW))
        store.publish_index(rows)
    superseding = [index_row(store, kv(1000), keys[0], "low", num_tokens=99, created_at=NOW + timedelta(hours=1)),
                   index_row(store, kv(1001), keys[1], "low", num_tokens=77, created_at=NOW - timedelta(hours=1)),
                   index_row(store, kv(1002), keys[2], "high", fingerprint="0" * 64, created_at=NOW)]  # stale
    store.publish_index(superseding)
    return store


@pytest.mark.parametrize("bucket_rows", [65_536, 5])
def test_snapshot_equals_the_stores_deduplicated_view(tmp_path, monkeypatch, bucket_rows):
    monkeypatch.setattr(catalog_writer, "BUCKET_ROWS", bucket_rows)
    store = build_store(tmp_path / "store")
    record = publish_generation(store, "test")
    catalog = open_snapshot(store, record.generation, cache_root=tmp_path / "cache").catalog
    expected = store.chunks()
    assert record.num_chunks == catalog.num_rows == expected.num_rows
    assert record.num_documents == len(set(expected["doc_id"].to_pylist()))
    rows = list(range(catalog.num_rows))
    written = {r["chunk_id"]: r for r in catalog.chunk_rows(rows)}
    for row, text in zip(catalog.chunk_rows(rows), catalog.texts(rows)):
        written[row["chunk_id"]] = {**row, **text}
    for want in expected.to_pylist():
        got = written.pop(want["chunk_id"])
        assert {k: got[k] for k in ("doc_id", "order", "chunk_key", "num_text_tokens", "text", "image_path")} == \
            {k: want[k] for k in ("doc_id", "order", "chunk_key", "num_text_tokens", "text", "image_path")}
    assert not written
    assert catalog.texts(catalog.rows_of_chunks(["d3#00001"])[0])[0]["text"] == "rewritten 1"
    assert catalog.rows_of_docs(["elsewhere"])[0] == catalog.rows_of_chunks(["d5#00001"])[0]  # moved, and only there
    for doc in set(expected["doc_id"].to_pylist()):
        found, missing = catalog.rows_of_docs([doc])
        assert not missing
        assert [r["chunk_id"] for r in catalog.chunk_rows(found)] == \
            store.chunks_for(doc_ids=[doc])["chunk_id"].to_pylist()  # contiguous, in order
    ids = expected["chunk_id"].to_pylist()
    vectors = np.array(expected["embedding"].to_pylist(), np.float32).astype(np.float16)
    found, _ = catalog.rows_of_chunks(ids)
    assert np.array_equal(catalog.vectors.embeddings.take(np.array(found)), vectors)

    manifest = store.load_manifest_or_raise()
    index = store.index().to_pylist()
    served = [r for r in index if r["fingerprint"] == manifest.entry_fingerprint(Variant(r["variant"]), r["tier"])]
    for chunk_id, slots in zip(ids, catalog.entries_of(found)):
        key = sha(expected.filter(pc.equal(expected["chunk_id"], chunk_id))["text"][0].as_py())
        want = {(r["tier"], Variant(r["variant"])): r for r in served if r["chunk_key"] == key}
        assert {slot: (e["shard_path"], e["num_tokens"]) for slot, e in slots.items()} == \
            {slot: (e["shard_path"], e["num_tokens"]) for slot, e in want.items()}
    assert record.num_entries == len(served)

    def slots_of(text: str) -> dict:
        chunk_id = expected.filter(pc.equal(expected["text"], text))["chunk_id"][0].as_py()
        return catalog.entries_of(catalog.rows_of_chunks([chunk_id])[0])[0]

    texts = sorted(set(expected["text"].to_pylist()))
    assert slots_of(texts[0])[("low", Variant.TEMPLATE)]["num_tokens"] == 99  # a newer row wins ...
    assert slots_of(texts[1])[("low", Variant.TEMPLATE)]["num_tokens"] == 5  # ... an older one, written later, not
    assert slots_of(texts[2])[("high", Variant.TEMPLATE)]["fingerprint"] != "0" * 64  # stale rows are not served


def test_text_batches_hold_exactly_their_rows_across_buckets(tmp_path, monkeypatch):
    """Rows are found in batch row // BATCH_ROWS: buckets of 500 rows must not leave short batches."""
    monkeypatch.setattr(catalog_writer, "BUCKET_ROWS", 500)
    store = Store.open(str(tmp_path / "store"), create=True)
    store.write_manifest(make_manifest(embedding_dim=DIM))
    rows = [(f"doc{d:04d}", o, f"chunk {d} {o}") for d in range(700) for o in range(3)]
    for start in range(0, len(rows), 900):
        store.publish_chunks(chunks(rows[start:start + 900], seed=start))
    catalog = open_snapshot(store, publish_generation(store, "t").generation).catalog
    every = list(range(catalog.num_rows))
    texts = [t["text"] for t in catalog.texts(every)]
    assert texts == [f"chunk {int(r['doc_id'][3:])} {r['order']}" for r in catalog.chunk_rows(every)]
    assert sorted(texts) == sorted(text for _, _, text in rows)
    assert all(count == 0 for _, count in catalog.ranges)  # no index rows: every range empty


def test_row_file_returns_rows_in_request_order_across_batches(tmp_path):
    """Rows are read one record batch at a time; what comes back follows the request: order, repeats, columns."""
    table = pa.table({"n": list(range(10)), "s": [f"r{i}" for i in range(10)]})
    with pa.ipc.new_file(tmp_path / "t.arrow", table.schema) as writer:
        for batch in table.to_batches(max_chunksize=4):  # batches of 4, 4, 2 rows
            writer.write_batch(batch)
    rows = RowFile(tmp_path / "t.arrow")
    wanted = [9, 0, 4, 4, 3, 8, 5]
    assert rows.num_rows == 10 and rows.batch_rows == 4
    assert rows.rows(wanted) == [{"n": i, "s": f"r{i}"} for i in wanted]
    assert rows.rows(wanted, ("s",)) == [{"s": f"r{i}"} for i in wanted]
    assert rows.rows([]) == []


def test_row_file_cache_serves_repeats_without_reading_and_stays_bounded(tmp_path):
    """The row cache: a repeated row is not read again (reads counted on the reader), what comes back is the
    file's row whatever a caller did to an earlier copy, and at most `cache_rows` rows are kept (LRU)."""
    table = pa.table({"n": list(range(10)), "s": [f"r{i}" for i in range(10)]})
    with pa.ipc.new_file(tmp_path / "t.arrow", table.schema) as writer:
        for batch in table.to_batches(max_chunksize=4):
            writer.write_batch(batch)
    rows = RowFile(tmp_path / "t.arrow", cache_rows=3)
    reads = []
    real = rows.reader

    class Counting:
        def get_batch(self, i):
            reads.append(i)
            return real.get_batch(i)

    rows.reader = Counting()
    first = rows.rows([1, 5])
    assert reads == [0, 1]
    first[0]["s"] = "changed by a caller"
    assert rows.rows([5, 1]) == [{"n": 5, "s": "r5"}, {"n": 1, "s": "r1"}] and reads == [0, 1]  # both cached
    rows.rows([9, 8])  # 9 then 8 pushes out the least recent (5: 1 was used after it)
    assert len(rows._cache) == 3 and set(rows._cache) == {1, 9, 8}
    reads.clear()
    assert rows.rows([5]) == [{"n": 5, "s": "r5"}] and reads == [1]  # read again
    uncached = RowFile(tmp_path / "t.arrow", cache_rows=0)  # control: nothing kept
    uncached.rows([1]), uncached.rows([1])
    assert len(uncached._cache) == 0
