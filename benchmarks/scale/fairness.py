"""A hostile tenant beside a victim (issue 60 item 5): tenant a loops every probe of benchmarks/scale/hostile_probes.py
while tenant b asks ordinary questions, one at a time; b must get no error and keep its TTFT, and the ingress must
answer `/healthz` throughout.

    python -m benchmarks.scale.fairness              # tiny-qwen, 4 rounds of 15 questions alone + 15 beside a
    python -m benchmarks.scale.fairness --quick      # 2 rounds of 8
    python -m benchmarks.scale.fairness --shape serve  # as `qvpic serve` deploys: a process per deployment

The real Router / CacheLoader / Generator in this process (serve/local.py `build_local`) over a store from
benchmarks/tools/ttft_store.py, the FastAPI app served by uvicorn on loopback (a thread of this process), governed
by public config keys only: two API keys (`auth.api_key_sha256`), one policy for every tenant (`limits.default`).
Tenant a runs in a process of its own (its client's CPU is not this process's GIL); b and a `/healthz` poller (every
50 ms) run here. Rounds alternate b alone and b beside a, so machine drift hits both phases alike. TTFT = client
time to the first streamed chunk that carries content. The probes: benchmarks/scale/hostile_probes.py; the tenants,
the poller and the loopback server: benchmarks/scale/tenants.py; here, the rounds and the report.
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import json
import os
import shlex
import statistics
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from benchmarks.scale.hostile_probes import PROBES
from benchmarks.scale.tenants import (
    A_CLIENT_NICE,
    B_EVERY_S,
    CLIENT_TIMEOUT_S,
    HEALTH_EVERY_S,
    POLICY,
    TARGET_HEALTH_MS,
    TARGET_P50,
    TARGET_P99,
    Health,
    Hostile,
    Victim,
    governance,
    questions,
    serving,
)


class Shape(enum.Enum):
    """How the server runs: `in-process` puts the roles and the ingress in this process (one GIL: a role's Python
    work delays `/healthz`); `serve` is what `qvpic serve` deploys, each deployment a Ray Serve replica of its own
    (a process each: the ingress's loop shares its GIL with nothing but the ingress)."""

    IN_PROCESS = "in-process"
    SERVE = "serve"


SECTIONS = {Shape.IN_PROCESS: "fairness", Shape.SERVE: "fairness-serve"}  # docs/RELIABILITY.md, one per shape


@contextmanager
def deployed(shape: Shape, config: dict) -> Iterator[str]:
    """The app of `config` (serve/config.yaml's `args`) served on loopback in `shape`; yields its base URL."""
    if shape is Shape.IN_PROCESS:
        from serve import build_local

        stack = build_local(config)
        try:
            with serving(stack.api()) as base_url:
                yield base_url
        finally:
            stack.close()
        return
    import ray
    from ray import serve

    from benchmarks.scale.load import loopback_port
    from jobs.cluster import init_ray
    from serve.app import build_app

    init_ray()
    port = loopback_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port},
                logging_config={"log_level": "WARNING", "enable_access_log": False})
    try:
        serve.run(build_app(config), name="fairness", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


# ---- the benchmark ----------------------------------------------------------------------------------------------
def run(base_url: str, rounds: int, per_round: int, concurrency: int, skip: tuple[str, ...] = (),
        a_nice: int = A_CLIENT_NICE) -> tuple[dict[str, Victim], dict, Hostile]:
    """`rounds` of b alone then b beside a (looping every probe but `skip`); b's TTFT per phase, /healthz per phase,
    a's statuses."""
    victims, health = {"alone": Victim(), "beside a": Victim()}, {"alone": Health(), "beside a": Health()}
    hostile_tenant = Hostile(base_url, concurrency, skip=skip, nice=a_nice)
    asyncio.run(questions(base_url, Victim(), Health(), 3, -3))  # warm-up
    for round_index in range(rounds):
        start = round_index * per_round
        asyncio.run(questions(base_url, victims["alone"], health["alone"], per_round, start))
        with hostile_tenant.running():  # questions of its own: a question asked alone has its query vector cached
            asyncio.run(questions(base_url, victims["beside a"], health["beside a"], per_round,
                                  rounds * per_round + start))
    return victims, health, hostile_tenant


def report(victims: dict[str, Victim], health: dict[str, Health], hostile_tenant: Hostile, args) -> str:
    from pipeline.eval import markdown_table

    alone, beside = victims["alone"], victims["beside a"]
    rows = [[args.shape.value, phase, len(v.ttft_ms), len(v.errors), percentile(v.ttft_ms, 50),
             percentile(v.ttft_ms, 99),
             max(health[phase].latency_ms), percentile(health[phase].latency_ms, 99), len(health[phase].latency_ms),
             len(health[phase].failures)] for phase, v in victims.items()]
    p50 = percentile(beside.ttft_ms, 50) / percentile(alone.ttft_ms, 50)
    p99 = percentile(beside.ttft_ms, 99) / percentile(alone.ttft_ms, 99)
    worst_health = max(max(h.latency_ms) for h in health.values())
    probes = [[name, ", ".join(f"{status}×{n}" for status, n in sorted(counts.items(), key=str))
               if name not in hostile_tenant.skip else "skipped"]
              for name, counts in hostile_tenant.statuses.items()]
    unrefused = [name for name, counts in hostile_tenant.statuses.items()
                 if any(not isinstance(status, int) or not 400 <= status < 500 for status in counts)]
    verdict = lambda ok: "met" if ok else "**missed**"  # noqa: E731
    served = ("the roles and the ingress in this process (`build_local`; uvicorn in a thread): one GIL"
              if args.shape is Shape.IN_PROCESS else "`qvpic serve`'s shape: each deployment a Ray Serve replica, "
              "a process of its own, on a local Ray")
    ray_niceness = "" if args.shape is Shape.IN_PROCESS else (  # what BULK_NICE is relative to (jobs/cluster.py)
        "; Ray's workers at niceness " + os.environ.get("RAY_worker_niceness", "15 (Ray's default)"))
    return (f"Served as {args.shape.value}: {served}. "
            f"{args.model} (float32, CPU), {args.chunks} chunks; {args.rounds} rounds of {args.per_round} questions "
            f"of b alone, then {args.per_round} beside a ({args.concurrency} of a's probes in flight, a in its own "
            f"process at niceness {hostile_tenant.nice:+d}, as if on a machine of its own: it used "
            f"{hostile_tenant.cpu_s:.1f} s of CPU in {hostile_tenant.wall_s:.0f} s){ray_niceness}; b asks one at a "
            f"time, at most one every {B_EVERY_S * 1e3:.0f} ms, and streams 8 tokens, "
            f"TTFT to its first content chunk; `/healthz` polled every "
            f"{HEALTH_EVERY_S * 1e3:.0f} ms. Policy of every tenant (`limits.default`): `{json.dumps(POLICY)}`. "
            f"Load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (shared with other jobs: "
            f"the tails are noisy).  \nMachine: {_machine()}\n\n"
            + markdown_table(["served as", "b", "questions", "errors", "TTFT p50 ms", "TTFT p99 ms", "/healthz max ms",
                              "/healthz p99 ms", "polls", "/healthz failures"], rows)
            + f"\n\nb beside a / b alone: TTFT p50 ×{p50:.2f} (target ≤ {TARGET_P50}: {verdict(p50 <= TARGET_P50)}), "
              f"p99 ×{p99:.2f} (target ≤ {TARGET_P99}: {verdict(p99 <= TARGET_P99)}); b's errors "
              f"{len(alone.errors) + len(beside.errors)}; `/healthz` at most {worst_health:.0f} ms (target "
              f"{TARGET_HEALTH_MS:.0f} ms: {verdict(worst_health <= TARGET_HEALTH_MS)}).\n\n"
              "What tenant a got, per probe (status × count, all rounds):\n\n"
            + markdown_table(["probe", "statuses"], probes)
            + (f"\n\nNot refused (served, or past the client's {CLIENT_TIMEOUT_S:.0f} s: `hang`): "
               + ", ".join(unrefused) + "." if unrefused else "")
            + "\n\nThe CI-sized check is `tests/serve/governance/test_hostile_tenant.py` (no timing asserted but a "
              "10 s bound on `/healthz` as a hang detector; its store's context is 1,024 tokens, so the image and "
              "`n=8` are 400s there; the 2,048-input embedding has its own test: charged before it runs, two at "
              "once admit one and refuse the other, and b is answered meanwhile).")


def _machine() -> str:
    from benchmarks.tools.machine import machine_line

    return machine_line()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale.fairness", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-qwen")
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--per-round", type=int, default=15)
    p.add_argument("--concurrency", type=int, default=3, help="a's probes in flight")
    p.add_argument("--quick", action="store_true", help="2 rounds of 8")
    p.add_argument("--shape", type=Shape, choices=list(Shape), default=Shape.IN_PROCESS,
                   metavar="{in-process,serve}",
                   help="in-process (the default) or serve: one Ray Serve replica per deployment")
    p.add_argument("--skip", action="append", default=[], choices=list(PROBES), metavar="PROBE",
                   help="a probe a leaves out (repeatable): without the 2,048 embedding inputs, a's token bucket is "
                        "not in debt, so its costly probes reach their routes instead of a 429 on arrival; written "
                        "to a section of its own")
    p.add_argument("--a-nice", type=int, default=A_CLIENT_NICE,
                   help=f"niceness of a's client process [{A_CLIENT_NICE}: its CPU is a's machine's, not the "
                        "server's; 0 gives it the server's share of the box]")
    p.add_argument("--no-write", action="store_true", help="do not update docs/RELIABILITY.md")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.per_round = 2, 8
    from benchmarks.tools import ttft_store
    from pipeline.eval import RELIABILITY_MD, write_section
    from schemas.config import ModelSpec
    from schemas.render import RenderSpec

    model = ModelSpec(path=args.model, device="cpu")
    with tempfile.TemporaryDirectory(prefix="qvpic-fairness-") as workdir:
        bench = ttft_store.build(f"{workdir}/store", model, RenderSpec(), 128, args.chunks)
        config = {"store": bench.uri, "model": model.model_dump(mode="json"), "router": {"max_chunks": args.chunks},
                  "ingress": {"default_top_k": min(4, args.chunks), "governance": governance()}}
        with deployed(args.shape, config) as base_url:
            victims, health, hostile_tenant = run(base_url, args.rounds, args.per_round, args.concurrency,
                                                  tuple(args.skip), args.a_nice)
    body = report(victims, health, hostile_tenant, args)
    print(body)
    if not args.no_write:
        title = "A hostile tenant beside a victim (issue 60 item 5)" + (
            "" if args.shape is Shape.IN_PROCESS else ", served as `qvpic serve` deploys (a process per deployment)")
        section = SECTIONS[args.shape]
        if args.skip:
            section, title = section + "-skipping", title + ", a skipping " + "; ".join(args.skip)
        write_section(section, title,
                      ("python -m benchmarks.scale.fairness " + shlex.join(argv)).strip(), body, path=RELIABILITY_MD)
    return 0


if __name__ == "__main__":
    sys.exit(main())
