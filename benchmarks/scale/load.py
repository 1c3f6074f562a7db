"""Load on loopback: many requests at a fixed concurrency through the whole Serve graph, mixed modes,
some repeated; latency percentiles, throughput, errors, and the memory of every serving process.

The mix cycles through every mode the store serves, selects chunks by top-k or whole documents, and
repeats a share of earlier requests verbatim so the response cache and the loader's KV LRU both hit.
Memory is each replica's resident set (read from /proc) after a warm-up and every 250 requests through
the timed run and a longer soak of the same mix — a leak keeps climbing, a high-water mark levels
off — and the loader's LRU byte count against its cap.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from schemas.modes import Mode

APP_NAME = "qvpic-load"
DEPLOYMENTS = ("Ingress", "Router", "CacheLoader", "Generator")
SAMPLE_CORPUS = Path(__file__).resolve().parents[2] / "jobs" / "data" / "sample_corpus.jsonl"
QUESTIONS = ["When does part {n} ship?", "What does invoice {n} total?", "Who signed the lease for unit {n}?",
             "Which seal kit failed in pump P-{n}?", "What is the meal allowance in region {n}?",
             "How long is the warranty on board {n}?"]


@dataclass
class LoadResult:
    num_requests: int
    concurrency: int
    wall_s: float
    latencies_ms: list[float]  # of every response but response-cache hits, in completion order
    statuses: Counter = field(default_factory=Counter)  # HTTP status -> count (0: no response at all)
    errors: list[tuple[int, str]] = field(default_factory=list)  # (status, body) of every non-200 answer
    response_cache_hits: int = 0
    cache_hit_latencies_ms: list[float] = field(default_factory=list)  # timed apart: they are no model work

    @property
    def num_errors(self) -> int:
        return self.num_requests - self.statuses[200]

    def percentile_ms(self, q: float, cache_hits: bool = False) -> float:
        ordered = sorted(self.cache_hit_latencies_ms if cache_hits else self.latencies_ms)
        if not ordered:
            return float("nan")
        return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]

    @property
    def throughput_rps(self) -> float:
        return self.num_requests / self.wall_s


def request_mix(num_requests: int, doc_ids: list[str], modes: list[Mode], repeat_share: float = 0.25,
                seed: int = 0, max_new_tokens: int = 8, stream_share: float = 0.25) -> list[dict]:
    """Request bodies: every mode in turn, top-k or whole documents, `stream_share` of them streamed (SSE),
    `repeat_share` of them verbatim repeats."""
    rng = random.Random(seed)
    bodies: list[dict] = []
    for i in range(num_requests):
        if bodies and rng.random() < repeat_share:
            bodies.append(rng.choice(bodies))
            continue
        body = {"query": rng.choice(QUESTIONS).format(n=rng.randrange(10_000)), "mode": modes[i % len(modes)].value,
                "max_new_tokens": max_new_tokens, "stream": rng.random() < stream_share}
        if rng.random() < 0.5:
            body["top_k"] = rng.randint(1, 3)
        else:
            body["doc_ids"] = rng.sample(doc_ids, k=min(len(doc_ids), rng.randint(1, 2)))
        bodies.append(body)
    return bodies


def outcome(response: httpx.Response) -> tuple[int, dict]:
    """(status, JSON body) of an answer; a streamed one's status is its last event's (an error event
    after the 200 carries the status the request ended with), its body the final response or error."""
    if not response.headers.get("content-type", "").startswith("text/event-stream"):
        try:
            return response.status_code, response.json()
        except ValueError:
            return response.status_code, {"detail": response.text[:2000]}
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    last = json.loads(events[-1]) if events else {"type": "error", "status_code": 0, "detail": "empty stream"}
    if last.get("type") == "done":
        return response.status_code, last["response"]
    return last.get("status_code", 0), last


async def run_load(base_url: str, bodies: list[dict], concurrency: int, timeout_s: float = 120.0,
                   into: LoadResult | None = None) -> LoadResult:
    """POST every body to /v1/answer with at most `concurrency` in flight; a timeout counts as status 0.
    `into` is filled as responses arrive, for a caller watching the run's progress."""
    gate = asyncio.Semaphore(concurrency)
    result = into or LoadResult(num_requests=len(bodies), concurrency=concurrency, wall_s=0.0, latencies_ms=[])

    async def one(http: httpx.AsyncClient, body: dict) -> None:
        async with gate:
            started = time.perf_counter()
            try:
                response = await http.post("/v1/answer", json=body)
            except httpx.HTTPError as error:
                result.statuses[0] += 1
                result.errors.append((0, f"{type(error).__name__}: {error}"))
                return
            elapsed_ms = (time.perf_counter() - started) * 1e3
            status, reply = outcome(response)
            result.statuses[status] += 1
            if status != 200:
                result.errors.append((status, json.dumps(reply)))
            if status == 200 and reply.get("cache_hit"):
                result.response_cache_hits += 1
                result.cache_hit_latencies_ms.append(elapsed_ms)
            else:
                result.latencies_ms.append(elapsed_ms)

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as http:
        started = time.perf_counter()
        await asyncio.gather(*(one(http, body) for body in bodies))
        result.wall_s += time.perf_counter() - started  # `into` may add up several runs
    return result


