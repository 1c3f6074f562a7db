"""Ingestion benchmark: compile throughput per model and actor count, and KV bytes per representation.

Each configuration ingests the bundled sample corpus into a fresh local store through the real Ray
Data graph (read → chunk → dedup → render → embed → compile → write → publish), in one Ray session.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from jobs.cluster import init_ray
from pipeline.eval import markdown_table, write_section
from pipeline.ingest import CompileResources, IngestConfig, ingest
from schemas.config import ModelSpec
from schemas.store import StoreSpec

SCALING_NOTE = (" A second actor cannot speed this up here: both compete for the same two cores that one actor's "
                "torch already uses; on a cluster each actor holds its own GPU.")
SAMPLE_CORPUS = Path(__file__).resolve().parents[2] / "jobs" / "data" / "sample_corpus.jsonl"


def run_once(model: str, workers: int, corpus: Path) -> tuple[float, dict, int]:
    with tempfile.TemporaryDirectory() as store_dir:
        cfg = IngestConfig(corpus=str(corpus), store=StoreSpec(uri=store_dir), model=ModelSpec(path=model),
                           resources=CompileResources(workers=workers))
        started = time.perf_counter()
        summary = ingest(cfg)
        wall_s = time.perf_counter() - started
    assert summary.balanced
    return wall_s, summary.per_entry_group, summary.num_chunks_compiled


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.perf.ingest", description=__doc__)
    parser.add_argument("--models", nargs="+", default=["tiny-qwen", "bench-qwen"])
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--corpus", type=Path, default=SAMPLE_CORPUS)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    init_ray()
    for model in args.models:  # materialise checkpoints and warm caches outside the timings
        run_once(model, 1, args.corpus)
    throughput_rows, bytes_rows = [], []
    for model in args.models:
        for workers in args.workers:
            runs = [run_once(model, workers, args.corpus) for _ in range(args.repeats)]
            wall_s = statistics.median(r[0] for r in runs)
            groups, num_chunks = runs[0][1], runs[0][2]
            throughput_rows.append([model, workers, num_chunks, wall_s, num_chunks / wall_s])
            print(throughput_rows[-1], flush=True)
        text = groups.get("text.text", {"nbytes": 0, "entries": 1})
        text_per_chunk = text["nbytes"] / text["entries"]
        for name, g in groups.items():
            per_chunk = g["nbytes"] / g["entries"]
            bytes_rows.append([model, name, g["entries"], g["vision_tokens"] / g["entries"], per_chunk / 1024,
                               per_chunk / text_per_chunk if text_per_chunk else float("nan")])
    body = (
        f"Corpus: `{args.corpus.name}` ({throughput_rows[0][2]} chunks of ≤512 tokens), every variant compiled "
        "(template at low and high tiers, plain at low, text), CPU only, local Ray with 4 logical CPUs on "
        "this 2-core machine; wall time covers the whole job (Ray Data start-up, actor start, model load "
        f"per actor), median of {args.repeats}.{SCALING_NOTE}\n\n"
        + markdown_table(["model", "compile actors", "chunks", "wall s", "chunks/s"], throughput_rows)
        + "\n\nKV bytes per chunk, same texts:\n\n"
        + markdown_table(["model", "entry", "entries", "vision tokens / chunk", "KiB / chunk", "× text KV"], bytes_rows)
    )
    if not args.no_write:
        write_section("ingest", "Ingestion: compile throughput and KV bytes per chunk (issue 4)",
                      "python -m benchmarks.perf.ingest " + " ".join(argv or []), body)
    print(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
