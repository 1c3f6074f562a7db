"""TTFT through the whole online path: HTTP → ingress → router → ingress → generator on a loopback Serve app.

What the online path adds to the query prefill (query embedding and routing, the device hot tier's
lookup — after the warm-up the chunks are resident, so the loader is not called and no KV moves —
assembly and re-anchoring, the Serve hops, HTTP, JSON) is measured as a share of the client's TTFT:
`1 − prefill_ms / client_ms` per request, with `prefill_ms` the query prefill's forward as the generator
timed it, in the same request. One new token per request, so the client's wait is the time to the
first token.

Next to it, in the same run, the limit the Serve graph allows: the same request body through no-op
deployments of the same topology (HTTP → a FastAPI ingress → "router" → ingress → "generator", each
replying at once), and the query embedding timed alone in this process. Their sum with the re-anchor
is the fixed cost no engine work removes on this machine.
"""

from __future__ import annotations

import socket
import statistics
import time
from dataclasses import dataclass

import httpx
import torch
from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from schemas.api import AnswerRequest
from schemas.config import ModelSpec
from schemas.modes import Mode

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
    serve_floor_ms: float  # the same hops through no-op deployments, HTTP and JSON included
    embed_ms: float  # the query's embedding alone (the router's model, one thread)

    @property
    def floor_share(self) -> float:
        """The share the online path would have if it cost only the Serve hops, the query embedding
        and the re-anchor: what this machine allows with this graph."""
        fixed = self.serve_floor_ms + self.embed_ms + self.reanchor_ms
        return fixed / (fixed + self.prefill_ms)


def loopback_port() -> int:
    """A free port the OS picks (its ephemeral range is above Ray's worker ports, 10002-19999)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def measure(store_uri: str, model: ModelSpec, chunk_ids: list[str], query: str, repeats: int,
            mode: Mode = Mode.QVPIC) -> HttpTtft:
    import ray

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
            "ingress": {"governance": {"response_cache": {"levels": []}}}}
    serve.run(build_app(args), name=APP_NAME, route_prefix="/")
    body = {"query": query, "chunk_ids": chunk_ids, "mode": mode.value, "max_new_tokens": 1}
    serve.run(floor_app(), name=FLOOR_APP, route_prefix=FLOOR_PREFIX)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
            for _ in range(2):  # warm-up: the LRU fills, first-call costs are paid
                _post(client, body)
                client.post(FLOOR_PREFIX + "/", json=body).raise_for_status()
            runs, floor = [], []
            for _ in range(repeats):  # interleaved: both see the same machine
                started = time.perf_counter()
                reply = _post(client, body)
                runs.append(((time.perf_counter() - started) * 1e3, reply))
                started = time.perf_counter()
                client.post(FLOOR_PREFIX + "/", json=body).raise_for_status()
                floor.append((time.perf_counter() - started) * 1e3)
    finally:
        serve.shutdown()
        if started_ray:
            ray.shutdown()

    def median(key: str) -> float:
        return statistics.median(reply["timings"][key] for _, reply in runs)

    return HttpTtft(len(chunk_ids), mode, statistics.median(ms for ms, _ in runs), median("route_ms"),
                    median("load_ms"), median("reanchor_ms"), median("prefill_ms"),
                    statistics.median(1 - reply["timings"]["prefill_ms"] / ms for ms, reply in runs),
                    runs[-1][1]["usage"]["context_tokens"], statistics.median(floor), embed_alone_ms(query, repeats))


def embed_alone_ms(query: str, repeats: int) -> float:
    from pipeline.runtime import Embedder

    embedder, threads = Embedder(), torch.get_num_threads()
    torch.set_num_threads(1)  # what the router replica gets (Ray sets OMP_NUM_THREADS=1 below one CPU)
    try:
        times = []
        for _ in range(repeats + 2):
            started = time.perf_counter()
            embedder.embed([query])
            times.append((time.perf_counter() - started) * 1e3)
        return statistics.median(times[2:])
    finally:
        torch.set_num_threads(threads)


# ---- the limit: the same topology with deployments that do nothing -------------------------------------
FLOOR_APP, FLOOR_PREFIX = "qvpic-ttft-floor", "/floor"


@serve.deployment(ray_actor_options={"num_cpus": 0.1})
class NoopRouter:
    async def plan(self, request: AnswerRequest) -> dict:
        return {"query": request.query, "chunk_ids": request.chunk_ids}


@serve.deployment(ray_actor_options={"num_cpus": 0.1})
class NoopGenerator:
    async def generate(self, plan: dict) -> dict:
        return {"answer": "", "chunks": len(plan["chunk_ids"])}


@serve.deployment(ray_actor_options={"num_cpus": 0.1})
@serve.ingress()
class NoopIngress:
    """Built like serve/http/ingress.py (the app made in the replica), validating the same request model."""

    def __init__(self, router: DeploymentHandle, generator: DeploymentHandle):
        self.router, self.generator = router, generator

    def __serve_build_asgi_app__(self) -> FastAPI:
        return floor_api(self.router, self.generator)


def floor_api(router: DeploymentHandle, generator: DeploymentHandle) -> FastAPI:
    """A module-level builder, as serve/http/ingress.py's `make_api`: the decorated class is pickled by value,
    and a handler defined in it would lose the module globals its string annotations name."""
    api = FastAPI()

    @api.post("/")
    async def answer(request: AnswerRequest) -> dict:
        return await generator.generate.remote(await router.plan.remote(request))

    return api


def floor_app():
    return NoopIngress.bind(NoopRouter.bind(), NoopGenerator.bind())


def _post(client: httpx.Client, body: dict) -> dict:
    response = client.post("/v1/answer", json=body, headers={"Cache-Control": "no-cache"})  # time model work
    if response.status_code != 200:
        raise RuntimeError(f"/v1/answer answered {response.status_code}: {response.text[:300]}")
    reply = response.json()
    if reply.get("cache_hit"):
        raise RuntimeError("a response cache answered: the measurement needs every request to run the model")
    return reply