def rss_nbytes(pid: int | str = "self", field: str = "VmRSS") -> int:
    """A process's resident memory from /proc (Linux): `VmRSS` all of it, `RssAnon` its private heap (where a
    leak shows), `RssShmem` shared pages it touched (for a Ray worker, objects read from the object store:
    bounded by the store's size)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no {field} line")


def ray_worker_pids(title_fragment: str) -> list[int]:
    """PIDs of this driver's Ray workers whose process title holds `title_fragment` (e.g. "CacheLoader").

    Only children of this session's raylet count, so workers of another Ray on the same machine are
    never touched. The raylet is found as the parent of a zero-CPU task's worker.
    """
    import ray

    @ray.remote(num_cpus=0)
    def parent_pid() -> int:
        return os.getppid()

    raylet_pid = ray.get(parent_pid.remote())
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                title = cmdline.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):  # the process ended while being read
            continue
        if ppid == raylet_pid and title_fragment in title:
            pids.append(int(entry))
    return sorted(pids)


def replica_rss_nbytes(app_name: str, field: str = "RssAnon") -> dict[str, int]:
    """Summed resident memory (a `rss_nbytes` field) of each deployment's replicas (process titles
    `ServeReplica:<app>:<name>`)."""
    return {name: sum(rss_nbytes(pid, field) for pid in ray_worker_pids(f"ServeReplica:{app_name}:{name}"))
            for name in DEPLOYMENTS}


def memory(app_name: str) -> tuple[dict[str, int], dict[str, int]]:
    """(private, shared) resident bytes of each deployment's replicas."""
    return replica_rss_nbytes(app_name, "RssAnon"), replica_rss_nbytes(app_name, "RssShmem")


