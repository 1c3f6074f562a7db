"""A real Redis on loopback for the test session (Debian `redis-server`, installed by `make system`).

`start_redis()` runs a private, non-persistent server on a free port ≥ 20000 and returns once it
answers PING; `stop()` ends exactly that process. The session fixture `redis_url` shares one; a test
that must see Redis go away starts its own.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass

import pytest
import redis

from tests.support.ray_fixtures import free_port

READY_TIMEOUT_S = 10.0


@dataclass
class RedisServer:
    process: subprocess.Popen
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_redis(port: int | None = None) -> RedisServer:
    """A fresh server; `port`: on that port (a restart of a stopped one, empty: nothing is persisted)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed: run `make system` (Debian package redis-server)")
    port = port or free_port()
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                "--daemonize", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = RedisServer(process, port)
    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.2)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            client.ping()
            client.close()
            return server
        except redis.ConnectionError:
            if process.poll() is not None or time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"redis-server on port {port} did not come up") from None
            time.sleep(0.01)


@pytest.fixture(scope="session")
def redis_url():
    server = start_redis()
    yield server.url
    server.stop()
