"""S3-specific store behaviour against a real S3-compatible server on loopback (moto server mode).

The backend-neutral tests (round trip, corruption, manifest, dedupe, orphans) run on S3 too: they are
parametrised over local and S3 in test_store.py.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.store import ShardCorruptError, Store, StoreError, remove_orphans
from schemas.store import StoreSpec
from tests.fixtures_s3 import S3Server, s3_bucket, s3_server  # noqa: F401  (pytest fixtures)
from tests.test_store import index_row, kv, make_manifest


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
