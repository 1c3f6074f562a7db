"""The two servers of benchmarks/peer/speed.py, up together, and qvpic's in-process figures.

qvpic: the Serve app on a loopback port (as benchmarks/perf/ttft_http.py starts it: no response cache, the
generator given this process's torch threads of CPUs); vLLM: its OpenAI server from the peer venv, with the
same cores (benchmarks/peer/engine.py). Every round sends each qvpic mode, then each vLLM representation,
its request, one at a time, so both see the same machine; vLLM's processes are stopped while qvpic is timed
(`VLLMServer.paused`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from benchmarks.peer import engine, serve_floor
from benchmarks.peer.vllm_side import messages
from benchmarks.perf.batching import run_level
from benchmarks.perf.ttft_http import loopback_port
from pipeline.runtime import in_passing_thread, resolve_path
from schemas.api import AnswerRequest
from schemas.config import ModelSpec
from schemas.modes import Mode
from schemas.sampling import Sampling
from serve.engine.qvpic.batch import decode_step, prefill_queries

LINKED_MODES = (Mode.QVPIC, Mode.TEXT_PIC)  # the modes that link cached KV: their TTFT is the one compared
SERVER_START_S = 900  # vLLM's engine start (weights, warm-up compile) on a loaded 2-core machine


def start_serve() -> str:
    """Serve started on this process's Ray (a private local one unless attached), its HTTP proxy on a free
    loopback port, access log off: the proxy's base URL."""
    from ray import serve

    from jobs.cluster import init_ray

    init_ray()
    port = loopback_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port},
                logging_config={"log_level": "WARNING", "enable_access_log": False})
    return f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def qvpic_server(spec: ModelSpec, store_uri: str) -> Iterator[str]:
    import ray
    from ray import serve

    from serve.app import build_app

    url = start_serve()
    num_cpus = min(float(torch.get_num_threads()), ray.cluster_resources().get("CPU", 1.0) - 0.5)
    args = {"store": {"uri": store_uri}, "model": spec.model_dump(mode="json"),
            "generator_deployment": {"num_gpus": 0.0, "num_cpus": num_cpus},
            "ingress": {"governance": {"response_cache": {"levels": []}}}}
    serve.run(build_app(args), name="qvpic-peer", route_prefix="/")
    try:
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


