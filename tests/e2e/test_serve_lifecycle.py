"""How the served application starts and stops, on real local Rays: a deployment that cannot be placed
makes readiness 503 and requests fail fast (not hang) until it can; `qvpic serve` refuses a local
deployment no node can host, and on SIGTERM finishes in-flight streams, then exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support.paths import REPO
from tests.support.ray_fixtures import free_port, ray_session  # noqa: F401  (fixture)
from tests.support.store_factory import MAX_CHUNKS, serving_store  # noqa: F401  (fixture)

pytestmark = pytest.mark.e2e
QUERY = "When does part XK-4471-B ship?"
ANSWER = {"query": QUERY, "top_k": 1, "max_new_tokens": 2}
START_TIMEOUT_S = 300  # Serve start-up and model loads on a busy 2-core machine
REQUEST_TIMEOUT_S = 60  # a request that hangs (what an unplaceable deployment used to cause) fails the test


def wait_for(condition, timeout_s: float, what: str, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (value := condition()) is not None:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def status_of(http: httpx.Client, path: str) -> int | None:
    try:
        return http.get(path).status_code
    except httpx.TransportError:
        return None


@pytest.fixture(scope="module")
def base_url(ray_session):
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port},
                logging_config={"log_level": "WARNING", "enable_access_log": False})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def test_a_deployment_that_cannot_be_placed_fails_requests_fast_until_it_can(base_url, serving_store):
    from ray import serve

    from serve.app import build_app

    args = {"store": {"uri": serving_store.uri}, "model": serving_store.model.model_dump(mode="json"),
            "router": {"max_chunks": MAX_CHUNKS}, "ingress": {"default_top_k": 1},
            "generator_deployment": {"num_gpus": 2}}  # the test Ray has one (logical) GPU
    # serve.run would wait for every deployment to run: forever, here
    serve.run_many([serve.RunTarget(build_app(args), name="unplaceable", route_prefix="/")],
                   wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
    with httpx.Client(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as http:
        wait_for(lambda: status_of(http, "/healthz") == 200 or None, START_TIMEOUT_S, "the ingress")

        def only_generator_pending():
            report = http.get("/readyz").json()
            return report if report.get("pending") == ["Generator"] else None

        report = wait_for(only_generator_pending, START_TIMEOUT_S, "every deployment but the generator")
        assert http.get("/readyz").status_code == 503 and not report["ready"]
        (generator,) = [d for d in report["deployments"] if d["name"] == "Generator"]
        assert generator["unplaceable"] and generator["running_replicas"] == 0
        assert "GPU 2 on one node and no node has that (the cluster has" in generator["reason"]

        answer = http.post("/v1/answer", json=ANSWER)  # used to wait for a replica forever
        assert answer.status_code == 503 and answer.headers["retry-after"]
        assert answer.json()["detail"].startswith("not ready: Generator: one replica needs")
        chat = http.post("/v1/chat/completions", json={"model": "qvpic", "max_tokens": 2,
                                                       "messages": [{"role": "user", "content": QUERY}]})
        assert chat.status_code == 503 and chat.json()["error"]["code"] == "service_unavailable"
        assert "Generator" in chat.json()["error"]["message"]
        assert http.get("/healthz").status_code == 200 and http.get("/v1/models").status_code == 200  # live, not ready

        serve.run(build_app({**args, "generator_deployment": {"num_gpus": 1}}), name="unplaceable", route_prefix="/")
        wait_for(lambda: status_of(http, "/readyz") == 200 or None, START_TIMEOUT_S, "readiness")
        assert http.get("/readyz").json()["pending"] == []
        assert http.post("/v1/answer", json=ANSWER).status_code == 200
    serve.delete("unplaceable")


def serve_process(store_uri: str, port: int, logs: Path, *flags: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "jobs.run_server", "--store", store_uri, "--model", "tiny-qwen", "--device", "cpu",
               "--port", str(port), "--num-cpus", "4", *flags]
    return subprocess.Popen(command, cwd=REPO, stdout=(logs / "stdout").open("w"), stderr=(logs / "stderr").open("w"))


def test_qvpic_serve_refuses_a_deployment_no_local_node_can_host(serving_store, tmp_path):
    server = serve_process(serving_store.uri, free_port(), tmp_path, "--generator-gpus", "1")
    assert server.wait(timeout=START_TIMEOUT_S) == 2
    stderr = (tmp_path / "stderr").read_text()
    expected = "qvpic serve: cannot deploy: Generator: one replica needs CPU 0.1, GPU 1 on one node"
    assert expected in stderr, stderr[-3000:]
    assert "--generator-gpus 0" in stderr


class Stream(threading.Thread):
    """One streamed /v1/answer, read event by event."""

    def __init__(self, base_url: str, max_new_tokens: int):
        super().__init__(daemon=True)
        self.base_url, self.max_new_tokens = base_url, max_new_tokens
        self.events: list[dict] = []
        self.started = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"query": QUERY, "top_k": 1, "max_new_tokens": self.max_new_tokens, "stream": True}
        try:
            with httpx.stream("POST", f"{self.base_url}/v1/answer", json=body, timeout=START_TIMEOUT_S) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(json.loads(line.removeprefix("data: ")))
                        self.started.set()
        except BaseException as error:  # noqa: BLE001  reported by the test
            self.error = error
        finally:
            self.started.set()

    def done(self) -> bool:
        return bool(self.events) and self.events[-1]["type"] == "done"


def ray_workers_niceness(root_pid: int) -> dict[str, int]:
    """The niceness of each Ray worker (a `ray::` process title) descended from `root_pid`, by title: this server's
    own Ray, not another test's."""
    parent, title = {}, {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat, cmdline = Path(f"/proc/{entry}/stat").read_text(), Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:  # ended meanwhile
            continue
        parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state
        title[int(entry)] = cmdline.split(b"\0")[0].decode(errors="replace")

    def descends(pid: int) -> bool:
        while pid > 1 and pid != root_pid:
            pid = parent.get(pid, 0)
        return pid == root_pid

    return {title[pid]: os.getpriority(os.PRIO_PROCESS, pid) for pid in title
            if title[pid].startswith("ray::") and descends(pid)}


def test_sigterm_drains_in_flight_streams_then_exits_0(serving_store, tmp_path):
    """And, while it serves: its Ray's workers (the replicas, Serve's proxy) run at niceness 0, not Ray's default 15,
    so work the roles lower by BULK_NICE is lowered in full (jobs/cluster.py, pipeline/priority.py; issue 60)."""
    port = free_port()
    server = serve_process(serving_store.uri, port, tmp_path, "--drain-timeout-s", "120")
    try:
        wait_for(lambda: "qvpic: serving" in (tmp_path / "stdout").read_text() or None, START_TIMEOUT_S, "qvpic serve")
        workers = ray_workers_niceness(server.pid)
        assert any("ServeReplica" in name for name in workers) and any("Proxy" in name for name in workers), workers
        assert set(workers.values()) == {0}, workers
        streams = [Stream(f"http://127.0.0.1:{port}", max_new_tokens=512) for _ in range(2)]  # seconds of decoding
        for stream in streams:
            stream.start()
        for stream in streams:
            assert stream.started.wait(START_TIMEOUT_S) and stream.error is None, stream.error
        in_flight = [not stream.done() for stream in streams]
        server.send_signal(signal.SIGTERM)
        assert all(in_flight), "the streams ended before SIGTERM: make them longer"
        for stream in streams:
            stream.join(START_TIMEOUT_S)
        assert server.wait(timeout=START_TIMEOUT_S) == 0  # was -6: Ray's signal handler aborted the process
    finally:
        if server.poll() is None:
            server.kill()
    for stream in streams:
        assert stream.error is None and stream.done(), (stream.error, stream.events[-1:])
        assert stream.events[-1]["response"]["usage"]["completion_tokens"] > 0
    stderr = (tmp_path / "stderr").read_text()
    assert "qvpic serve: SIGTERM: draining in-flight requests" in stderr and "qvpic serve: stopped" in stderr
    assert "Aborted" not in stderr and "SIGTERM received" not in stderr, stderr[-3000:]
