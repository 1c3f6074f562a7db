"""One answer streamed through a live qvpic server, and where the CPU went meanwhile: ms per token over HTTP, and
each process's CPU time per token (the generator, the ingress, Serve's proxy, the client…). On a small node the
serving stack's own work per token shares the cores with the forward, so this is the figure beside `limits`'
one-token forward. Not in CI (it starts Ray and Serve).

    python -m benchmarks.perf.served_stream                     # bench-qwen float32, 3 answers of 200 tokens
    python -m benchmarks.perf.served_stream --dtype bfloat16 --no-write
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

from benchmarks.peer.conversation import streamed
from benchmarks.peer.servers import qvpic_server
from benchmarks.peer.speed import build_corpus
from benchmarks.tools.machine import machine_line
from jobs.help import HelpFormatter
from pipeline.eval import markdown_table, write_section
from schemas.config import DType, ModelSpec

CHUNKS, ANSWERS, WARM_UP = 8, 3, 2
CLOCK_TICK_MS = 1e3 / os.sysconf("SC_CLK_TCK")


def cpu_ms() -> dict[str, float]:
    """Every process's user + system CPU so far (ms), by a short name from its command line."""
    out: dict[str, float] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # it ended meanwhile
            continue
        words = command.split()
        name = (" ".join(Path(w).name for w in words[:3]) if words and "/" in words[0]  # a plain program
                else words[0].removeprefix("ray::").split(".")[0] if words else f"pid {pid}")[:48]
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) * CLOCK_TICK_MS
    return out


def run(spec: ModelSpec, tokens: int, workdir: Path) -> str:
    corpus = build_corpus(spec, workdir, CHUNKS)
    body = {"model": "qvpic", "messages": [{"role": "user", "content": corpus.query}], "max_tokens": tokens,
            "temperature": 0.0, "qvpic": {"top_k": CHUNKS, "max_high_res": 0, "mode": "qvpic"}}
    rows, per_token, per_process = [], [], []
    with qvpic_server(spec, corpus.store_uri) as url, httpx.Client(timeout=900) as client:
        for _ in range(WARM_UP):
            streamed(client, url, body, {"Cache-Control": "no-cache"})
        for _ in range(ANSWERS):
            before = cpu_ms()
            reply = streamed(client, url, body, {"Cache-Control": "no-cache"})
            first_ms, total_ms, n = reply["ttft_ms"], reply["total_ms"], reply["tokens"]
            after = cpu_ms()
            ms_per_token = (total_ms - first_ms) / max(1, n - 1)
            per_token.append(ms_per_token)
            per_process.append({k: (after[k] - before.get(k, 0.0)) / max(1, n) for k in after})
            rows.append([len(rows) + 1, n, first_ms, ms_per_token])
    names = sorted(per_process[0], key=lambda k: -statistics.median(p.get(k, 0.0) for p in per_process))
    cpu_rows = [[k, statistics.median(p.get(k, 0.0) for p in per_process)] for k in names[:8]]
    return (f"Machine: {machine_line()}. {spec.path} {spec.dtype.value}, qvpic alone: {ANSWERS} answers of up to "
            f"{tokens} tokens (greedy) over {CHUNKS} linked chunks, after {WARM_UP} not timed; the generator's "
            "forwards on its CPU reservation rounded up (benchmarks/peer/servers.py `qvpic_server`).\n\n"
            + markdown_table(["answer", "tokens", "TTFT ms", "ms per token after the first"], rows)
            + f"\n\nMedian {statistics.median(per_token):.2f} ms per token. CPU per generated token, by process "
            "(medians over the answers; a process at 2 threads can use up to twice the wall time):\n\n"
            + markdown_table(["process", "CPU ms per token"], cpu_rows) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.perf.served_stream", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default="bench-qwen")
    p.add_argument("--dtype", type=DType, default=DType.FLOAT32, choices=list(DType))
    p.add_argument("--tokens", type=int, default=200, help="max_tokens of each answer")
    p.add_argument("--no-write", action="store_true", help="do not update docs/BENCHMARKS.md")
    args = p.parse_args(argv)
    spec = ModelSpec(path=args.model, dtype=args.dtype, device="cpu")
    with tempfile.TemporaryDirectory(prefix="qvpic-stream-") as workdir:
        body = run(spec, args.tokens, Path(workdir))
    print(body)
    if not args.no_write:
        command = "python -m benchmarks.perf.served_stream" + (
            f" --dtype {args.dtype.value}" if args.dtype != DType.FLOAT32 else "")
        print(write_section("served-stream", "One answer streamed: ms per token and the CPU each process spent",
                            command, body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
