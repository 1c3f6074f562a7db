"""Compile throughput by batch size: chunks/s of the compile stage (every variant: templated low and high
tier, plain low, text) at each `--compile-batch-size`, in one process, same chunks, medians of repeats.

The chunks are real text (the descriptions of the installed Python distributions), rendered once before
the timings; each timed pass compiles and writes every entry of every chunk into a scratch store, as
ingest's compile stage does.

    python -m benchmarks.perf.compile_batch --device cuda --model bench-qwen --dtype bfloat16   # a GPU
    python -m benchmarks.perf.compile_batch --quick                                            # CPU smoke
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from pipeline.eval import markdown_table
from pipeline.ingest import IngestConfig, Kind, open_store, rows_table
from pipeline.ingest.stages import ChunkStage, CompilePlan, CompileStage, RenderStage
from pipeline.runtime import VLM
from pipeline.store import entry_slots
from schemas.config import DType, ModelSpec
from schemas.corpus import Document
from schemas.store import StoreSpec


def texts(model: ModelSpec, num_chunks: int, chunk_tokens: int) -> list[str]:
    chunker, out = ChunkStage(model, chunk_tokens), []
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: d.metadata.get("Name") or ""):
        payload = (dist.metadata.get_payload() or "").strip()
        if payload:
            out += [c["text"] for c in chunker.chunks(Document(doc_id="d", text=payload, source="metadata"))]
        if len(out) >= num_chunks:
            return out[:num_chunks]
    raise SystemExit(f"only {len(out)} chunks of package descriptions on this machine")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.perf.compile_batch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-qwen")
    parser.add_argument("--dtype", type=DType, default=DType.FLOAT32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="8 chunks, batch sizes 1 and 4, one repeat")
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    if args.quick:
        args.chunks, args.batch_sizes, args.repeats = 8, [1, 4], 1
    model = ModelSpec(path=args.model, dtype=args.dtype, device=args.device)
    vlm = VLM(model)
    rows = []
    with tempfile.TemporaryDirectory(prefix="qvpic-compile-batch-") as store_dir:
        store, manifest = open_store(IngestConfig(corpus="(in-process)", store=StoreSpec(uri=store_dir), model=model))
        slots = json.dumps([[t, v.value] for t, v in entry_slots(manifest, manifest.variants)])
        units = rows_table([{"kind": Kind.UNIT.value, "key": f"{i:064x}", "chunk_key": f"{i:064x}", "text": text,
                             "slots_json": slots, "error": ""}
                            for i, text in enumerate(texts(model, args.chunks, args.chunk_tokens))])
        rendered = RenderStage(manifest.render, None)(units)
        for batch_size in args.batch_sizes:
            stage = CompileStage(CompilePlan(model, store.spec, manifest.to_json(), batch_size), vlm=vlm)
            stage(rendered.slice(0, batch_size))  # warm-up: kernels, allocator
            walls = []
            for _ in range(args.repeats):
                if vlm.device.type == "cuda":
                    torch.cuda.synchronize()
                started = time.perf_counter()
                built = stage(rendered)
                if vlm.device.type == "cuda":
                    torch.cuda.synchronize()
                walls.append(time.perf_counter() - started)
                assert not [e for e in built["error"].to_pylist() if e], "a chunk failed to compile"
            wall_s = statistics.median(walls)
            rows.append([batch_size, args.chunks, f"{wall_s:.2f}", f"{args.chunks / wall_s:.2f}"])
            print(rows[-1], flush=True)
    base = float(rows[0][3])
    for row in rows:
        row.append(f"{float(row[3]) / base:.2f}×")
    table = (f"Compile stage, `{args.model}` {args.dtype.value} on {vlm.device}, {args.chunks} chunks of ≤ "
             f"{args.chunk_tokens} tokens, {len(json.loads(slots))} entries a chunk (written to a scratch store), "
             f"median of {args.repeats}.\n\n"
             + markdown_table(["batch size", "chunks", "wall s", "chunks/s", "vs batch 1"], rows))
    print(table)
    if args.out is not None:
        args.out.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
