"""`qvpic bench [SUITE] [options]`: run benchmark suites; each writes its section of docs/BENCHMARKS.md.

`qvpic bench` (or `qvpic bench all`) runs the fast suites one after another with their quick settings,
`qvpic bench SUITE` runs one, `qvpic bench SUITE --help` shows its options, `qvpic bench --help` lists them.
Every request a suite times bypasses the server's response cache (`Cache-Control: no-cache`).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Suite:
    name: str
    module: str
    about: str
    quick_argv: tuple[str, ...] | None  # what `all` passes; None: not part of `all` (slow, or needs a service)

    @property
    def available(self) -> bool:
        return importlib.util.find_spec(self.module) is not None


SUITES: tuple[Suite, ...] = (
    Suite("ttft", "benchmarks.ttft", "TTFT per mode, breakdown, scaling, KV bytes, HTTP share",
          ("--quick",)),
    Suite("batching", "benchmarks.batching", "batched vs serialised engine: tokens/s and TTFT at 1/4/16 clients, "
          "device hot tier", ("--quick",)),
    Suite("structured", "benchmarks.structured", "json_schema, forced tool call and logprobs vs plain: decode cost "
          "per token at 1/16 clients", ("--quick",)),
    Suite("mutations", "benchmarks.mutations", "a fixed list of mutations, each against the tests meant to catch it",
          None),
    Suite("store-check", "benchmarks.store_check", "start-up parts check and `qvpic verify` cost vs parts and rows",
          ("--quick",)),
    Suite("runtime", "benchmarks.runtime", "full prefill vs query-only prefill, re-anchoring cost",
          ("--dtypes", "bfloat16", "--repeats", "3")),
    Suite("ingest", "benchmarks.ingest", "Ray Data compile throughput per model and actor count", None),
    Suite("legibility", "benchmarks.legibility", "OCR accuracy vs vision tokens per font size and DPI", ()),
    Suite("render", "benchmarks.render_throughput", "renderer pages/s per DPI and script", ()),
    Suite("governance", "benchmarks.governance", "tenant quotas, cost accounting and admission overheads", None),
    Suite("load", "benchmarks.load", "concurrent load on the Serve app: throughput, latency, failures", None),
    Suite("fidelity", "benchmarks.fidelity", "fidelity to full prefill: template vs prefix-free vs dummy prefix",
          None),
    Suite("real-shapes", "benchmarks.real_shapes", "exactness at the real models' shapes: every case of "
          "tests/test_real_shapes.py", None),
    Suite("recompute", "benchmarks.recompute", "selective recompute across chunks: fidelity gained vs TTFT "
          "(leading k, deviation r)", None),
)
BY_NAME = {s.name: s for s in SUITES}


class SuiteError(ValueError):
    """An unknown suite, one this checkout lacks, or options a suite does not take."""


def listing() -> str:
    width = max(len(s.name) for s in SUITES)
    lines = ["usage: qvpic bench [SUITE [options]]   (no SUITE: all; qvpic bench SUITE --help: its options)", "",
             "Each suite writes its section of docs/BENCHMARKS.md.", "", "suites:"]
    for s in SUITES:
        notes = [] if s.available else ["not in this checkout"]
        if s.quick_argv is not None:
            notes.append("in `all`" + (f" as {' '.join(s.quick_argv)}" if s.quick_argv else ""))
        lines.append(f"  {s.name:<{width}}  {s.about}" + (f"  [{'; '.join(notes)}]" if notes else ""))
    lines += ["", f"  {'all':<{width}}  the fast suites with their quick settings (the default)"]
    return "\n".join(lines)


def run_suite(name: str, argv: list[str]) -> int:
    suite = BY_NAME.get(name)
    if suite is None:
        raise SuiteError(f"unknown suite {name!r}; known: {', '.join(BY_NAME)}, all")
    if not suite.available:
        raise SuiteError(f"suite {name!r} ({suite.module}) is not in this checkout")
    main = importlib.import_module(suite.module).main
    if inspect.signature(main).parameters:
        return int(main(argv) or 0)
    if argv:
        raise SuiteError(f"suite {name!r} takes no options, got {argv}")
    return int(main() or 0)


def run_all() -> int:
    outcomes = []
    for suite in (s for s in SUITES if s.quick_argv is not None and s.available):
        print(f"== qvpic bench {suite.name} {' '.join(suite.quick_argv)}", flush=True)
        started = time.perf_counter()
        code = run_suite(suite.name, list(suite.quick_argv))
        outcomes.append((suite.name, code, time.perf_counter() - started))
    for name, code, wall_s in outcomes:
        print(f"{name:<12} {'ok' if code == 0 else f'exit {code}'}  {wall_s:.0f} s")
    return max((code for _, code, _ in outcomes), default=0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in {"-h", "--help", "list"}:
        print(listing())
        return 0
    argv = argv or ["all"]
    try:
        if argv[0] == "all":
            if argv[1:]:
                raise SuiteError("`all` takes no options: run a suite by name to pass some")
            return run_all()
        return run_suite(argv[0], argv[1:])
    except SuiteError as error:
        print(f"qvpic bench: {error}\n\n{listing()}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
