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
from dataclasses import dataclass
from enum import Enum
from itertools import product

import torch

from benchmarks.perf import ttft_http
from benchmarks.tools import ttft_store
from jobs.eval_serving import InProcessAnswerer
from pipeline.eval import markdown_table, write_section
from pipeline.runtime import resolve_device
from pipeline.store import Store
from schemas.api import AnswerRequest
from schemas.config import DType, ModelSpec
from schemas.modes import Mode
from schemas.render import RenderSpec

F32, BF16 = DType.FLOAT32, DType.BFLOAT16
PHASES = ("route_ms", "load_ms", "render_ms", "reanchor_ms", "prefill_ms")
BASELINES = (Mode.FULL_IMAGE, Mode.FULL_TEXT, Mode.TEXT_PIC)
HTTP_CHUNKS = 16
# qvpic_plain / qvpic_dummy route over ablation variants this lean store has at the lowest tier only
# (they would serve image_pic's plan): `qvpic eval --paper` measures them on an `--ablation-tiers every` store
MODES = tuple(m for m in Mode if m not in (Mode.QVPIC_PLAIN, Mode.QVPIC_DUMMY))


class CacheState(str, Enum):
    COLD = "cold"  # hot tier and host cache emptied first: KV read from the store
    WARM = "warm"  # the same request again, right after the cold one


@dataclass(frozen=True)
class Setup:
    model: str
    dtype: DType
    chunk_counts: tuple[int, ...]


# bench-qwen float32 stops at 16 chunks: CPU float32 attention over ~8k tokens takes ~40 s per full prefill.
DEFAULT_GRID = (Setup("tiny-qwen", F32, (4, 8, 16, 32)), Setup("tiny-qwen", BF16, (4, 8, 16, 32)),
                Setup("bench-qwen", BF16, (4, 8, 16, 32)), Setup("bench-qwen", F32, (4, 8, 16)))
QUICK_GRID = (Setup("tiny-qwen", F32, (4, 16)), Setup("bench-qwen", BF16, (4, 16)))


@dataclass(frozen=True)
class Cell:
    """Medians of one (setup, number of chunks, mode, cache state)."""

    model: str
    dtype: DType
    num_chunks: int
    mode: Mode
    cache: CacheState
    ttft_ms: float
    phases_ms: dict[str, float]
    context_tokens: int
    vision_tokens: int


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


def _cell(cells: list[Cell], setup: Setup, num_chunks: int, mode: Mode, cache: CacheState = CacheState.COLD) -> Cell:
    return next(c for c in cells if (c.model, c.dtype, c.num_chunks, c.mode, c.cache)
                == (setup.model, setup.dtype, num_chunks, mode, cache))


def _ms(value: float) -> int | float:
    """Whole milliseconds from 100 ms up (no 1.4e+04 in a table), else one decimal."""
    return round(value) if abs(value) >= 100 else round(value, 1)


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