def loopback_port() -> int:
    """A free port the OS picks (its ephemeral range lies above Ray's worker ports, 10002-19999)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale.load", description=__doc__)
    parser.add_argument("--requests", type=int, default=500, help="the timed run")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--soak-requests", type=int, default=2000,
                        help="more of the same mix after the timed run, only to watch memory")
    parser.add_argument("--rss-every", type=int, default=250, help="read every replica's resident set this often")
    parser.add_argument("--model", default="tiny-qwen")
    parser.add_argument("--cache-max-nbytes", type=int, default=4 << 20, help="loader LRU cap (small: evictions)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    if args.requests % args.rss_every:
        parser.error("--requests must be a multiple of --rss-every")

    import ray
    from ray import serve

    from jobs.cluster import init_ray
    from pipeline.eval import markdown_table, write_section
    from pipeline.ingest import IngestConfig, ingest
    from schemas.config import ModelSpec
    from schemas.store import StoreSpec
    from serve.app import build_app

    init_ray()
    model = ModelSpec(path=args.model, device="cpu")
    with tempfile.TemporaryDirectory() as store_dir:
        summary = ingest(IngestConfig(corpus=str(SAMPLE_CORPUS), store=StoreSpec(uri=store_dir), model=model))
        port = loopback_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port},
                    logging_config={"log_level": "WARNING", "enable_access_log": False})
        serve.run(build_app({"store": {"uri": store_dir}, "model": model.model_dump(mode="json"),
                             "loader": {"max_nbytes": args.cache_max_nbytes},
                             "loader_placement": "deployment"}),  # DEPLOYMENTS: its memory is measured apart
                  name=APP_NAME, route_prefix="/")
        base_url = f"http://127.0.0.1:{port}"
        try:
            doc_ids = sorted({json.loads(line)["doc_id"] for line in SAMPLE_CORPUS.read_text().splitlines()})
            modes = [Mode(m) for m in httpx.get(f"{base_url}/v1/store").json()["modes"]]
            asyncio.run(run_load(base_url, request_mix(32, doc_ids, modes, seed=1), 4))  # warm-up
            bodies = request_mix(args.requests + args.soak_requests, doc_ids, modes)
            timed, soak = (LoadResult(num_requests=n, concurrency=args.concurrency, wall_s=0.0, latencies_ms=[])
                           for n in (args.requests, args.soak_requests))
            rss = [(0, memory(APP_NAME))]  # a leak keeps climbing, a high-water mark levels off
            for start in range(0, len(bodies), args.rss_every):
                part = bodies[start:start + args.rss_every]
                asyncio.run(run_load(base_url, part, args.concurrency, into=timed if start < args.requests else soak))
                rss.append((start + len(part), memory(APP_NAME)))
            cache = httpx.get(f"{base_url}/v1/store").json()["cache"]
        finally:
            serve.shutdown()
            ray.shutdown()
    latency_rows = [[timed.num_requests, timed.concurrency, timed.percentile_ms(50), timed.percentile_ms(99),
                     statistics.mean(timed.latencies_ms), timed.throughput_rps, timed.num_errors,
                     timed.response_cache_hits, timed.percentile_ms(50, cache_hits=True)]]
    memory_rows = [[answered, *(private[name] / 2**20 for name in DEPLOYMENTS), sum(shared.values()) / 2**20]
                   for answered, (private, shared) in rss]
    body = (
        f"Model `{args.model}` (float32, CPU) over the sample corpus ({summary.num_chunks} chunks, every variant), "
        f"one replica per deployment on a local Ray, HTTP on loopback. {args.requests} `/v1/answer` requests, "
        f"{args.concurrency} in flight, modes {', '.join(m.value for m in modes)} in turn, top-k or whole "
        "documents, 8 new tokens each, a quarter streamed (SSE, timed to the last event), a quarter verbatim "
        "repeats (response-cache hits); after a 32-request warm-up. Latencies are of computed answers; "
        "response-cache hits (`cache_hit: true`, no model work) are timed apart.\n\n"
        + markdown_table(["requests", "concurrency", "p50 ms", "p99 ms", "mean ms", "req/s", "errors",
                          "response-cache hits", "hit p50 ms"], latency_rows)
        + f"\n\nStatuses: {dict(timed.statuses)}; then {args.soak_requests} more of the same mix to watch memory: "
        f"{dict(soak.statuses)}. Loader KV LRU at the end: {cache['entries']} entries, {cache['nbytes']:,} of "
        f"{cache['max_nbytes']:,} bytes, {cache['hits']} hits, {cache['misses']} misses, {cache['evictions']} "
        "evictions.\n\nResident memory (MiB) after the warm-up, then as requests are answered: each replica's "
        "private heap (RssAnon; a leak keeps climbing, an allocator's high-water mark levels off), and the shared "
        "pages all four touched (RssShmem: mostly KV read from Ray's object store, bounded by its size). "
        f"`MALLOC_ARENA_MAX` was {os.environ.get('MALLOC_ARENA_MAX', 'unset (glibc: up to 8 arenas per core)')}: "
        "replicas run requests on thread pools, and each thread's malloc arena keeps its own high-water mark, so "
        "with many arenas a heap creeps up long after its working set stopped growing; compare with "
        "`MALLOC_ARENA_MAX=2 python -m benchmarks.scale.load --no-write`.\n\n"
        + markdown_table(["requests answered", *(f"{name} private" for name in DEPLOYMENTS), "shared, all"],
                         memory_rows)
    )
    if not args.no_write:
        write_section("load", "Load: latency, throughput and memory under concurrent requests (issue 8)",
                      "python -m benchmarks.scale.load " + " ".join(argv or []), body)
    print(body)
    return 0 if timed.num_errors == soak.num_errors == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
