"""A real multi-node Ray cluster on this machine, shared by the cluster tests and benchmarks/scale/cluster.py.

`ray.cluster_utils.Cluster` starts real raylets and object stores: a GPU-less head (GCS, dashboard and
job server, Serve's controller and its one HTTP proxy) and two worker nodes that each declare one GPU.
Ray schedules on declared resources, so `num_gpus=1` actors land on the workers and run on the CPU
(pipeline/runtime/checkpoint.py says so once). The store lives on S3 (the moto server of
tests/support/fixtures_s3.py): nothing relies on a filesystem the nodes share. Each node gets its own scratch
directory (TMPDIR, and QVPIC_SERVING_CACHE, where a router keeps the serving snapshot it downloads).
Every node and every driver that joins binds 127.0.0.1: a driver that guessed the machine's other
address could not find the GCS.

Import into a test module: `from tests.support.cluster_fixtures import ray_cluster, s3_server  # noqa: F401`.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.fixtures_s3 import S3Server, s3_server  # noqa: F401  (fixture)
from tests.support.paths import REPO
from tests.support.ray_fixtures import free_port, init_local_ray

LOOPBACK = "127.0.0.1"
HEAD_CPUS = 4  # ingress, router, loader, the job driver and Ray Data's CPU stages
WORKER_CPUS = 2  # a generator (1 CPU) beside a compile actor
OBJECT_STORE_NBYTES = 200 * 2**20  # per node; tests move KiBs of KV
# The generator's Serve autoscaling with its delays shortened (the defaults wait 30 s up, 600 s down), for
# tests/cluster/test_cluster.py and benchmarks/scale/cluster.py. Target 1: one client keeps a generator below it, a few
# clients keep two above it. Replicas push their metrics every 10 s (Ray's
# RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S): the look-back must exceed that.
GENERATOR_AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1, "upscale_delay_s": 2,
                         "downscale_delay_s": 15, "look_back_period_s": 12}
# Ray turns a loopback bootstrap address into the machine's routable one (services.resolve_ip_for_localhost),
# where nodes bound to 127.0.0.1 cannot be found, unless it takes multi-node clusters to be off: its
# Windows/macOS switch, read by every process that joins (drivers, `ray job submit`, workers).
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@dataclass
class RayCluster:
    cluster: Any  # ray.cluster_utils.Cluster
    s3: S3Server
    dashboard_url: str  # the job server: `ray job submit --address <this>`
    scratch: Path
    workers: list[Any] = field(default_factory=list)  # ray._private.node.Node of each GPU worker
    driver_env: dict[str, str] = field(default_factory=dict)  # for subprocesses that join (qvpic, ray job submit)

    @property
    def address(self) -> str:
        return self.cluster.address

    def add_gpu_worker(self, name: str) -> Any:
        node = self.cluster.add_node(num_cpus=WORKER_CPUS, num_gpus=1, node_ip_address=LOOPBACK,
                                     object_store_memory=OBJECT_STORE_NBYTES, env_vars=node_env(self.scratch / name))
        self.workers.append(node)
        return node

    def remove_worker(self, node: Any) -> None:
        """Kill the node's raylet and every process on it at once: a lost machine, not a drain."""
        self.workers.remove(node)
        self.cluster.remove_node(node, allow_graceful=False)

    def store_uri(self, bucket: str, prefix: str = "store") -> str:
        return f"s3://{bucket}/{prefix}"

    def submit(self, *argv: str, timeout_s: float = 900) -> subprocess.CompletedProcess:
        """`ray job submit … -- python -m <argv>` through the head's job server, as docs/DEPLOY.md says; the
        job's driver runs this interpreter and its workers import this checkout (PYTHONPATH): the test's
        stand-in for `--working-dir .` on nodes that have qvpic's environment installed."""
        runtime_env = {"env_vars": {"PYTHONPATH": str(REPO), **self.s3_env()}}
        command = [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", self.dashboard_url,
                   "--runtime-env-json", json.dumps(runtime_env), "--", sys.executable, "-m", *argv]
        return subprocess.run(command, env=self.driver_env, capture_output=True, text=True, timeout=timeout_s)

    def qvpic(self, *argv: str, timeout_s: float = 300, env: dict[str, str] | None = None
              ) -> subprocess.CompletedProcess:
        """`qvpic <argv>` as a driver joining the cluster from this machine (`env`: added to the driver's)."""
        return subprocess.run([sys.executable, "-m", "jobs.cli", *argv], env={**self.driver_env, **(env or {})},
                              cwd=REPO, capture_output=True, text=True, timeout=timeout_s)

    def s3_env(self) -> dict[str, str]:
        return {k: v for k, v in self.driver_env.items() if k.startswith("AWS_")}

    def node_kinds(self) -> dict[str, str]:
        """Ray node id → "head" or "gpu" of every live node."""
        import ray

        return {n["NodeID"]: "gpu" if n["Resources"].get("GPU") else "head" for n in ray.nodes() if n["Alive"]}


