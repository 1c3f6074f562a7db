"""A real S3-compatible server on loopback (moto in server mode) for tests of S3-backed code.

Import the fixtures into a test module: `from tests.support.fixtures_s3 import s3_bucket, s3_server  # noqa: F401`.
pyarrow's C++ S3 client cannot be intercepted in-process, hence a server on a real port.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import pyarrow.fs as pafs
import pytest

from tests.support.ray_fixtures import free_port

# Dummy keys are mandatory: an anonymous pyarrow write stores aws-chunked framing verbatim.
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",  # no multi-second probe of the EC2 metadata service
}


@dataclass(frozen=True)
class S3Server:
    host: str
    port: int

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def filesystem(self) -> pafs.S3FileSystem:
        # allow_delayed_open: objects under ~10 MiB go up as one PUT, as the store's own filesystem does; larger
        # ones go multipart, which moto 5.2.5 completes for pyarrow 26.0.1 (tests/pipeline/store/test_store_s3.py).
        # What does
        # not round-trip is an anonymous write: pyarrow then stores aws-chunked framing in the object (below).
        return pafs.S3FileSystem(
            access_key=S3_ENV["AWS_ACCESS_KEY_ID"], secret_key=S3_ENV["AWS_SECRET_ACCESS_KEY"],
            region=S3_ENV["AWS_DEFAULT_REGION"], endpoint_override=f"{self.host}:{self.port}", scheme="http",
            allow_delayed_open=True,
        )

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint_url, region_name=S3_ENV["AWS_DEFAULT_REGION"])

    def new_bucket(self) -> str:
        name = f"qvpic-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name


def _wait_listening(host: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=0.2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


@contextmanager
def running_s3() -> Iterator[S3Server]:
    """A moto server on a free loopback port, with the dummy S3 credentials in this process's environment."""
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in S3_ENV}
    os.environ.update(S3_ENV)  # before any S3 client (or Ray worker) starts, so all inherit them
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
    server = S3Server("127.0.0.1", free_port())
    moto = ThreadedMotoServer(ip_address=server.host, port=server.port, verbose=False)
    moto.start()
    try:
        _wait_listening(server.host, server.port, timeout_s=10.0)
        yield server
    finally:
        moto.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    with running_s3() as server:
        yield server


@pytest.fixture()
def s3_bucket(s3_server: S3Server) -> str:
    """A fresh, empty bucket per test."""
    return s3_server.new_bucket()
