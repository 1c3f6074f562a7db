"""`qvpic bench [SUITE] [options]`: run benchmark suites; each writes its section of docs/BENCHMARKS.md.

`qvpic bench` (or `qvpic bench all`) runs the fast suites one after another with their quick settings,
`qvpic bench SUITE` runs one, `qvpic bench SUITE --help` shows its options, `qvpic bench --list` lists every
benchmark by group (the table: jobs/bench_suites.py; the modules: benchmarks/<group>/).
Every request a suite times bypasses the server's response cache (`Cache-Control: no-cache`).
"""

from __future__ import annotations

import importlib
import inspect
import sys
import time

from jobs.bench_suites import GROUPS, SUITES, Suite  # noqa: F401  (Suite: for callers building suites)

BY_NAME = {s.name: s for s in SUITES}


class SuiteError(ValueError):
    """An unknown suite, one this checkout lacks, or options a suite does not take."""


def listing() -> str:
    width = max(len(s.name) for s in SUITES)
    lines = ["usage: qvpic bench [SUITE [options]]   (no SUITE: all; qvpic bench SUITE --help: its options)", "",
             "Each suite writes its section of docs/BENCHMARKS.md; [all: ...] marks those `all` runs, with what it "
             "passes.", "Each runs as `python -m benchmarks.GROUP.MODULE` too (MODULE: the suite's name with _ for -, "
             "unless named)."]
    groups = list(GROUPS) + sorted({s.group for s in SUITES} - set(GROUPS))
    for group in groups:
        suites = [s for s in SUITES if s.group == group]
        if suites:
            lines += ["", f"{group}: {GROUPS[group]}" if group in GROUPS else group]
        for s in suites:
            notes = [] if s.available else ["not in this checkout"]
            if s.module.rpartition(".")[2] != s.name.replace("-", "_"):
                notes.append(f"module {s.module}")
            if s.quick_argv is not None:
                notes.append("all" + (f": {' '.join(s.quick_argv)}" if s.quick_argv else ""))
            lines.append(f"  {s.name:<{width}}  {s.about}" + (f"  [{'; '.join(notes)}]" if notes else ""))
    lines += ["", f"  {'all':<{width}}  the suites marked [all], with their quick settings (the default)"]
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
    width = max((len(name) for name, _, _ in outcomes), default=0)
    for name, code, wall_s in outcomes:
        print(f"{name:<{width}}  {'ok' if code == 0 else f'exit {code}'}  {wall_s:.0f} s")
    return max((code for _, code, _ in outcomes), default=0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in {"-h", "--help", "--list", "list"}:
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
