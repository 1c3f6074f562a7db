"""A corpus on S3 (moto server mode) reads as the same files in a local folder do: the local readers
(tests/pipeline/ingest/test_corpus.py checks them record by record) are the reference for every record and rejection,
and
the local folder's digest for the object store's. Page images are the one refusal an object store adds."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.ingest.corpus import RemoteFiles, discover, is_remote, read_file
from pipeline.ingest.corpus.readers import CorpusError
from pipeline.ingest.record import corpus_digest
from schemas.corpus import Document, ReaderSpec, RejectReason
from schemas.store import StoreSpec
from tests.pipeline.ingest.test_corpus import _jsonl_cases
from tests.support.fixtures_s3 import S3Server, s3_bucket, s3_server  # noqa: F401  (pytest fixtures)

SPEC = ReaderSpec(max_doc_chars=100)  # what tests/pipeline/ingest/test_corpus.py's JSONL cases are written against


def corpus_folder(root: Path) -> Path:
    """Every format and nesting the local readers take, good and bad records mixed."""
    (root / "notes" / "deep").mkdir(parents=True)
    (root / "mixed.jsonl").write_bytes(b"\n".join(line for line, _ in _jsonl_cases()) + b"\n\n")
    pq.write_table(pa.table({"doc_id": ["r0", None, "r0"], "text": ["row zero", "no id", "again"]}),
                   root / "rows.parquet")
    (root / "corrupt.parquet").write_bytes(b"PAR1 this is not parquet")
    (root / "notes" / "a.txt").write_text("\ufeffFirst note.\r\nSecond line.")
    (root / "notes" / "deep" / "b.md").write_text("# Heading\n\nBody.")
    (root / "notes" / "big.txt").write_text("x" * 401)  # > 4 * max_doc_chars bytes
    (root / "notes" / "table.csv").write_text("a,b\n1,2\n")
    (root / "page.png").write_bytes(b"\x89PNG not really")
    return root


def upload(server: S3Server, bucket: str, root: Path, prefix: str) -> StoreSpec:
    client = server.client()
    for path in root.rglob("*"):
        if path.is_file():
            client.put_object(Bucket=bucket, Key=f"{prefix}/{path.relative_to(root)}", Body=path.read_bytes())
    return StoreSpec(uri=f"s3://{bucket}/{prefix}", endpoint_url=server.endpoint_url)


def local_records(root: Path) -> dict[str, list]:
    files, refused = discover(str(root))
    assert not refused
    return {f.relpath: list(read_file(f.path, f.root, SPEC)) for f in files}


def test_an_s3_corpus_reads_as_the_same_local_folder(s3_server: S3Server, s3_bucket: str, tmp_path: Path) -> None:
    root = corpus_folder(tmp_path / "corpus")
    location = upload(s3_server, s3_bucket, root, "corpora/one")
    assert is_remote(location.uri) and not is_remote(str(root))
    remote = RemoteFiles(location)
    files, refused = remote.discover()
    expected = local_records(root)
    assert not refused and [f.relpath for f in files] == sorted(expected)
    read = {f.relpath: list(remote.read(f, SPEC)) for f in files}
    (image,) = read.pop("page.png")
    assert image.reason is RejectReason.UNSUPPORTED_FILE and "local corpus" in image.detail
    expected.pop("page.png")
    assert read == expected
    reasons = {relpath: [getattr(r, "reason", None) for r in items] for relpath, items in read.items()}
    assert reasons["notes/big.txt"] == [RejectReason.TOO_LARGE] and reasons["corrupt.parquet"] == [
        RejectReason.UNREADABLE_FILE] and reasons["notes/table.csv"] == [RejectReason.UNSUPPORTED_FILE]
    assert [d.text for d in read["notes/a.txt"] if isinstance(d, Document)] == ["First note.\nSecond line."]


def test_the_digest_is_the_local_folders_and_sees_a_changed_object(s3_server: S3Server, s3_bucket: str,
                                                                    tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "docs.jsonl").write_text(json.dumps({"doc_id": "a", "text": "alpha"}) + "\n")
    (root / "sub" / "n.txt").write_text("a note")
    location = upload(s3_server, s3_bucket, root, "c")
    assert RemoteFiles(location).digest() == corpus_digest(str(root)) == corpus_digest("", location)
    s3_server.client().put_object(Bucket=s3_bucket, Key="c/sub/n.txt", Body=b"a note!")
    assert RemoteFiles(location).digest() != corpus_digest(str(root))


def test_a_single_object_and_a_missing_location(s3_server: S3Server, s3_bucket: str, tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "docs.jsonl").write_text(json.dumps({"doc_id": "a", "text": "alpha"}) + "\n")
    upload(s3_server, s3_bucket, root, "one")
    single = RemoteFiles(StoreSpec(uri=f"s3://{s3_bucket}/one/docs.jsonl", endpoint_url=s3_server.endpoint_url))
    ((entry,), _) = single.discover()
    assert entry.relpath == "docs.jsonl" and [d.doc_id for d in single.read(entry, SPEC)] == ["a"]
    with pytest.raises(CorpusError, match="does not exist"):
        RemoteFiles(StoreSpec(uri=f"s3://{s3_bucket}/nothing", endpoint_url=s3_server.endpoint_url)).discover()
    with pytest.raises(CorpusError, match="qvpic-no-such-bucket"):  # a clear error, not a traceback
        RemoteFiles(StoreSpec(uri="s3://qvpic-no-such-bucket/c", endpoint_url=s3_server.endpoint_url)).discover()
