"""One local Ray for the whole test session (import the fixture into a test module to use it).

`address="local"` always starts a fresh cluster owned by this process, never attaching to someone
else's; the object store is small (tests move KiBs) and 4 logical CPUs on a 2-core box keep actor
pools and Serve replicas from starving Ray's own tasks. One logical GPU lets `num_gpus=1` actors
schedule on a CPU-only box (torch then runs them on the CPU), so CI exercises the GPU placement
path. Shutdown stops only this cluster.
"""

from __future__ import annotations

import random
import socket

import pytest

OBJECT_STORE_NBYTES = 300 * 2**20
# The worker pool of every Ray the suite starts (its jobs' private ones and the cluster fixture's nodes too:
# tests/conftest.py exports it before any starts), as raylets read it from the environment. Ray keeps at
# most `num_cpus` idle workers and kills the rest after 1 s idle; an ingest holds one worker per stage actor
# and runs fractional-CPU tasks beside them, so each of its phases started fresh workers (~2 CPU-s of
# imports each) that the next phase could have reused. Keeping 12 for 5 minutes took a 4-document ingest
# from 42 s to 21-26 s on 2 cores. A user's `qvpic` keeps Ray's defaults: more live workers make the raylet
# warn about the pool's size, noise `make demo` must not print (tests/e2e/test_demo_e2e.py runs without this).
SUITE_RAY_ENV = {"RAY_num_workers_soft_limit": "12", "RAY_idle_worker_killing_time_threshold_ms": "300000"}


def init_local_ray() -> None:
    import ray

    ray.init(address="local", num_cpus=4, num_gpus=1, include_dashboard=False,
             object_store_memory=OBJECT_STORE_NBYTES, log_to_driver=False)


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        init_local_ray()
    yield ray
    ray.shutdown()


def free_port() -> int:
    """A free TCP port in [20000, 30000) (Ray's worker ports live in 10002-19999); a random start keeps
    concurrent test sessions apart."""
    first = random.randrange(20000, 30000)
    for offset in range(10000):
        port = 20000 + (first - 20000 + offset) % 10000
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in [20000, 30000)")
