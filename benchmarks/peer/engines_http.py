"""benchmarks/peer/engines.py over HTTP: vLLM alone (its own OpenAI server), qvpic's engine, qvpic on vLLM.

    .venv-vllm/bin/python -m benchmarks.peer.engines_http            # bench-qwen, float32
    .venv-vllm/bin/python -m benchmarks.peer.engines_http --quick    # fewer requests

Needs the vLLM engine's venv (`make install-vllm`). One store of 8 synthetic chunks (benchmarks/tools/ttft_store.py),
three servers up together on loopback ports:
- **vLLM alone**: `vllm.entrypoints.openai.api_server` on the checkpoint, prefix caching on, the same cores
  (benchmarks/peer/engine.py `peer_env`); each request a chat of the chunks' page images (base64 PNG, at the tier
  qvpic routes each chunk to: `/v1/estimate` on qvpic's app, in full_image mode) and the question, as
  benchmarks/peer/vllm_side.py `messages` builds it;
- **qvpic's engine** and **qvpic on vLLM**: two Serve apps over the store in one Serve instance (route prefixes
  `/qvpic` and `/vllm`), `generator.engine.kind` qvpic and vllm, qvpic mode, no response cache, `Cache-Control:
  no-cache`, the chunks named in the `qvpic` extension field.
TTFT: a streamed chat completion, one new token, the time to its first content (or finish) event; each request
alone, the three sides in an order shuffled per request, after a warm-up; medians. vLLM's server is stopped
(SIGSTOP, servers.VLLMServer.paused) while a qvpic side is timed. Workloads as engines.py. Decode: 16 streams at
once, 32 new tokens each, their prompts warmed first: decoded tokens (usage, less each stream's first) over the
longest stream's time from its first token to its last.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from benchmarks.peer import engine, servers
from benchmarks.peer.engines import CHUNKS, PER_REQUEST, SIDES, command_line, workloads
from benchmarks.tools import ttft_store
from benchmarks.tools.machine import machine_line
from pipeline.eval import markdown_table, write_section
from pipeline.runtime import Renderer, in_passing_thread, resolve_path
from schemas.config import ModelSpec
from schemas.modes import Mode
from schemas.render import RenderSpec

APPS = {SIDES[1]: ("qvpic-engine", "/qvpic", "qvpic"), SIDES[2]: ("qvpic-vllm", "/vllm", "vllm")}
CHUNK_TOKENS, NEW_TOKENS, STREAMS = 96, 32, 16
MAX_IMAGES = 2 * PER_REQUEST  # vLLM's server: a chunk of ~96 tokens is one page (two for room)
FOLLOW_UP = "And what else does it say?"
READING = ("All three over HTTP on loopback, streamed; each ratio is a side's median over vLLM alone's on the same "
           "requests. vLLM alone is vLLM's own OpenAI server given the pages as images, so its TTFT includes its "
           "own image preprocessing and encoder; qvpic's sides route the request (query embedding), link the "
           "chunks' stored KV and prefill the question, through Serve's ingress, router and generator hops, which "
           "vLLM's single server does not pay. Identical requests are vLLM's best case (its prefix cache holds the "
           "whole prompt). vLLM's server is stopped while a qvpic side is timed (idle beside qvpic it slowed qvpic's "
           "prefill: benchmarks/peer/servers.py); qvpic's Ray processes stay up while vLLM alone is timed. The "
           "follow-up turn is a conversation's second turn, the history as text and 4 new chunks. Decode is vLLM's "
           "own continuous batching on both vLLM sides, after every decode prompt was sent once: each stream's "
           "tokens over the longest stream's first-to-last-token time, so no side's prefill counts. vLLM's server "
           "is an API process (HTTP, detokenising, each request's image preprocessing even when its prefix cache "
           "holds the image tokens) beside its engine's on the same cores: its decode sits well below the in-process "
           "figure of benchmarks.peer.engines. On a shared machine the medians move 2-5x between runs: compare the "
           "ratios of one run.\n")


@contextlib.contextmanager
def qvpic_apps(spec: ModelSpec, store_uri: str) -> Iterator[dict[str, str]]:
    """Both qvpic apps in one Serve instance: {side: its base URL}."""
    import ray
    from ray import serve

    from serve.app import build_app

    url = servers.start_serve()
    threads = torch.get_num_threads()
    try:
        for name, prefix, kind in APPS.values():
            args = {"store": {"uri": store_uri}, "model": spec.model_dump(mode="json"),
                    "router": {"max_chunks": PER_REQUEST},
                    # each generator the same torch threads as engines.py's in-process stacks (Ray's 4 logical CPUs
                    # could not reserve them twice beside the other deployments)
                    "generator": {"engine": {"kind": kind, "max_batch_size": STREAMS, "max_kv_nbytes": 2 << 30,
                                             "forward": {"threads": threads}}},
                    "generator_deployment": {"num_gpus": 0.0, "num_cpus": 1.0},
                    "ingress": {"default_top_k": PER_REQUEST, "governance": {"response_cache": {"levels": []}}}}
            serve.run(build_app(args), name=name, route_prefix=prefix)
        yield {side: url + prefix for side, (_, prefix, _) in APPS.items()}
    finally:
        serve.shutdown()
        ray.shutdown()


class Pages:
    """Each chunk's page images as data URLs, per tier, rendered as the store's chunks were."""

    def __init__(self, spec: ModelSpec, render: RenderSpec, chunk_ids: tuple[str, ...]):
        texts, _, _ = ttft_store.chunk_texts(spec, CHUNK_TOKENS, CHUNKS, 0)  # the store's texts, in its order
        self.texts, self.render, self.renderer = dict(zip(chunk_ids, texts)), render, Renderer(render)
        self.urls: dict[tuple[str, str], list[str]] = {}

    def __call__(self, chunk_id: str, tier: str) -> list[str]:
        if (chunk_id, tier) not in self.urls:
            urls = []
            for page in self.renderer.render(self.texts[chunk_id], self.render.tier(tier)).pages:
                buffer = io.BytesIO()
                page.save(buffer, format="PNG")
                urls.append("data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode())
            self.urls[(chunk_id, tier)] = urls
        return self.urls[(chunk_id, tier)]


class Sides:
    """One request, as each side takes it."""

    def __init__(self, client: httpx.Client, urls: dict[str, str], vllm: servers.VLLMServer, model: str,
                 pages: Pages):
        self.client, self.urls, self.vllm, self.model, self.pages = client, urls, vllm, model, pages
        self.tiers: dict[tuple[str, tuple[str, ...]], list[tuple[str, str]]] = {}

    def placed(self, query: str, chunk_ids: list[str]) -> list[tuple[str, str]]:
        """(chunk, tier) in context order, as qvpic routes the request in full_image mode."""
        key = (query, tuple(chunk_ids))
        if key not in self.tiers:
            reply = self.client.post(self.urls[SIDES[1]] + "/v1/estimate",
                                     json={"query": query, "chunk_ids": chunk_ids, "mode": Mode.FULL_IMAGE.value})
            reply.raise_for_status()
            self.tiers[key] = [(c["chunk_id"], c["tier"]) for c in reply.json()["chunks"]]
        return self.tiers[key]

    def body(self, side: str, messages: list[dict], chunk_ids: list[str], max_tokens: int, stream: bool) -> dict:
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": stream,
                **({"stream_options": {"include_usage": True}} if stream else {})}
        if side == SIDES[0]:  # the chunks' pages before the last user message's text, as qvpic places them
            placed = self.placed(messages[-1]["content"], chunk_ids)
            images = [{"type": "image_url", "image_url": {"url": url}}
                      for chunk, tier in placed for url in self.pages(chunk, tier)]
            last = {"role": "user", "content": [*images, {"type": "text", "text": messages[-1]["content"]}]}
            return {**body, "model": self.model, "messages": [*messages[:-1], last]}
        return {**body, "model": "qvpic", "qvpic": {"chunk_ids": chunk_ids, "mode": Mode.QVPIC.value}}

    def url(self, side: str) -> str:
        return (self.vllm.url if side == SIDES[0] else self.urls[side]) + "/v1/chat/completions"

    @contextlib.contextmanager
    def alone(self, side: str) -> Iterator[None]:
        """vLLM's server stopped while a qvpic side is timed (an idle one beside it slows qvpic: servers.py)."""
        with self.vllm.paused() if side != SIDES[0] else contextlib.nullcontext():
            yield

    def stream(self, side: str, body: dict) -> tuple[float, float, int, str]:
        """(first token's s, last token's s, completion tokens, text) of one streamed chat, from perf_counter."""
        first = last = None
        tokens, text = 0, []
        headers = {"Cache-Control": "no-cache"} if side != SIDES[0] else {}
        with self.client.stream("POST", self.url(side), json=body, headers=headers) as reply:
            if reply.status_code != 200:
                raise RuntimeError(f"{side} answered {reply.status_code}: {reply.read()[:300]!r}")
            for line in reply.iter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                for choice in event.get("choices") or []:
                    if choice.get("delta", {}).get("content") or choice.get("finish_reason"):
                        last = time.perf_counter()
                        first = first or last
                        text.append(choice.get("delta", {}).get("content") or "")
                tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
        return first, last, tokens, "".join(text)

    def ttft_ms(self, side: str, messages: list[dict], chunk_ids: list[str]) -> float:
        body = self.body(side, messages, chunk_ids, 1, stream=True)
        self.placed(messages[-1]["content"], chunk_ids)  # routed for vLLM's images before the clock starts
        with self.alone(side):
            started = time.perf_counter()
            first, _, _, _ = self.stream(side, body)
        return (first - started) * 1e3

    def follow_up_ms(self, side: str, first: list[str], second: list[str], query: str) -> float:
        """Turn 1 answered (8 tokens), then turn 2 (the history as text, new chunks, a new question) timed."""
        opening = [{"role": "user", "content": query}]
        with self.alone(side):
            _, _, _, answer = self.stream(side, self.body(side, opening, first, 8, stream=True))
        messages = [*opening, {"role": "assistant", "content": answer or "."}, {"role": "user", "content": FOLLOW_UP}]
        return self.ttft_ms(side, messages, second)

    def decode_rate(self, side: str, requests: list[list[str]], query: str) -> float:
        bodies = [self.body(side, [{"role": "user", "content": query}], c, NEW_TOKENS, stream=True) for c in requests]
        for chunk_ids in requests:
            self.placed(query, chunk_ids)
        with self.alone(side), ThreadPoolExecutor(len(bodies)) as pool:
            streams = list(pool.map(lambda b: self.stream(side, b), bodies))
        # each stream's own decode time, first token to last (as engines.py reads the engines' decode timers): not
        # the other streams' prefills before it, which on vLLM alone preprocess and encode images
        return sum(s[2] - 1 for s in streams) / max(s[1] - s[0] for s in streams)


