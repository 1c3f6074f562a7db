"""TTFT of every serving mode side by side, with its breakdown and the HTTP share.

    python -m benchmarks.perf.ttft            # full grid, writes docs/BENCHMARKS.md section `ttft` (≈10 min, 2 cores)
    python -m benchmarks.perf.ttft --quick    # tiny + bench model, 4 and 16 chunks (19 min on 2 AVX2 cores: bf16)

For each (model, dtype) a store of synthetic chunks is compiled by the real ingest stages
(`benchmarks/tools/ttft_store.py`), then the real Router / CacheLoader / Generator serve every mode in this
process: TTFT = wall time of route + load + generate with one new token (its first token is picked
from the prefill logits, so no decode step runs; reading it waits for any GPU work). Every mode is
measured cold (the generator's device hot tier and the loader's host cache emptied first: its KV is read
from the store) and warm (the same request again at once), as `qvpic eval` does (pipeline/eval/runner.py).
Modes run in an order shuffled per round (seeded, `--seed`) so neither machine drift nor a neighbour's
loads favour one; figures are medians of `--repeats` rounds after warm-up rounds. The breakdown comes
from the roles' own timers. Finally the online path is measured once over HTTP (`benchmarks/perf/ttft_http.py`).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from itertools import product

import torch

from benchmarks.perf import ttft_http
from benchmarks.perf.ttft_report import (
    HTTP_CHUNKS,
    HTTP_REPEATS,
    MODES,
    PHASES,
    CacheState,
    Cell,
    Setup,
    _cell,
    tables,
)
from benchmarks.tools import ttft_store
from jobs.eval_serving import InProcessAnswerer
from pipeline.eval import write_section
from pipeline.runtime import resolve_device
from pipeline.store import Store
from schemas.api import AnswerRequest
from schemas.config import DType, ModelSpec
from schemas.modes import Mode
from schemas.render import RenderSpec

F32, BF16 = DType.FLOAT32, DType.BFLOAT16


# bench-qwen float32 stops at 16 chunks: CPU float32 attention over ~8k tokens takes ~40 s per full prefill.
DEFAULT_GRID = (Setup("tiny-qwen", F32, (4, 8, 16, 32)), Setup("tiny-qwen", BF16, (4, 8, 16, 32)),
                Setup("bench-qwen", BF16, (4, 8, 16, 32)), Setup("bench-qwen", F32, (4, 8, 16)))
QUICK_GRID = (Setup("tiny-qwen", F32, (4, 16)), Setup("bench-qwen", BF16, (4, 16)))


Sample = tuple[float, dict[str, float], int, int]  # wall ms, phases ms, context tokens, vision tokens


def timed(answer: InProcessAnswerer, request: AnswerRequest) -> Sample:
    started = time.perf_counter()
    report = answer(request).report
    wall_ms = (time.perf_counter() - started) * 1e3
    timings = report.timings.model_dump()
    return wall_ms, {p: timings[p] for p in PHASES}, report.usage.context_tokens, report.usage.context_vision_tokens


def measure(answer: InProcessAnswerer, setup: Setup, chunk_ids: tuple[str, ...], query: str,
            repeats: int, rng: random.Random) -> list[Cell]:
    cells = []
    for num_chunks in setup.chunk_counts:
        requests = {m: AnswerRequest(query=query, chunk_ids=list(chunk_ids[:num_chunks]), mode=m, max_new_tokens=1)
                    for m in MODES}
        runs: dict[tuple[Mode, CacheState], list[Sample]] = {(m, c): [] for m in MODES for c in CacheState}
        # Warm-up rounds pay first-call costs; the first size also lets the process settle after the store
        # build (allocator growth, lazy inits).
        num_warmup = 2 if num_chunks == setup.chunk_counts[0] else 1
        for round_index in range(num_warmup + repeats):
            for mode in rng.sample(MODES, len(MODES)):
                answer.clear_caches()
                cold, warm = timed(answer, requests[mode]), timed(answer, requests[mode])
                if round_index >= num_warmup:
                    runs[(mode, CacheState.COLD)].append(cold)
                    runs[(mode, CacheState.WARM)].append(warm)
        for (mode, cache), samples in runs.items():
            cells.append(Cell(setup.model, setup.dtype, num_chunks, mode, cache,
                              statistics.median(s[0] for s in samples),
                              {p: statistics.median(s[1][p] for s in samples) for p in PHASES}, samples[0][2],
                              samples[0][3]))
        ratios = {c: _cell(cells, setup, num_chunks, Mode.QVPIC, c).ttft_ms
                  / _cell(cells, setup, num_chunks, Mode.FULL_IMAGE, c).ttft_ms for c in CacheState}
        print(f"{setup.model} {setup.dtype.value} {num_chunks:>2} chunks: "
              + ", ".join(f"{m.value} {_cell(cells, setup, num_chunks, m).ttft_ms:.0f}"
                          f"/{_cell(cells, setup, num_chunks, m, CacheState.WARM).ttft_ms:.0f} ms" for m in MODES)
              + " (cold/warm) | qvpic/full_image " + ", ".join(f"{c.value} {r:.3f}" for c, r in ratios.items()),
              flush=True)
    return cells


def kv_rows(store_uri: str, setup: Setup) -> list[list[object]]:
    """Tokens and KV bytes per chunk of every stored representation, and the ratio to the text KV."""
    index = Store.open(store_uri).index().to_pylist()
    groups: dict[str, list[dict]] = {}
    for row in index:
        groups.setdefault(f"{row['tier'] or 'text'}.{row['variant']}", []).append(row)
    text_nbytes = statistics.fmean(r["nbytes"] for r in groups["text.text"])
    return [[setup.model, setup.dtype.value, name, statistics.fmean(r["num_tokens"] for r in rows),
             statistics.fmean(r["nbytes"] for r in rows) / 1024,
             statistics.fmean(r["nbytes"] for r in rows) / text_nbytes]
            for name, rows in sorted(groups.items())]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qvpic bench ttft", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the quick grid (tiny f32 + bench bf16 at 4 and 16 chunks)")
    p.add_argument("--models", nargs="+", help="override the grid: these models × --dtypes × --chunks")
    p.add_argument("--dtypes", nargs="+", type=DType, choices=[d.value for d in DType], default=[F32, BF16])
    p.add_argument("--chunks", nargs="+", type=int, default=[4, 8, 16, 32])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffled mode order of every round")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's own choice)")
    p.add_argument("--http-model", default="bench-qwen",
                   help=f"model of the HTTP measurement (bf16, {HTTP_CHUNKS} chunks)")
    p.add_argument("--no-http", action="store_true", help="skip the HTTP measurement")
    p.add_argument("--out", help="also write the tables to this file")
    p.add_argument("--no-write", action="store_true", help="do not update docs/BENCHMARKS.md")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if args.repeats < 1 or min(args.chunks) < 2:
        parser().error("--repeats must be >= 1 and every --chunks value >= 2")
    setups = ([Setup(m, d, tuple(args.chunks)) for m, d in product(args.models, args.dtypes)] if args.models
              else list(QUICK_GRID if args.quick else DEFAULT_GRID))
    if args.threads:
        torch.set_num_threads(args.threads)
    device = str(resolve_device(args.device))
    started = time.perf_counter()
    command = ("python -m benchmarks.perf.ttft " + " ".join(argv)).strip()
    cells, kv, http_target, rng = [], [], None, random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="qvpic-ttft-") as workdir:
        for setup in setups:
            spec = ModelSpec(path=setup.model, dtype=setup.dtype, device=device)
            bench = ttft_store.build(os.path.join(workdir, f"{setup.model}-{setup.dtype.value}"), spec, RenderSpec(),
                                     args.chunk_tokens, max(setup.chunk_counts))
            cells += measure(InProcessAnswerer.open(bench.uri, spec), setup, bench.chunk_ids, bench.query, args.repeats,
                             rng)
            kv += kv_rows(bench.uri, setup)
            if setup.model == args.http_model and setup.dtype is BF16 and max(setup.chunk_counts) >= HTTP_CHUNKS:
                http_target = (bench, spec)
        # written before the HTTP part, which starts Ray and Serve: a failure there keeps these figures
        report(args, command, device, started, tables(cells, setups, kv, None), http_pending=not args.no_http)
        if not args.no_http and http_target is not None:
            bench, spec = http_target
            http = ttft_http.measure(bench.uri, spec, list(bench.chunk_ids[:HTTP_CHUNKS]), bench.query,
                                     max(args.repeats, HTTP_REPEATS))
            report(args, command, device, started, tables(cells, setups, kv, http))
    return 0


def report(args: argparse.Namespace, command: str, device: str, started: float, tables_md: str,
           http_pending: bool = False) -> None:
    """Print the tables and write them to --out and (unless --no-write) docs/BENCHMARKS.md."""
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else platform.processor() or "cpu"
    body = (f"Device {device} ({name}, {torch.get_num_threads()} torch threads), chunks of ≤{args.chunk_tokens} "
            "text tokens from one synthetic document rendered at 9 pt (tiers 72/120 DPI), a synthetic question "
            f"whose evidence is in chunk 2; router τ=0.5, B=4; medians of {args.repeats} rounds, cold then warm per "
            f"mode, modes shuffled per round (seed {args.seed}), after a warm-up round (two for the first size). "
            f"Wall time {time.perf_counter() - started:.0f} s"
            f"{' before the HTTP part' if http_pending else ''}.\n\n{tables_md}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(f"# TTFT\n\nCommand: `{command}`\n\n{body}\n")
    if not args.no_write:
        write_section("ttft", "TTFT per mode, breakdown, scaling and KV bytes (issues 5 and 7)", command, body)
    print(body, flush=True)


if __name__ == "__main__":
    sys.exit(main())
