"""`qvpic` — one console command; each subcommand is a job module also runnable as `python -m jobs.<name>`."""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "demo": ("jobs.demo", "ingest the bundled corpus, serve it, ask questions over HTTP"),
    "ingest": ("jobs.ingest", "corpus → chunks → renders → embeddings → KV shards + Parquet index"),
    "recompile": ("jobs.recompile", "rebuild stale or missing KV entries after a model/template/renderer change"),
    "publish": ("jobs.publish", "snapshot a store into a new serving generation (running services switch to it)"),
    "verify": ("jobs.verify", "check a store's consistency (parts, index rows, shards, orphans); --repair fixes"),
    "serve": ("jobs.run_server", "run the Ray Serve application over a store"),
    "eval": ("jobs.evaluate", "quality and TTFT of every mode on LongBench-format data"),
    "bench": ("jobs.bench", "benchmark suites (default: the fast ones); each writes docs/BENCHMARKS.md"),
    "estimate": ("jobs.estimate", "pages, pixels and vision tokens per tier, before any model runs"),
    "cost-report": ("jobs.cost_report", "per-tenant / per-task cost table from a request log"),
}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = ["usage: qvpic <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "`qvpic <command> --help` shows a command's options. Jobs print progress and summaries; "
              "--verbose", "(or QVPIC_LOG_LEVEL=INFO) adds Ray's and the libraries' own logs."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in {"-h", "--help"}:
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"qvpic: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    from jobs import logs

    logs.as_program()
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