def ratio_row(name: str, medians: dict[str, float]) -> list[str]:
    alone = medians[SIDES[0]]
    return [name] + [f"{medians[s]:.0f}" + ("" if s == SIDES[0] else f" ({medians[s] / alone:.2f}×)") for s in SIDES]


def run(sides: Sides, store, count: int, rng: random.Random) -> tuple[list[list[str]], dict[str, float]]:
    query = [{"role": "user", "content": store.query}]
    for chunk_ids in workloads(store.chunk_ids, 2, random.Random(0))["reordered"]:  # warm-up: first-call costs
        for side in SIDES:
            sides.ttft_ms(side, query, chunk_ids)
    rows = []
    for name, requests in workloads(store.chunk_ids, count, rng).items():
        times: dict[str, list[float]] = {side: [] for side in SIDES}
        for chunk_ids in requests:
            for side in rng.sample(SIDES, len(SIDES)):
                times[side].append(sides.ttft_ms(side, query, chunk_ids))
        rows.append(ratio_row(name, {side: statistics.median(t) for side, t in times.items()}))
    follow_ups: dict[str, list[float]] = {side: [] for side in SIDES}
    for i in range(count):
        first, second = (rng.sample(store.chunk_ids, PER_REQUEST) for _ in range(2))
        for side in rng.sample(SIDES, len(SIDES)):
            follow_ups[side].append(sides.follow_up_ms(side, first, second, f"{store.query} ({i})"))
    rows.append(ratio_row("follow-up turn", {side: statistics.median(t) for side, t in follow_ups.items()}))
    decode_sets = [rng.sample(store.chunk_ids, PER_REQUEST) for _ in range(STREAMS)]
    for chunk_ids in decode_sets:  # warm: every decode prompt in each side's caches, one at a time
        for side in SIDES:
            sides.ttft_ms(side, query, chunk_ids)
    return rows, {side: sides.decode_rate(side, decode_sets, store.query) for side in SIDES}


