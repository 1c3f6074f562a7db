"""Chunk-affinity dispatch vs Serve's default (power of two choices) across generator replicas.

    python -m benchmarks.scale.affinity --concurrency 2 8   # 2 and 3 replicas, both policies, both loader placements,
                                                            # 2 and 8 in flight per replica; writes docs/BENCHMARKS.md
    python -m benchmarks.scale.affinity --quick    # fewer requests, nothing written

A store of `--chunks` synthetic chunks is compiled in-process (benchmarks/tools/ttft_store.py, tiny-qwen). Requests
are `--topics` fixed chunk sets of 8–16 chunks (drawn uniformly from the corpus; overlapping), picked with
Zipf(1.0) popularity: a popular question retrieves the same set again. (Zipf over single chunks drawn
independently per request has no set to keep together: a simulation of that gave either policy the same
hit rate within 10 %.) Each replica's device hot tier holds half the bytes of the hot set (the most
requested entries that take 80 % of all entry lookups); each loader's host LRU holds as much as one hot
tier — one loader deployment shared by the replicas (`loader_placement: deployment`), or one loader in each
generator replica (`in_generator`: no hop; with affinity each LRU holds its replica's share). Every
configuration is a fresh Serve app (generators + loader, replicas on this one Ray node) served the same
request sequence, `--concurrency` × replicas in flight; the first quarter warms up and is not counted.
Figures: the hot tiers' hit rate in entries and bytes (the replicas' own counters,
serve/kv/hot_tier.py), loader LRU hits and store reads (per request, the answer's cache report),
TTFT p50/p99 at the handle (first streamed event, one new token; ratios only: the replicas share two
cores), and requests per replica (max/mean).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from collections import Counter

import ray
from ray import serve

from benchmarks.tools import ttft_store
from pipeline.eval import markdown_table, write_section
from schemas.api import AnswerRequest
from schemas.config import ModelSpec
from schemas.modes import Mode
from schemas.render import RenderSpec
from schemas.sampling import Sampling
from serve.app import generator_dispatch
from serve.config import AppConfig, Dispatch, LoaderPlacement
from serve.engine import Generator
from serve.kv import CacheLoader, HotTierReport, LoaderDeployment, LocalLoader
from serve.plan import Plan
from serve.routing import Router

MODEL = ModelSpec(path="tiny-qwen", device="cpu")
HOT_SHARE = 0.8  # the hot set: the entries that take this share of lookups


def zipf_topics(num_topics: int, num_requests: int, rng: random.Random) -> list[int]:
    weights = [1.0 / (rank + 1) for rank in range(num_topics)]  # Zipf, exponent 1.0
    return rng.choices(range(num_topics), weights=weights, k=num_requests)


def entry_nbytes(plan: Plan) -> dict[str, int]:
    return {c.entry.key: c.entry.row.stored.nbytes for c in plan.chunks}


def hot_set_nbytes(plans: list[Plan], sequence: list[int]) -> int:
    """Bytes of the most requested entries that together take `HOT_SHARE` of the sequence's entry lookups."""
    sizes = {key: n for plan in plans for key, n in entry_nbytes(plan).items()}
    lookups = Counter(key for topic in sequence for key in entry_nbytes(plans[topic]))
    covered, hot = 0, 0
    for key, count in lookups.most_common():
        covered, hot = covered + count, hot + sizes[key]
        if covered >= HOT_SHARE * sum(lookups.values()):
            return hot
    return hot


def workload(work: str, num_chunks: int, num_topics: int, num_requests: int) -> tuple[list[Plan], list[int], int]:
    """A store of `num_chunks` under `work`; one plan per topic, the topic of each request, and the hot-tier
    bytes per replica (half the hot set). Seeded: every run (and benchmarks/scale/affinity_limit.py) sees the same."""
    rng = random.Random(0)
    built = ttft_store.build(work, MODEL, RenderSpec(), chunk_tokens=48, num_chunks=num_chunks)
    router = Router(AppConfig.model_validate({"store": work, "model": MODEL.model_dump(mode="json"),
                                              "router": {}, "loader": {}, "generator": {}}).router)
    topics = [rng.sample(built.chunk_ids, rng.randint(8, 16)) for _ in range(num_topics)]
    plans = [asyncio.run(router.plan(AnswerRequest(query=built.query, chunk_ids=t, mode=Mode.UNIFORM,
                                                   max_new_tokens=1))) for t in topics]
    sequence = zipf_topics(num_topics, num_requests, rng)
    return plans, sequence, hot_set_nbytes(plans, sequence) // 2


