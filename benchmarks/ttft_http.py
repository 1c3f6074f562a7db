"""TTFT through the whole online path: HTTP → ingress → router → ingress → generator on a loopback Serve app.

What the online path adds to the query prefill (query embedding and routing, the device hot tier's
lookup — after the warm-up the chunks are resident, so the loader is not called and no KV moves —
assembly and re-anchoring, the Serve hops, HTTP, JSON) is measured as a share of the client's TTFT:
`1 − prefill_ms / client_ms` per request, with `prefill_ms` the query prefill's forward as the generator
timed it, in the same request. One new token per request, so the client's wait is the time to the
first token.
"""

from __future__ import annotations

import socket
import statistics
import time
from dataclasses import dataclass

import httpx
import torch

from schemas.config import Mode, ModelSpec

APP_NAME = "qvpic-ttft"


@dataclass(frozen=True)
class HttpTtft:
    num_chunks: int
    mode: Mode
    client_ms: float  # medians over the repeats
    route_ms: float
    load_ms: float
    reanchor_ms: float
    prefill_ms: float
    overhead_share: float  # median of 1 − prefill_ms / client_ms
    context_tokens: int


def loopback_port() -> int:
    """A free port the OS picks (its ephemeral range is above Ray's worker ports, 10002-19999)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def measure(store_uri: str, model: ModelSpec, chunk_ids: list[str], query: str, repeats: int,
            mode: Mode = Mode.QVPIC) -> HttpTtft:
    import ray
    from ray import serve

    from jobs.cluster import init_ray
    from serve.app import build_app

    started_ray = not ray.is_initialized()
    init_ray()
    gpus = 1.0 if model.device.startswith("cuda") else 0.0  # Ray hides GPUs from actors that reserve none
    port = loopback_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port},
                logging_config={"log_level": "WARNING", "enable_access_log": False})
    # The generator gets as many CPUs as this process has torch threads: Ray sets a replica's
    # OMP_NUM_THREADS from its CPU reservation, and the in-process figures ran with these threads.
    # (less room for the other three deployments' 0.1 each, or the replica would never be placed)
    num_cpus = min(float(torch.get_num_threads()), ray.cluster_resources().get("CPU", 1.0) - 0.5)
    # No response cache: repeats of one request must each run the KV path, which is what is measured.
    args = {"store": {"uri": store_uri}, "model": model.model_dump(mode="json"),
            "generator_deployment": {"num_gpus": gpus, "num_cpus": num_cpus},
            "governance": {"response_cache": {"levels": []}}}
    serve.run(build_app(args), name=APP_NAME, route_prefix="/")
    body = {"query": query, "chunk_ids": chunk_ids, "mode": mode.value, "max_new_tokens": 1}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
            for _ in range(2):  # warm-up: the LRU fills, first-call costs are paid
                _post(client, body)
            runs = []
            for _ in range(repeats):
                started = time.perf_counter()
                reply = _post(client, body)
                runs.append(((time.perf_counter() - started) * 1e3, reply))
    finally:
        serve.shutdown()
        if started_ray:
            ray.shutdown()

    def median(key: str) -> float:
        return statistics.median(reply["timings"][key] for _, reply in runs)

    return HttpTtft(len(chunk_ids), mode, statistics.median(ms for ms, _ in runs), median("route_ms"),
                    median("load_ms"), median("reanchor_ms"), median("prefill_ms"),
                    statistics.median(1 - reply["timings"]["prefill_ms"] / ms for ms, reply in runs),
                    runs[-1][1]["usage"]["context_tokens"])


def _post(client: httpx.Client, body: dict) -> dict:
    response = client.post("/v1/answer", json=body, headers={"Cache-Control": "no-cache"})  # time model work
    if response.status_code != 200:
        raise RuntimeError(f"/v1/answer answered {response.status_code}: {response.text[:300]}")
    reply = response.json()
    if reply.get("cache_hit"):
        raise RuntimeError("a response cache answered: the measurement needs every request to run the model")
    return reply