def main(argv: list[str] | None = None) -> None:
    args, count, model = command_line(argv, __name__, __doc__)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="qvpic-engines-http-") as folder:
        render = RenderSpec()
        # built on a thread that ends: no OpenMP pool of this process beside the servers' (pipeline/runtime/threads.py)
        store = in_passing_thread(ttft_store.build, f"{folder}/store", model, render, CHUNK_TOKENS, CHUNKS)
        pages = in_passing_thread(Pages, model, render, store.chunk_ids)
        # vLLM's own compile cache (~/.cache/vllm), as the in-process engine of qvpic on vLLM has it
        env = {k: v for k, v in engine.peer_env(torch.get_num_threads()).items() if k != "VLLM_CACHE_ROOT"}
        with servers.vllm_server(model, MAX_IMAGES, Path(folder) / "vllm.log", python=Path(sys.executable),
                                 env=env) as vllm, qvpic_apps(model, store.uri) as urls, \
                httpx.Client(timeout=600) as client:
            sides = Sides(client, urls, vllm, str(resolve_path(model)), pages)
            rows, decode = run(sides, store, count, random.Random(args.seed))
    minutes = (time.perf_counter() - started) / 60
    body = (f"Machine: {machine_line()}. {args.model} float32; {CHUNKS} chunks of ~{CHUNK_TOKENS} tokens, "
            f"{PER_REQUEST} per request; {count} requests per workload, each alone, one new token, streamed; the "
            f"sides in an order shuffled per request; medians ({minutes:.0f} min in all). TTFT ms over HTTP (ratio "
            f"to vLLM alone):\n\n" + markdown_table(["workload", *SIDES], rows)
            + f"\n\nDecode, {STREAMS} streams at once, {NEW_TOKENS} new tokens: "
            + ", ".join(f"{side} {decode[side]:.0f} tokens/s" + ("" if side == SIDES[0] else
                                                                  f" ({decode[side] / decode[SIDES[0]]:.2f}×)")
                        for side in SIDES) + ".\n\n" + READING)
    print(body)
    if not args.no_write:
        print(write_section("engines-http", "The two engines side by side over HTTP: vLLM alone, qvpic's engine, "
                            "qvpic on vLLM", ".venv-vllm/bin/python -m benchmarks.peer.engines_http", body))


if __name__ == "__main__":
    main()