def tables(cells: list[Cell], setups: list[Setup], kv: list[list[object]], http: ttft_http.HttpTtft | None) -> str:
    modes = list(MODES)
    ttft_rows, token_rows, breakdown_rows, growth_rows = [], [], [], []
    seen_models: set[str] = set()
    for setup in setups:
        first_of_model = setup.model not in seen_models  # token counts do not depend on the dtype
        seen_models.add(setup.model)
        for n, cache in product(setup.chunk_counts, CacheState):
            by_mode = {m: _cell(cells, setup, n, m, cache) for m in modes}
            q = by_mode[Mode.QVPIC].ttft_ms
            ttft_rows.append([setup.model, setup.dtype.value, n, cache.value] + [_ms(by_mode[m].ttft_ms) for m in modes]
                             + [q / by_mode[b].ttft_ms for b in BASELINES])
            if first_of_model and cache is CacheState.COLD:
                token_rows.append([setup.model, n] + [f"{by_mode[m].context_tokens} ({by_mode[m].vision_tokens})"
                                                      for m in modes])
        n_mid = max((n for n in setup.chunk_counts if n <= 16), default=min(setup.chunk_counts))
        for mode, cache in product(modes, CacheState):
            c = _cell(cells, setup, n_mid, mode, cache)
            breakdown_rows.append([setup.model, setup.dtype.value, n_mid, mode.value, cache.value, _ms(c.ttft_ms)]
                                  + [_ms(c.phases_ms[p]) for p in PHASES]
                                  + [_ms(c.ttft_ms - sum(c.phases_ms.values()))])
        lo, hi = min(setup.chunk_counts), max(setup.chunk_counts)
        growth_rows.append([setup.model, setup.dtype.value, f"{lo} → {hi}"]
                           + [_cell(cells, setup, hi, m).context_tokens / _cell(cells, setup, lo, m).context_tokens
                              for m in (Mode.FULL_TEXT, Mode.QVPIC)]
                           + [_cell(cells, setup, hi, m).ttft_ms / _cell(cells, setup, lo, m).ttft_ms for m in modes])
    ratio_names = [f"qvpic / {b.value}" for b in BASELINES]
    out = [
        "TTFT, median ms (wall: route + load + generate one token), cold (hot tier and host cache emptied: KV "
        "from the store) and warm (the same request again):\n",
        markdown_table(["model", "dtype", "chunks", "cache"] + [m.value for m in modes] + ratio_names, ttft_rows),
        "\nContext tokens (of which vision tokens) per request:\n",
        markdown_table(["model", "chunks"] + [m.value for m in modes], token_rows),
        "\nScaling from the fewest to the most chunks: growth of context tokens and of cold TTFT (× = ratio):\n",
        markdown_table(["model", "dtype", "chunks", "tokens × full_text", "tokens × qvpic"]
                       + [f"TTFT × {m.value}" for m in modes], growth_rows),
        "\nBreakdown, median ms (other = wall − phases: first-token pick, detokenising, event loop):\n",
        markdown_table(["model", "dtype", "chunks", "mode", "cache", "TTFT", "route", "load", "render", "re-anchor",
                        "prefill", "other"], breakdown_rows),
        "\nKV bytes per chunk per stored representation:\n",
        markdown_table(["model", "dtype", "entry", "tokens / chunk", "KiB / chunk", "× text KV"], kv),
    ]
    if http is not None:
        hops_ms = http.client_ms - http.route_ms - http.load_ms - http.reanchor_ms - http.prefill_ms
        out += [(f"\nOnline path over HTTP (Serve on loopback, {http.mode.value}, {http.num_chunks} chunks, "
                 f"{http.context_tokens} context tokens, medians of ≥ {HTTP_REPEATS} requests; target: everything "
                 "but the query prefill ≤ 25% of TTFT), "
                 "and the limit measured in the same run: the same hops through no-op deployments and the query "
                 "embedding alone:\n"),
                markdown_table(["", "client TTFT ms", "route ms", "load ms", "re-anchor ms", "prefill ms",
                                "Serve hops, HTTP, JSON ms", "added by the online path"],
                               [["qvpic", _ms(http.client_ms), _ms(http.route_ms), _ms(http.load_ms),
                                 _ms(http.reanchor_ms), _ms(http.prefill_ms), _ms(hops_ms),
                                 f"{http.overhead_share:.1%}"],
                                ["the limit", "", f"{_ms(http.embed_ms)} (embedding alone)", "", _ms(http.reanchor_ms),
                                 _ms(http.prefill_ms), f"{_ms(http.serve_floor_ms)} (no-op deployments)",
                                 f"{http.floor_share:.1%}"]])]
    return "\n".join(out + [targets(cells, setups, http), READING])


TARGETS = ((Mode.FULL_IMAGE, 0.15), (Mode.TEXT_PIC, 0.85))
HTTP_SHARE_TARGET = 0.25
HTTP_REPEATS = 15  # at least: a request costs ~0.1 s over HTTP, and its hops vary more than a forward
READING = """
How to read these numbers. Every linked mode pays the same fixed costs per request: embedding the
query for routing (MiniLM on the CPU: the route column), planning, and the query prefill itself,
which for a 100M-parameter model on a CPU costs tens of milliseconds however short the cache. The
online baselines pay a prefill that grows with the context (full_text fastest: it has the most
tokens, and attention is quadratic), and full_image also renders and encodes every page. So the
ratios improve with the number of chunks, and with the tiny model (whose prefill is nearly free) they
stay near 1 until the context is long. qvpic beats text_pic by caching fewer tokens per chunk (the KV
table): less to re-anchor and a shorter cache for the query to attend to. Over HTTP, the Serve hops,
JSON and the query embedding are fixed costs of the same order as a CPU query prefill: the limit row
shows what remains when the engine adds nothing (a Serve hop costs a few milliseconds on two busy
cores, and MiniLM's forward over a short query ~12 ms on one). A GPU shrinks the prefill, so that
share only falls if those costs shrink too (batched query embedding, an embedder on the GPU)."""


def targets(cells: list[Cell], setups: list[Setup], http: ttft_http.HttpTtft | None) -> str:
    """Issue 5's targets, checked at 16 chunks for every setup that has them."""
    rows = []
    for setup, cache in product((s for s in setups if HTTP_CHUNKS in s.chunk_counts), CacheState):
        qvpic = _cell(cells, setup, HTTP_CHUNKS, Mode.QVPIC, cache).ttft_ms
        for baseline, target in TARGETS:
            ratio = qvpic / _cell(cells, setup, HTTP_CHUNKS, baseline, cache).ttft_ms
            rows.append([f"TTFT(qvpic) / TTFT({baseline.value}) ≤ {target}, {cache.value}",
                         f"{setup.model} {setup.dtype.value}", round(ratio, 3), "met" if ratio <= target else "missed"])
    if http is not None:
        rows.append([f"online path share of TTFT ≤ {HTTP_SHARE_TARGET:.0%}", "HTTP, see above",
                     f"{http.overhead_share:.1%}", ("met" if http.overhead_share <= HTTP_SHARE_TARGET else "missed")
                     + f" (the limit on this machine: {http.floor_share:.1%})"])
    if not rows:
        return ""
    return f"\nTargets (issues 5 and 7) at {HTTP_CHUNKS} chunks:\n\n" + markdown_table(
        ["target", "setup", "measured", ""], rows)


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
