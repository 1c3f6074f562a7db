"""Serve's floor with calls between deployments by value over gRPC against Ray actor calls, side by side.

qvpic's ingress calls its router and generator through Serve handles as Ray actor calls (Serve's default,
`_by_reference=True`). Serve can also send a handle call by value to the replica's inter-deployment gRPC server
(`_by_reference=False`; Ray's high-throughput mode, `RAY_SERVE_THROUGHPUT_OPTIMIZED`, does that). This benchmark
deploys Serve's floor app of qvpic's shape (benchmarks/peer/serve_floor.py: a request through an ingress, a
route hop and a generate hop, with nothing to do at any stop) once per transport, as two applications of one Serve
instance, and sends their requests alternately, one by one, so both see the same machine and the same state.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import httpx

from benchmarks.batching import percentile
from benchmarks.machine import machine_line
from jobs.help import HelpFormatter
from pipeline.eval import markdown_table, write_section

TRANSPORTS = {"grpc": False, "object_ref": True}  # name → Serve's handle option `_by_reference`


def run(requests: int, warmup: int) -> dict[str, list[tuple[float, dict[str, float]]]]:
    """{transport: [(HTTP ms, the floor ingress's own account)]}, the arms' requests alternated one by one."""
    from ray import serve

    from benchmarks.peer import serve_floor
    from benchmarks.peer.servers import start_serve

    url = start_serve()
    apps = {name: f"floor-{name}" for name in TRANSPORTS}  # one Serve application per arm, routed at /<app>
    for name, by_reference in TRANSPORTS.items():
        serve_floor.deploy(by_reference, apps[name])
    out: dict[str, list] = {name: [] for name in TRANSPORTS}
    try:
        with httpx.Client(timeout=600) as client:
            for n in range(warmup + requests):
                for name in (list(TRANSPORTS) if n % 2 else list(TRANSPORTS)[::-1]):  # neither arm always first
                    row = serve_floor.ask(client, url, {"query": "q"}, "/" + apps[name])
                    if n >= warmup:
                        out[name].append(row)
    finally:
        serve.shutdown()
    return out


def report(out: dict[str, list[tuple[float, dict[str, float]]]], requests: int) -> str:
    base = statistics.median(ms for ms, _ in out["object_ref"])
    rows = []
    for name, cell in out.items():
        ms = [m for m, _ in cell]
        p50 = statistics.median(ms)
        server, route, generate = (statistics.median(s[h] for _, s in cell)
                                   for h in ("server_ms", "route_hop_ms", "generate_hop_ms"))
        rows.append([name, round(p50, 1), round(percentile(ms, 90), 1), round(server, 1), round(p50 - server, 1),
                     round(route, 2), round(generate, 2), f"{p50 / base:.2f}×"])
    return (f"Machine: {machine_line()}. {requests} measured requests per arm after a warm-up, the arms alternated "
            "request by request (each round's order reversed from the last); medians unless a column says p90. "
            "`server ms`: the floor ingress's own account, its two hops included; the rest of the HTTP time is "
            "the client, Serve's proxy and the hop into the ingress.\n\n"
            + markdown_table(["transport", "HTTP p50 ms", "HTTP p90 ms", "server ms", "HTTP - server ms",
                              "route hop ms", "generate hop ms", "HTTP / object_ref"], rows) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve_transport", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--requests", type=int, default=300, help="measured requests per arm")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--no-write", action="store_true", help="do not update docs/BENCHMARKS.md")
    args = p.parse_args(argv)
    body = report(run(args.requests, args.warmup), args.requests)
    print(body)
    if not args.no_write:
        print(write_section("serve-transport", "Serve's floor: gRPC by value against Ray actor calls",
                            "python -m benchmarks.serve_transport", body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
