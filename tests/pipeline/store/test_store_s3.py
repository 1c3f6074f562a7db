"""S3-specific store behaviour against a real S3-compatible server on loopback (moto server mode).

The backend-neutral tests (round trip, corruption, manifest, dedupe, orphans) run on S3 too: they are
parametrised over local and S3 in test_store.py.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.store import ShardCorruptError, Store, StoreError, remove_orphans
from schemas.store import StoreSpec
from tests.pipeline.store.test_store import index_row, kv, make_manifest
from tests.support.fixtures_s3 import S3Server, s3_bucket, s3_server  # noqa: F401  (pytest fixtures)


def test_store_spec_endpoint_uses_environment_credentials(s3_server: S3Server, s3_bucket: str) -> None:
    spec = StoreSpec(uri=f"s3://{s3_bucket}/qvpic/store", endpoint_url=s3_server.endpoint_url)
    store = Store.open(spec, create=True)
    store.write_manifest(make_manifest())
    store.publish_index([index_row(store, kv(1), "a", "low"), index_row(store, kv(2, torch.float32), "a", None)])
    reader = Store.open(spec)
    assert reader.load_manifest_or_raise() == make_manifest()
    assert [t.dtype for t in reader.load_many(reader.index())] == [torch.bfloat16, torch.float32]
    keys = {o["Key"] for o in s3_server.client().list_objects_v2(Bucket=s3_bucket)["Contents"]}
    assert "qvpic/store/manifest.json" in keys and all(k.startswith("qvpic/store/") for k in keys)


def test_endpoint_from_environment(s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    store = Store.open(f"s3://{s3_bucket}/env", create=True)
    row = index_row(store, kv(3), "a", "high")
    store.publish_index([row])
    assert torch.equal(Store.open(f"s3://{s3_bucket}/env", create=True).load_kv(row), kv(3))


def test_missing_bucket_is_a_clear_error(s3_server: S3Server) -> None:
    with pytest.raises(StoreError, match="bucket 'qvpic-no-such-bucket'.*does not exist"):
        Store.open("s3://qvpic-no-such-bucket/store", filesystem=s3_server.filesystem(), create=True)


def test_sibling_prefixes_are_isolated(s3_server: S3Server, s3_bucket: str) -> None:
    fs = s3_server.filesystem()
    a, ab = (Store.open(f"s3://{s3_bucket}/{p}", filesystem=fs, create=True) for p in ("a", "ab"))
    a.publish_index([index_row(a, kv(1), "x", "low")])
    ab.publish_index([index_row(ab, kv(2), "y", "low"), index_row(ab, kv(3), "z", "low")])
    assert (a.index().num_rows, ab.index().num_rows) == (1, 2)
    assert remove_orphans(a, older_than_s=0) == 0 and ab.load_many(ab.index())[1].shape == kv(3).shape


def test_objects_replaced_by_another_writer_are_detected(s3_server: S3Server, s3_bucket: str) -> None:
    store = Store.open(f"s3://{s3_bucket}/s", filesystem=s3_server.filesystem(), create=True)
    rows = [index_row(store, kv(1), "a", "low"), index_row(store, kv(2), "b", "low")]
    store.publish_index(rows)
    client = s3_server.client()
    good = client.get_object(Bucket=s3_bucket, Key=f"s/{rows[0]['shard_path']}")["Body"].read()
    client.put_object(Bucket=s3_bucket, Key=f"s/{rows[0]['shard_path']}", Body=good[:-1] + bytes([good[-1] ^ 1]))
    client.put_object(Bucket=s3_bucket, Key=f"s/{rows[1]['shard_path']}", Body=good[: len(good) // 2])  # torn
    for row in rows:
        with pytest.raises(ShardCorruptError, match=row["shard_path"]):
            store.load_kv(row)


def test_a_shard_above_one_part_goes_up_multipart_and_reads_back_across_the_boundary(s3_server: S3Server,
                                                                                      s3_bucket: str) -> None:
    """Issue 38: pyarrow uploads an object over its ~10 MiB part size as a multipart upload. Two ~7 MiB entries
    make a ~14 MiB shard: S3 names a multipart object's ETag `<md5 of part md5s>-<number of parts>`, so the `-2`
    proves the boundary was crossed, and the second entry's byte range straddles it."""
    store = Store.open(f"s3://{s3_bucket}/mp", filesystem=s3_server.filesystem(), create=True)
    generator = torch.Generator().manual_seed(38)
    tensors = {name: torch.randn(2, 2, 2, 28_672, 8, generator=generator) for name in ("a", "b")}  # 7 MiB each
    entries = store.write_shard(tensors)
    (shard,) = {e.shard_path for e in entries}
    head = s3_server.client().head_object(Bucket=s3_bucket, Key=f"mp/{shard}")
    assert head["ContentLength"] > 10 * 2**20 and head["ETag"].strip('"').endswith("-2"), head["ETag"]
    second = entries[1].index_fields()
    assert second["byte_offset"] < 10 * 2**20 < second["byte_offset"] + second["nbytes"]  # straddles part 1 | 2
    reader = Store.open(f"s3://{s3_bucket}/mp", filesystem=s3_server.filesystem(), create=True)  # a fresh client
    loaded = reader.load_many([e.index_fields() for e in entries])  # each entry checked against its sha256
    assert all(torch.equal(got, tensors[name]) for got, name in zip(loaded, ("a", "b")))