@dataclass
class VLLMServer:
    """vLLM's OpenAI server, which can be paused while qvpic is timed: idle beside qvpic's server it still
    slowed qvpic's query prefill ~2× (236 ms alone, 497 ms beside it, the same requests). `paused` stops vLLM's
    process group (SIGSTOP); qvpic's Ray processes keep running while vLLM is timed, since Ray's health checks
    would declare a stopped node dead."""

    url: str
    process: subprocess.Popen

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        os.killpg(self.process.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.killpg(self.process.pid, signal.SIGCONT)


@contextlib.contextmanager
def vllm_server(spec: ModelSpec, max_images: int, log_path, extra: tuple[str, ...] = (), python: Path | None = None,
                env: dict[str, str] | None = None) -> Iterator[VLLMServer]:
    """`python`: the interpreter with vLLM (default the peer venv's); `env`: its environment (default
    `engine.peer_env` with this process's torch threads)."""
    port = loopback_port()
    command = [str(python or engine.PEER_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(resolve_path(spec)), "--dtype", spec.dtype.value, "--seed", "0",
               "--max-model-len", str(engine.MAX_MODEL_LEN), "--enable-prefix-caching", "--host", "127.0.0.1",
               "--port", str(port), "--limit-mm-per-prompt", json.dumps({"image": max_images, "video": 0}),
               "--mm-processor-kwargs", json.dumps({"min_pixels": spec.min_pixels, "max_pixels": spec.max_pixels}),
               *extra]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=env or engine.peer_env(torch.get_num_threads()))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(open(log_path).read().splitlines()[-20:])
                raise RuntimeError(f"vLLM's server did not come up (exit {proc.poll()}):\n{tail}")
            time.sleep(2)
        yield VLLMServer(url, proc)
    finally:
        os.killpg(proc.pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(timeout=60)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def measure(spec: ModelSpec, corpus, loads, max_images: int, modes, representations, log_path) -> dict:
    """{(engine, workload, mode or representation): {"ms": [...], "tokens": [...], "timings": [...]}} over
    HTTP, interleaved; `timings`: qvpic's own account of each request (schemas.report.Timings), vLLM's empty.
    Engine "serve", mode "floor": Ray Serve's own cost of a request of qvpic's topology (serve_floor.py), sent
    after qvpic's modes each round; its `timings` are the floor ingress's (`serve_floor.HOPS`)."""
    out = defaultdict(lambda: {"ms": [], "tokens": [], "timings": []})
    model = str(resolve_path(spec))
    with qvpic_server(spec, corpus.store_uri) as ours, vllm_server(spec, max_images, log_path) as vllm, \
            httpx.Client(timeout=600) as client:
        theirs = vllm.url
        serve_floor.deploy()  # beside qvpic's app: the same proxy, Ray processes and cores

        def ask_qvpic(chunks: list[int], mode: Mode) -> tuple[float, int, dict]:
            body = {"query": corpus.query, "chunk_ids": [corpus.chunk_ids[c] for c in chunks], "mode": mode.value,
                    "max_new_tokens": 1}
            with vllm.paused():
                started = time.perf_counter()
                reply = client.post(ours + "/v1/answer", json=body, headers={"Cache-Control": "no-cache"})
                ms = (time.perf_counter() - started) * 1e3
            reply.raise_for_status()
            if reply.json().get("cache_hit"):
                raise RuntimeError("a response cache answered: every request must run the model")
            return ms, reply.json()["usage"]["context_tokens"], reply.json()["timings"]

        def ask_floor(chunks: list[int]) -> tuple[float, int, dict]:
            with vllm.paused():
                ms, hops = serve_floor.ask(client, ours, {"query": corpus.query, "chunks": chunks})
            return ms, 0, hops

        def ask_vllm(chunks: list[int], representation: str) -> tuple[float, int, dict]:
            body = {"model": model, "messages": messages(corpus.parts(chunks, representation)), "max_tokens": 1,
                    "temperature": 0.0}
            started = time.perf_counter()
            reply = client.post(theirs + "/v1/chat/completions", json=body)
            ms = (time.perf_counter() - started) * 1e3
            reply.raise_for_status()
            return ms, reply.json()["usage"]["prompt_tokens"], {}

        for load in loads:
            for chunks in load.warm:  # both engines warm on the same requests
                for mode in modes:
                    ask_qvpic(chunks, mode)
                for rep in representations:
                    ask_vllm(chunks, rep)
                ask_floor(chunks)
            for chunks in load.requests:
                for key, ask in [(("qvpic", m.value), lambda c, m=m: ask_qvpic(c, m)) for m in modes] + \
                                [(("serve", "floor"), ask_floor)] + \
                                [(("vllm", r), lambda c, r=r: ask_vllm(c, r)) for r in representations]:
                    ms, tokens, timings = ask(chunks)
                    cell = out[(key[0], load.name, key[1])]
                    cell["ms"].append(ms)
                    cell["tokens"].append(tokens)
                    cell["timings"].append(timings)
    return dict(out)


def in_process_qvpic(spec: ModelSpec, corpus, loads, modes, decode_sets, new_tokens: int, concurrency) -> dict:
    """qvpic in this process (router, loader, batched generator: serve/local.py `build_local`): TTFT per workload ×
    mode (the route included), and decode tokens/s on `decode_sets` in `qvpic` mode at each concurrency."""
    from serve import build_local

    # Every phase on a thread that ends, the floor first: a thread of this script that kept an OpenMP pool beside
    # the engine's would slow every forward ~1.4x (pipeline/runtime/threads.py), as served replicas no longer are
    stack = in_passing_thread(build_local, {"store": corpus.store_uri, "model": spec.model_dump(),
                                            "router": {"max_chunks": max(64, len(corpus.chunk_ids))},
                                            "loader": {"max_nbytes": 4 << 30}})
    router, generator = stack.router, stack.generator
    one = Sampling(max_new_tokens=1)

    def request(chunks: list[int], mode: Mode, tokens: int) -> AnswerRequest:
        return AnswerRequest(query=corpus.query, chunk_ids=[corpus.chunk_ids[c] for c in chunks], mode=mode,
                             max_new_tokens=tokens)

    def answer(chunks: list[int], mode: Mode) -> float:
        started = time.perf_counter()
        generator.generate_blocking(asyncio.run(router.plan(request(chunks, mode, 1))), one)
        return (time.perf_counter() - started) * 1e3

    floor = {(load.name, mode.value): in_passing_thread(forward_floor, generator, router,
                                                        [request(c, mode, 1) for c in load.requests])
             for load in loads for mode in modes if mode in LINKED_MODES}  # before the engine's pool exists
    ttft = {}
    for load in loads:
        for mode in modes:
            for chunks in load.warm:
                in_passing_thread(answer, chunks, mode)
            ttft[(load.name, mode.value)] = {"ms": [in_passing_thread(answer, chunks, mode)
                                                    for chunks in load.requests]}
    plans = in_passing_thread(lambda: [asyncio.run(router.plan(request(chunks, Mode.QVPIC, new_tokens)))
                                       for chunks in decode_sets])
    sampling = Sampling(max_new_tokens=new_tokens)
    for plan in plans:  # warm: every chunk on the device hot tier, as vLLM's prompts are in its prefix cache
        in_passing_thread(generator.generate_blocking, plan, one)

    def decode_at(level: int) -> float:
        return asyncio.run(run_level(generator.stream, plans, level, sampling, "qvpic")).tokens_per_s

    decode = {level: in_passing_thread(decode_at, level) for level in concurrency}
    stack.close()
    return {"ttft": ttft, "decode": decode, "floor": floor}


def forward_floor(generator, router, requests: list[AnswerRequest]) -> dict:
    """The engine's forwards alone over each request's assembled context (routing, loading and re-anchoring
    done beforehand and untimed), through the path the served engine takes (serve/engine/qvpic/batch.py): the
    query turn's prefill over `[serving prefix][chunks]` (the floor of a linked mode's TTFT in this engine) and
    then a one-token step over the same slab (reading every weight once: the floor of any forward of this
    checkpoint on this machine), ms per request, and the query turn's tokens."""
    vlm, out = generator.vlm, {"query_ms": [], "one_token_ms": [], "query_tokens": []}
    for request in requests:
        plan = asyncio.run(router.plan(request))
        linked = asyncio.run(generator.contexts.build(plan, generator.source)).prefill  # a LinkedContext
        chunks, ids = linked.chunks, linked.query_ids

        prefill_timed(vlm, chunks, ids)  # warm: the first forward at a new length pays more
        slab, logits, ms = prefill_timed(vlm, chunks, ids)
        out["query_ms"].append(ms)
        started = time.perf_counter()
        decode_step(vlm, slab, [int(logits[0].argmax())])  # one decode step over the same context
        out["one_token_ms"].append((time.perf_counter() - started) * 1e3)
        out["query_tokens"].append(len(ids))
    return out


def prefill_timed(vlm, chunks, ids: list[int]):
    """The engine's prefill of one query over `[serving prefix][chunks]`, a reserve of one column: the slab, the
    logits `[1, vocab]`, and the forward's ms (the assembly into the slab not counted)."""
    started = time.perf_counter()
    slab, logits, (assembly_ms,) = prefill_queries(vlm, [vlm.prefix], [chunks], [ids], [1])
    return slab, logits, (time.perf_counter() - started) * 1e3 - assembly_ms
