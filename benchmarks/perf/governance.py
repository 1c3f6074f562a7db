"""Overhead of cost governance on TTFT: the same cache-missing requests with governance off and on.

    python -m benchmarks.perf.governance              # tiny-qwen, 8 chunks, 150 rounds (≈30 s on 2 cores)

One store (`benchmarks/tools/ttft_store.py`), the real Router / CacheLoader / Generator in this process
(serve/local.py `build_local`), and the FastAPI app over them through httpx's ASGI transport: TTFT = client wall
time of a one-token `/v1/answer` (its token is picked from the prefill logits, so no decode step runs).
Configurations:
  - off: no response cache, no limits, no log, no auth (metrics are always recorded: they are in all);
  - on (memory): bearer auth, requests/s and tokens/s limits that never bite, an X-Max-Token-Budget
    header, l1 + l2 + l3 in-process caches (every query and task type is new: all misses, all
    stored), request log;
  - on (redis): the same with the response cache and the rate limits in a local redis-server.
Configurations are interleaved in every round so machine drift hits them alike; medians after one
warm-up round. Unlike the other benchmarks these requests do not send `Cache-Control: no-cache`: the
response-cache lookup is part of what is measured, and every request is checked to be a miss.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.tools import ttft_store
from pipeline.eval import markdown_table, write_section
from schemas.config import ModelSpec
from schemas.render import RenderSpec
from serve import build_local
from serve.app import api_spec
from serve.governance import Governor, key_digest
from serve.governance.config import GovernanceConfig

API_KEY = "bench-key"
UNLIMITED = {"requests_per_s": 1e6, "tokens_per_s": 1e9}
# The benchmark's queries differ by one number: only an identical embedding may hit l2, so every
# request still pays the l2 lookup (a full bucket of candidates) and misses.
CACHE = {"levels": ["l1", "l2", "l3"], "l2_threshold": 1.0}


def configs(log_dir: Path, redis_url: str | None) -> dict[str, dict]:
    on = {"auth": {"api_key_sha256": {key_digest(API_KEY): "bench"}}, "limits": {"default": UNLIMITED},
          "response_cache": CACHE, "request_log": {"location": {"uri": str(log_dir / "mem")}}}
    out = {"off": {"response_cache": {"levels": []}}, "on (memory)": on}
    if redis_url is not None:
        out["on (redis)"] = {**on, "redis_url": redis_url, "limits": {"default": UNLIMITED, "backend": "redis"},
                             "response_cache": {**CACHE, "backend": "redis"},
                             "request_log": {"location": {"uri": str(log_dir / "redis")}}}
    return out


PHASES = ("route_ms", "load_ms", "render_ms", "reanchor_ms", "prefill_ms", "decode_ms")


def measure(apps: dict[str, object], chunk_ids: list[str], query: str,
            rounds: int) -> dict[str, list[tuple[float, float]]]:
    """Per configuration: (client TTFT ms, ms outside the three roles' own phases) of each measured round.
    One event loop for the whole run, as in a long-lived ingress (its worker threads stay warm)."""

    async def one(client: httpx.AsyncClient, i: int, name: str) -> tuple[float, float]:
        headers = {"Authorization": f"Bearer {API_KEY}", "X-Max-Token-Budget": "1000000", "X-Task-Type": f"task-{i}"}
        # a question of each configuration's own: the apps share one router and generator, so a question another
        # configuration just asked would find its query vector and its prefix cached (the redis row read -35%)
        body = {"query": f"{query} (variant {i}, {name})", "chunk_ids": chunk_ids, "max_new_tokens": 1}
        started = time.perf_counter()
        response = await client.post("/v1/answer", json=body, headers=headers)
        elapsed_ms = (time.perf_counter() - started) * 1e3
        if response.status_code != 200 or response.json()["response_cache"]["level"] is not None:
            raise RuntimeError(f"expected a computed answer, got {response.status_code}: {response.text[:200]}")
        timings = response.json()["timings"]
        return elapsed_ms, elapsed_ms - sum(timings[phase] for phase in PHASES)

    async def run() -> dict[str, list[tuple[float, float]]]:
        clients = {name: httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost")
                   for name, app in apps.items()}
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in apps}
        for round_index in range(rounds + 1):  # round 0 warms up
            for name, client in clients.items():
                sample = await one(client, round_index, name)
                if round_index:
                    samples[name].append(sample)
        for client in clients.values():
            await client.aclose()
        return samples

    return asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.perf.governance", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-qwen")
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--chunk-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=150)
    p.add_argument("--no-redis", action="store_true", help="skip the Redis configuration")
    p.add_argument("--no-write", action="store_true", help="do not update docs/BENCHMARKS.md")
    args = p.parse_args(argv)
    model = ModelSpec(path=args.model, device="cpu")
    server = None
    if not args.no_redis:
        from tests.support.fixtures_redis import start_redis  # the test fixture's launcher: a private loopback server

        server = start_redis()
    try:
        with tempfile.TemporaryDirectory(prefix="qvpic-governance-") as workdir:
            bench = ttft_store.build(f"{workdir}/store", model, RenderSpec(), args.chunk_tokens, args.chunks)
            stack = build_local({"store": bench.uri, "model": model.model_dump(), "router": {"max_chunks": args.chunks},
                                 "loader": {"max_nbytes": 1 << 30}, "ingress": {"default_top_k": min(8, args.chunks)}})
            store = api_spec(stack.config).store
            apps, governors = {}, []
            for name, governance in configs(Path(workdir), server.url if server else None).items():
                governors.append(Governor(GovernanceConfig.model_validate(governance), store))
                apps[name] = stack.api(governors[-1])  # the same roles behind every configuration's HTTP surface
            samples = measure(apps, list(bench.chunk_ids), bench.query, args.rounds)
            for governor in governors:
                governor.close()
            stack.close()
    finally:
        if server is not None:
            server.stop()
    def median(name: str, column: int) -> float:
        return statistics.median(sample[column] for sample in samples[name])

    rows = [[name, median(name, 0), median(name, 0) - median("off", 0),
             f"{median(name, 0) / median('off', 0) - 1:+.1%}", median(name, 1), median(name, 1) - median("off", 1)]
            for name in samples]
    body = (f"{args.model} (float32, CPU), {args.chunks} chunks of ≤{args.chunk_tokens} text tokens, mode qvpic, "
            f"one-token answers, every query new (response-cache misses, stored at every level); medians of "
            f"{args.rounds} interleaved rounds after a warm-up round; load average during the run "
            f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; Redis on loopback.\n\n"
            + markdown_table(["governance", "TTFT ms", "Δ TTFT ms", "Δ TTFT", "outside the roles ms",
                              "Δ outside ms"], rows)
            + "\n\nOutside the roles = client wall time minus the router's, loader's and generator's own timed "
              "phases: HTTP handling, governance and the event loop — the part governance can add to, measured "
              "without the model's noise.")
    print(body)
    if not args.no_write:
        write_section("governance", "Cost governance: overhead on TTFT (issue 6)",
                      ("python -m benchmarks.perf.governance " + " ".join(argv)).strip(), body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
