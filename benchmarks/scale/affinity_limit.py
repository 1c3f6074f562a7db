"""The limit under benchmarks/scale/affinity.py: its workload replayed through the router's own policy
(serve/dispatch/affinity.py `choose`, with `AffinityConfig`'s defaults) over simulated replicas whose hot tiers
are the real byte-capped LRU (serve/kv/lru.py) fed by each replica's real Bloom filter (serve/kv/hot_tier.py),
knowing every tier exactly at every request, with requests completing in the order they were sent,
`in flight` × replicas at a time. No Serve, no model, no clock: what the measured figures fall short of this
is timing (stats refreshed every `stats_period_s`, completions out of order, fetches that overlap).

    python -m benchmarks.scale.affinity_limit      # writes docs/BENCHMARKS.md `affinity-limit` (≈1 min: the store)

Rows per replica count and in-flight depth, as medians over `--seeds` seeds of the power-of-two choices:
the hot-tier hit rate in bytes of affinity and of the default, their ratio, affinity with its load cap
lifted (`max_load_ratio` 10⁹): what the cap costs, and affinity with stale reports (`--report-every` N: each
replica's report refreshed every N routed requests, the router holding what it sent since, as
serve/dispatch/affinity.py does): what the stats' age costs.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import tempfile
from collections import deque

from benchmarks.scale.affinity import workload
from pipeline.eval import markdown_table, write_section
from serve.config import AffinityConfig, Dispatch
from serve.dispatch.affinity import ReplicaView, choose
from serve.kv import HotTierReport, KeySketch, key_hash
from serve.kv.lru import ByteLRU

UNCAPPED = 1e9


def replay(entries: list[list[tuple[str, int]]], sequence: list[int], replicas: int, in_flight: int,
           hot_nbytes: int, routing: Dispatch, max_load_ratio: float, seed: int, warmup: int,
           report_every: int = 1) -> float:
    """Hot-tier hit rate in bytes over `sequence[warmup:]`; `entries[topic]`: (entry key, stored bytes).
    `report_every` 1: exact knowledge; N: reports N requests old at worst, plus the router's own sent-tracking."""
    rng, spec = random.Random(seed), AffinityConfig()
    tiers = [ByteLRU(hot_nbytes, lambda nbytes: nbytes) for _ in range(replicas)]
    load, queue, hit, total = [0] * replicas, deque(), 0, 0
    reports: list[tuple[int, HotTierReport]] = []  # per replica: (request index it was recorded at, report)
    # per replica, key hash → the index of the request after which the last request that sent it there
    # completed (inf while one is in flight); a report recorded later covers it (serve/dispatch/affinity.py)
    sent: list[dict[tuple[int, int], float]] = [{} for _ in range(replicas)]
    for index, topic in enumerate(sequence):
        if len(queue) >= in_flight * replicas:  # the oldest completes before the next is routed
            done, hashes = queue.popleft()
            load[done] -= 1
            sent[done].update((h, index) for h in hashes if h in sent[done])
        if routing is Dispatch.AFFINITY and index % report_every == 0:  # the default reads no report
            reports = [(index, HotTierReport(KeySketch.of(t.keys()), len(t), 0.0)) for t in tiers]
        hashes = [key_hash(k) for k, _ in entries[topic]]
        if routing is Dispatch.AFFINITY:
            for j, (recorded_at, _) in enumerate(reports):
                sent[j] = {h: at for h, at in sent[j].items() if at > recorded_at}
            views = [ReplicaView(str(j), load[j], report, frozenset(sent[j]) if report_every > 1 else frozenset())
                     for j, (_, report) in enumerate(reports)]
            choice = choose([(h, n) for h, (_, n) in zip(hashes, entries[topic])], views, rng,
                            max_load_ratio=max_load_ratio, min_in_flight=spec.min_in_flight)
            target = min((int(i) for i in choice.ranks[0]), key=lambda j: load[j])  # Serve: least queued in rank
        else:
            target = min(rng.sample(range(replicas), 2), key=lambda j: load[j])
        load[target] += 1
        sent[target].update((h, math.inf) for h in hashes)
        queue.append((target, hashes))
        tier = tiers[target]
        found = [tier.get(key) is not None for key, _ in entries[topic]]  # every lookup first, as the generator
        for (key, nbytes), held in zip(entries[topic], found):
            if not held:
                tier.put(key, nbytes)
            if index >= warmup:
                total, hit = total + nbytes, hit + nbytes * held
    return hit / total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale.affinity_limit", description=__doc__)
    parser.add_argument("--chunks", type=int, default=480)
    parser.add_argument("--topics", type=int, default=48)
    parser.add_argument("--requests", type=int, default=480)
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[2, 8], help="requests in flight per replica")
    parser.add_argument("--seeds", type=int, default=5)
    # benchmarks/scale/affinity.py serves ~55 requests/s at 3 replicas (in flight / TTFT p50, one new token: 6 / 0.10 s,
    # 24 / 0.43 s), and a report is up to a 0.5 s stats period old when collected, then pushed to the handles
    parser.add_argument("--report-every", type=int, default=48, help="routed requests between reports in the "
                        "stale column")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        plans, sequence, hot_nbytes = workload(work, args.chunks, args.topics, args.requests)
    entries = [[(c.entry.key, c.entry.row.stored.nbytes) for c in plan.chunks] for plan in plans]
    ratio = AffinityConfig().max_load_ratio

    def median(replicas: int, in_flight: int, routing: Dispatch, cap: float, report_every: int = 1) -> float:
        return statistics.median(replay(entries, sequence, replicas, in_flight, hot_nbytes, routing, cap, seed,
                                        args.requests // 4, report_every) for seed in range(args.seeds))

    rows = []
    for replicas in args.replicas:
        for in_flight in args.concurrency:
            affinity = median(replicas, in_flight, Dispatch.AFFINITY, ratio)
            default = median(replicas, in_flight, Dispatch.DEFAULT, ratio)
            rows.append([replicas, in_flight, affinity, default, affinity / default,
                         median(replicas, in_flight, Dispatch.AFFINITY, UNCAPPED),
                         median(replicas, in_flight, Dispatch.AFFINITY, ratio, args.report_every)])
    body = (f"benchmarks/scale/affinity.py's workload ({args.chunks} chunks, {args.topics} topics, "
            f"{args.requests} requests, "
            f"the same seed; hot tier {hot_nbytes / 2**20:.2f} MiB per replica), replayed with exact knowledge "
            f"(the last column: with reports {args.report_every} requests old at worst); "
            f"medians over {args.seeds} seeds of the power-of-two choices. Hot-tier hit rate in bytes:\n\n"
            + markdown_table(["replicas", "in flight per replica", "affinity", "default", "affinity ×",
                              f"affinity, cap lifted (max_load_ratio {ratio:g} → ∞)",
                              f"affinity, reports every {args.report_every} requests"], rows) + "\n")
    print(body)
    command = "python -m benchmarks.scale.affinity_limit " + " ".join(argv if argv is not None else sys.argv[1:])
    write_section("affinity-limit", "The limit under chunk-affinity dispatch: the policy with exact knowledge",
                  command.strip(), body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