@dataclass
class Outcome:
    started_s: float  # since the load's start
    ended_s: float
    result: int | str  # HTTP status, or the client error's name (a reset connection; ReadTimeout: a hang)


@dataclass
class Load:
    """Client threads each sending distinct non-streaming `/v1/answer` requests (no two alike, so no response
    cache answers them) one after another until stopped, each with a deadline the client outwaits; every
    outcome kept."""

    url: str
    query: str
    max_new_tokens: int
    deadline_s: float = 60.0
    outcomes: list[Outcome] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    t0: float = field(default_factory=time.monotonic)
    threads: list[threading.Thread] = field(default_factory=list)
    numbers: Iterator[int] = field(default_factory=itertools.count)

    def add_clients(self, n: int) -> None:
        for _ in range(n):
            thread = threading.Thread(target=self._client, daemon=True)
            thread.start()
            self.threads.append(thread)

    def _client(self) -> None:
        import httpx

        with httpx.Client(timeout=self.deadline_s + 15) as client:
            while not self.stop.is_set():
                body = {"query": f"{self.query} ({next(self.numbers)})", "max_new_tokens": self.max_new_tokens,
                        "top_k": 2, "timeout_s": self.deadline_s}
                started = time.monotonic() - self.t0
                try:
                    result: int | str = client.post(f"{self.url}/v1/answer", json=body).status_code
                except httpx.HTTPError as error:
                    result = type(error).__name__
                self.outcomes.append(Outcome(started, time.monotonic() - self.t0, result))

    def finish(self) -> list[Outcome]:
        """Stops the clients once their requests in flight end; every outcome, in the order they started."""
        self.stop.set()
        for thread in self.threads:
            thread.join()
        return sorted(self.outcomes, key=lambda o: o.started_s)


def node_env(scratch: Path) -> dict[str, str]:
    scratch.mkdir(parents=True, exist_ok=True)
    (scratch / "serving").mkdir(exist_ok=True)
    return {"TMPDIR": str(scratch), "QVPIC_SERVING_CACHE": str(scratch / "serving")}


def keep_on_loopback() -> None:
    """For this process (Ray read the switch on import) and every one it starts."""
    from ray._private import ray_constants

    os.environ.update(LOOPBACK_ENV)
    ray_constants.ENABLE_RAY_CLUSTER = False


def start_cluster(s3: S3Server, scratch: Path) -> RayCluster:
    """The head, then two GPU workers; the calling process joins as a driver."""
    import ray
    from ray.cluster_utils import Cluster

    keep_on_loopback()

    dashboard_port = free_port()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": HEAD_CPUS, "num_gpus": 0, "node_ip_address": LOOPBACK, "object_store_memory": OBJECT_STORE_NBYTES,
        "include_dashboard": True, "dashboard_host": LOOPBACK, "dashboard_port": dashboard_port,
        "dashboard_agent_listen_port": free_port(), "gcs_server_port": free_port(),
        "env_vars": node_env(scratch / "head"),
    })
    env = {**os.environ, "RAY_ADDRESS": cluster.address, "PYTHONPATH": str(REPO)}
    made = RayCluster(cluster, s3, f"http://{LOOPBACK}:{dashboard_port}", scratch, driver_env=env)
    for name in ("gpu-a", "gpu-b"):
        made.add_gpu_worker(name)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, _node_ip_address=LOOPBACK, log_to_driver=False)
    wait_job_server(made.dashboard_url)
    return made


def wait_job_server(url: str, timeout_s: float = 60) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/api/version", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the job server at {url} did not answer within {timeout_s:g} s")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def ray_cluster(s3_server, tmp_path_factory) -> Iterator[RayCluster]:  # noqa: F811  (s3_server is a fixture)
    import ray
    from ray import serve
    from ray._private import ray_constants

    local = ray.is_initialized()  # the session's local Ray (tests/support/ray_fixtures.py), set aside meanwhile
    if local:
        serve.shutdown()  # drops Serve's client of that Ray too
        ray.shutdown()
    saved = ({k: os.environ.get(k) for k in LOOPBACK_ENV}, ray_constants.ENABLE_RAY_CLUSTER)
    made = start_cluster(s3_server, tmp_path_factory.mktemp("nodes"))
    try:
        yield made
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            made.cluster.shutdown()
            for key, value in saved[0].items():
                os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
            ray_constants.ENABLE_RAY_CLUSTER = saved[1]
            if local:
                init_local_ray()
