"""The store's write lease: one writer at a time, a clear refusal naming the holder, stale leases of dead
or silent holders cleared — on a local directory and on S3."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, replace

import pytest

from pipeline.store import Blobs, StoreBusyError, StoreLease
from pipeline.store.leases import LeaseInfo
from schemas.store import StoreSpec
from tests.support.fixtures_s3 import s3_bucket, s3_server  # noqa: F401  (pytest fixtures)


@pytest.fixture(params=["local", "s3"])
def blobs(request, tmp_path) -> Blobs:
    if request.param == "local":
        return Blobs.open(StoreSpec(uri=str(tmp_path / "store")), create=True)
    server = request.getfixturevalue("s3_server")
    return Blobs.open(StoreSpec(uri=f"s3://{server.new_bucket()}/store"), server.filesystem())


def leases(blobs: Blobs) -> list[str]:
    return sorted(i.base_name for i in blobs.list("leases"))


def test_second_writer_refuses_naming_the_first(blobs):
    with StoreLease(blobs, "ingest-first"):
        assert leases(blobs) == ["ingest-first.json"]
        with pytest.raises(StoreBusyError, match=r"being written by job ingest-first \(pid \d+ on .*\)") as refused:
            with StoreLease(blobs, "recompile-second"):
                pytest.fail("two writers held the store")
        assert "did not start" in str(refused.value)
        assert leases(blobs) == ["ingest-first.json"]  # the refused job left nothing behind
    assert leases(blobs) == []
    with StoreLease(blobs, "recompile-second"):  # released: the next job gets it
        pass


def test_lease_is_released_when_the_job_fails(blobs):
    with pytest.raises(RuntimeError, match="job crashed"):
        with StoreLease(blobs, "ingest-a"):
            raise RuntimeError("job crashed")
    assert leases(blobs) == []


def test_heartbeat_keeps_a_long_job_live_and_silence_expires_it(blobs):
    # ttl 3 s, beats every 0.75 s: a loaded CI machine with moto's S3 can delay a beat by a second or more,
    # and a ttl well under that made this test flaky (a stale lease, so the refusal below did not come)
    with StoreLease(blobs, "ingest-long", ttl_s=3.0) as lease:
        time.sleep(4.0)  # past the ttl: only the heartbeat keeps the lease live
        with pytest.raises(StoreBusyError):
            StoreLease(blobs, "ingest-other").__enter__()
        lease.heartbeat.stop()  # the holder goes silent (a partitioned or frozen driver)
        time.sleep(3.5)
        with StoreLease(blobs, "ingest-other"):
            assert leases(blobs) == ["ingest-other.json"]  # the silent holder's lease was expired and removed


def test_lease_of_a_dead_driver_on_this_host_is_stale_at_once(tmp_path):
    blobs = Blobs.open(StoreSpec(uri=str(tmp_path / "store")), create=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lease = StoreLease(blobs, "ingest-killed")
    info = replace(lease.info, pid=int(dead.stdout))  # a driver that was SIGKILLed mid-job
    blobs.put("leases/ingest-killed.json", json.dumps(asdict(info)).encode())
    with StoreLease(blobs, "ingest-rerun"):
        assert leases(blobs) == ["ingest-rerun.json"]
    assert LeaseInfo(**asdict(info)).stale(time.time())