def replica_reports(app: str) -> list[HotTierReport]:
    from ray._private import state  # no public API lists a deployment's replicas without the dashboard

    names = [a["Name"] for a in state.actors().values()
             if a.get("ActorClassName") == f"ServeReplica:{app}:Generator" and a.get("State") == "ALIVE"]
    stats = ray.get([ray.get_actor(n, namespace="serve").record_routing_stats.remote() for n in names])
    return [HotTierReport.from_stats(s) for s in stats]


async def serve_sequence(handle, plans: list[Plan], sequence: list[int], concurrency: int) -> list[tuple]:
    """(ttft_ms, cache report) per request, in sequence order, `concurrency` in flight."""
    results: list[tuple | None] = [None] * len(sequence)
    queue = iter(enumerate(sequence))
    sampling = Sampling.of(AnswerRequest(query="q", chunk_ids=["x"], max_new_tokens=1))

    async def worker() -> None:
        for index, topic in queue:
            started, ttft_ms, answer = time.perf_counter(), None, None
            async for event in handle.options(stream=True).stream.remote(plans[topic], sampling):
                ttft_ms = ttft_ms or (time.perf_counter() - started) * 1e3
                answer = event
            results[index] = (ttft_ms, answer.report.cache)
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def run_config(store: str, plans, sequence, replicas: int, routing: Dispatch, placement: LoaderPlacement,
               hot_nbytes: int, concurrency: int, warmup: int) -> dict:
    config = AppConfig.model_validate({
        "store": store, "model": MODEL.model_dump(mode="json"), "router": {}, "loader": {"max_nbytes": hot_nbytes},
        "generator": {"engine": {"hot_tier_nbytes": hot_nbytes}}, "dispatch": routing.value,
        "affinity": {"stats_period_s": 0.5, "stale_after_s": 5.0}, "loader_placement": placement.value})
    app = f"affinity-{routing.value}-{placement.value}-{replicas}-{concurrency}"
    source = (LocalLoader(config.loader) if placement is LoaderPlacement.IN_GENERATOR  # each replica builds its own
              else LoaderDeployment(serve.deployment(CacheLoader, name="CacheLoader").options(
                  ray_actor_options={"num_cpus": 0.1}).bind(config=config.loader)))
    generator = serve.deployment(Generator, name="Generator").options(
        num_replicas=replicas, max_ongoing_requests=32, ray_actor_options={"num_cpus": 0.1},
        **generator_dispatch(config)).bind(config=config.generator, source=source)
    handle = serve.run(generator, name=app, route_prefix=None)
    results = asyncio.run(serve_sequence(handle, plans, sequence[:warmup], concurrency))
    time.sleep(1.5)  # the warm tiers' stats reach the router before the counted requests
    before = replica_reports(app)
    results = asyncio.run(serve_sequence(handle, plans, sequence[warmup:], concurrency))
    after = replica_reports(app)
    serve.delete(app)
    deltas = [{f: getattr(b, f) - getattr(a, f) for f in ("lookups", "hit_entries", "miss_entries", "hit_nbytes",
                                                          "miss_nbytes")} for a, b in zip(before, after)]
    total = {f: sum(d[f] for d in deltas) for f in deltas[0]}
    ttfts = sorted(r[0] for r in results)
    per_replica = [d["lookups"] for d in deltas]
    return {"replicas": replicas, "routing": routing.value, "loader": placement.value,
            "in_flight": concurrency // replicas,
            "hit_entries": total["hit_entries"] / (total["hit_entries"] + total["miss_entries"]),
            "hit_bytes": total["hit_nbytes"] / (total["hit_nbytes"] + total["miss_nbytes"]),
            "loader_hits": sum(r[1].hits for r in results), "store_reads": sum(r[1].misses for r in results),
            "ttft_p50": statistics.median(ttfts), "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "max_mean": max(per_replica) / (sum(per_replica) / replicas), "per_replica": per_replica}


def section(rows: list[dict], setup: str) -> str:
    table = markdown_table(
        ["replicas", "in flight per replica", "loader", "routing", "hot-tier hit (entries)", "hot-tier hit (bytes)",
         "loader LRU hits", "store reads", "TTFT p50 ms", "TTFT p99 ms", "requests per replica", "max/mean"],
        [[r["replicas"], r["in_flight"], r["loader"], r["routing"], r["hit_entries"], r["hit_bytes"], r["loader_hits"],
          r["store_reads"], r["ttft_p50"], r["ttft_p99"], " / ".join(map(str, r["per_replica"])), r["max_mean"]]
         for r in rows])
    ratios, loaders = [], []
    for cell in sorted({(r["replicas"], r["in_flight"], r["loader"]) for r in rows}):
        a, d = (next(r for r in rows if (r["replicas"], r["in_flight"], r["loader"]) == cell and r["routing"] == p)
                for p in ("affinity", "default"))
        ratios.append([*cell, a["hit_bytes"] / d["hit_bytes"], a["hit_entries"] / d["hit_entries"],
                       a["store_reads"] / max(1, d["store_reads"]), a["ttft_p50"] / d["ttft_p50"], a["max_mean"]])
    for cell in sorted({(r["replicas"], r["in_flight"], r["routing"]) for r in rows}):
        by = {r["loader"]: r for r in rows if (r["replicas"], r["in_flight"], r["routing"]) == cell}
        if len(by) == 2:
            s, g = by[LoaderPlacement.DEPLOYMENT.value], by[LoaderPlacement.IN_GENERATOR.value]
            loaders.append([*cell, g["store_reads"] / max(1, s["store_reads"]), g["ttft_p50"] / s["ttft_p50"],
                            g["ttft_p99"] / s["ttft_p99"]])
    ratio_table = markdown_table(["replicas", "in flight per replica", "loader", "hit rate ×, bytes",
                                  "hit rate ×, entries", "store reads ×", "TTFT p50 ×", "affinity max/mean"], ratios)
    body = f"{setup}\n\n{table}\n\nAffinity against default, same run:\n\n{ratio_table}\n"
    if loaders:
        body += ("\nThe loader in each generator against one loader deployment, same run:\n\n" + markdown_table(
            ["replicas", "in flight per replica", "routing", "store reads ×", "TTFT p50 ×", "TTFT p99 ×"], loaders)
            + "\n")
    return body


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale.affinity", description=__doc__)
    parser.add_argument("--chunks", type=int, default=480)  # each chunk in ~1.2 of the topics (96: in ~6)
    parser.add_argument("--topics", type=int, default=48)
    parser.add_argument("--requests", type=int, default=480)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[2], help="requests in flight per replica")
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--loaders", nargs="+", type=LoaderPlacement, default=list(LoaderPlacement),
                        help="loader placements: deployment (one shared) and/or in_generator (one per replica)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.replicas = 120, [3]
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    serve.start(logging_config={"log_level": "WARNING", "enable_access_log": False})
    with tempfile.TemporaryDirectory() as work:
        plans, sequence, hot_nbytes = workload(work, args.chunks, args.topics, args.requests)
        rows = [run_config(work, plans, sequence, replicas, routing, placement, hot_nbytes, in_flight * replicas,
                           args.requests // 4)
                for replicas in args.replicas for in_flight in args.concurrency for placement in args.loaders
                for routing in (Dispatch.AFFINITY, Dispatch.DEFAULT)]
    setup = (f"tiny-qwen float32 on CPU, {args.chunks} chunks, {args.topics} topics of 8–16 chunks, "
             f"{args.requests} Zipf(1.0) requests ({args.requests // 4} warm-up), uniform low tier; hot tier "
             f"{hot_nbytes / 2**20:.2f} MiB per replica = half the hot set; each loader's host LRU the same size (one "
             f"loader deployment, or one loader in each generator replica: then the replicas' LRUs add up).")
    body = section(rows, setup)
    print(body)
    if not args.quick:
        command = "python -m benchmarks.scale.affinity " + " ".join(argv if argv is not None else sys.argv[1:])
        write_section("affinity", "Chunk-affinity dispatch across generator replicas", command.strip(), body)
    serve.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
