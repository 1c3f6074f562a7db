"""A generator replica lost under load (issue 58), on vLLM's engine as on qvpic's: the Serve graph with two generator
replicas, the one holding a stream that has sent text and answers that have sent nothing killed (SIGKILL of its actor
process, where vLLM runs in-process: what a node's loss does to it). The answers are retried on the other replica
(serve/http/backend.py, counted in qvpic_replica_retries_total) and answered 200; the stream ends with an error event
in OpenAI's shape, a 503, never retried (the client has text); nothing hangs; Serve replaces the replica and the
service answers. tests/cluster/test_cluster.py loses a whole node on qvpic's engine (and tests/e2e/test_faults.py
kills its replicas under load); this runs the scenario on vLLM's, in one local Ray (`params` takes "qvpic" too: the
two engines side by side, ~2.5 min more, run by hand).

Runs where vLLM imports (`make test-vllm`); skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("vllm")

from tests.serve.engine.vllm.conftest import KV_NBYTES, MODEL  # noqa: E402
from tests.support.ray_fixtures import free_port, ray_session  # noqa: E402, F401  (a fixture)
from tests.support.serve_probes import (  # noqa: E402
    live_replicas,
    replica_retries,
    replicas_running,
    wait_for,
)

pytestmark = [pytest.mark.vllm, pytest.mark.nightly]
APP = "qvpic-faults"
QUESTION = "When does part XK-4471-B ship?"
# One selection for every request: the generator's chunk-affinity dispatch sends them to the replica that holds it,
# so the stream and the answers beside it share the replica that is lost.
SELECTION = {"qvpic": {"chunk_ids": ["invoices#00000", "manual#00001"]}}
# oracle-qwen's random weights decode to max_tokens: the answers decode for seconds, the stream outlasts the loss
PLAINS, PLAIN_TOKENS, STREAM_TOKENS = 3, 256, 4096
REQUEST_TIMEOUT_S = 120  # the bound on every request: a hang is an httpx timeout, reported by name
RESTART_WAIT_S = 180  # Serve notices the dead replica and starts another: vLLM's start (~30 s here) on 2 cores


def chat(**fields) -> dict:
    return {"model": "qvpic", "messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
            **SELECTION, **fields}


@pytest.fixture(scope="module", params=["vllm"])
def served(request, ray_session, store_uri):  # noqa: F811  (ray_session is a fixture)
    from ray import serve

    from serve.app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port},
                logging_config={"log_level": "WARNING", "enable_access_log": False})
    args = {"store": {"uri": store_uri}, "model": MODEL.model_dump(mode="json"), "router": {"max_chunks": 3},
            "generator": {"engine": {"kind": request.param, "max_batch_size": 8, "max_kv_nbytes": KV_NBYTES}},
            "generator_deployment": {"num_replicas": 2}, "ingress": {"default_top_k": 2}}
    serve.run(build_app(args), name=APP, route_prefix="/")  # returns once both generators run
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


class Stream:
    """A streamed chat completion read in a thread: `started` is set at its first text, `last` is its last event
    before `[DONE]` once `thread` ends."""

    def __init__(self, url: str):
        self.url, self.started, self.last = url, threading.Event(), {}
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=chat(max_tokens=STREAM_TOKENS, stream=True),
                          headers={"Cache-Control": "no-cache"}, timeout=REQUEST_TIMEOUT_S) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    self.last = json.loads(line.removeprefix("data: "))
                    if any(c["delta"].get("content") for c in self.last.get("choices", ())):
                        self.started.set()


def plain(url: str, i: int) -> int | str:
    """A whole chat completion's status (a hang or a reset connection: the error's name)."""
    try:
        response = httpx.post(f"{url}/v1/chat/completions", json=chat(max_tokens=PLAIN_TOKENS, seed=i),
                              headers={"Cache-Control": "no-cache"}, timeout=REQUEST_TIMEOUT_S)
    except httpx.HTTPError as error:
        return type(error).__name__
    return response.status_code


def test_a_generator_replica_lost_under_load_costs_a_retry_or_a_clean_503(served):
    assert replicas_running(APP, "Generator") == 2
    originals = {replica.name for replica in live_replicas(APP, "Generator")}
    before = replica_retries(served)
    stream = Stream(served)
    assert stream.started.wait(60), stream.last
    seen: dict[str, int] = {}

    def in_flight() -> dict[str, int]:
        seen.clear()
        seen.update({replica.name: replica.ongoing_requests() for replica in live_replicas(APP, "Generator")})
        return seen

    assert wait_for(lambda: sum(in_flight().values()) == 1, 30), seen
    (lost,) = [name for name, n in seen.items() if n == 1]  # the stream alone is in flight: it is there
    (pid,) = [replica.pid for replica in live_replicas(APP, "Generator") if replica.name == lost]
    with ThreadPoolExecutor(PLAINS) as pool:
        plains = [pool.submit(plain, served, i) for i in range(PLAINS)]
        # the stream and at least one answer that has sent nothing (none is streamed) on the replica to lose
        assert wait_for(lambda: in_flight().get(lost, 0) >= 2, 30, poll_s=0.05), seen
        os.kill(pid, signal.SIGKILL)
        statuses = Counter(f.result() for f in plains)
    stream.thread.join(REQUEST_TIMEOUT_S)
    retried = replica_retries(served)
    retried.subtract(before)
    assert statuses == Counter({200: PLAINS}), statuses
    assert retried["generate"] >= 1 and retried["stream"] == 0, retried
    assert not stream.thread.is_alive(), "the stream hung after its replica died"
    error = stream.last.get("error") or {}  # OpenAI's shape: the client raises it as an APIError
    assert (error.get("type"), error.get("code")) == ("server_error", "service_unavailable"), stream.last
    assert "retry" in error["message"], error
    lost_at = time.monotonic()
    # Serve replaces the lost replica (a new one runs: the controller may count the dead one as running for a
    # health check's period), and the service answers
    assert wait_for(lambda: replicas_running(APP, "Generator") == 2
                    and not {r.name for r in live_replicas(APP, "Generator")} <= originals, RESTART_WAIT_S), originals
    assert [plain(served, PLAINS + i) for i in range(2)] == [200, 200]
    print(f"plain answers {dict(statuses)}, retries {dict(retried)}, stream's end {error['code']}, "
          f"replaced in {time.monotonic() - lost_at:.0f} s")
