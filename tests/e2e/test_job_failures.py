"""A failed job ends with one paragraph naming its cause (disk full, permission, S3), after Ray's traceback.

The exceptions are the real thing: raised inside a Ray Data worker and wrapped by Ray on the way back,
as a write from the compile or publish stage would be; and a store on an S3 endpoint that is down.
"""

from __future__ import annotations

import errno
import json

import pytest

from jobs import ingest as ingest_job
from jobs.failure import explain
from tests.support.ray_fixtures import free_port, ray_session  # noqa: F401  (pytest fixture)

pytestmark = pytest.mark.e2e


def raise_in_worker(ray, error: BaseException) -> BaseException:
    """`error` raised by a Ray Data UDF and caught on the driver, wrapped as Ray wraps it."""
    import ray.data

    def udf(batch):
        raise error

    with pytest.raises(BaseException) as caught:
        ray.data.range(2).map_batches(udf).take_all()
    return caught.value


@pytest.mark.parametrize("error, cause, hint", [
    (OSError(errno.ENOSPC, "No space left on device", "/data/store/shards/ab/x.safetensors"),
     "the disk is full (No space left on device) while writing /data/store/shards/ab/x.safetensors", "Free space"),
    (PermissionError(errno.EACCES, "Permission denied", "/data/store/index"),
     "permission denied writing /data/store/index", "write access"),
    (OSError("When uploading part for key 'store/index/part-1.parquet' in bucket 'kv': AWS Error ACCESS_DENIED "
             "during UploadPart operation: Access Denied"), "S3 error on store /data/store", "credentials"),
])
def test_worker_failures_are_named_in_one_paragraph(ray_session, error, cause, hint):
    wrapped = raise_in_worker(ray_session, error)
    paragraph = explain(wrapped, "ingest", "/data/store")
    assert cause in paragraph and hint in paragraph, paragraph
    assert "rerunning `qvpic ingest` resumes" in paragraph and "\n" not in paragraph


def test_unreachable_s3_store_ends_with_the_cause(ray_session, tmp_path, capsys):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"doc_id": "a", "text": "A short document."}) + "\n")
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    code = ingest_job.main(["--corpus", str(corpus), "--store", "s3://kv/store", "--s3-endpoint", dead, "--json"])
    stderr = capsys.readouterr().err.rstrip()
    last = stderr.split("\n\n")[-1]
    assert code == 1 and "Traceback" in stderr
    assert (last.startswith("qvpic ingest failed: S3 error on store s3://kv/store")
            and "NETWORK_CONNECTION" in last), last
    assert "\n" not in last
