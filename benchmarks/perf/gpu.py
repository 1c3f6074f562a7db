"""Paper-scale speed on one GPU: real-size VLMs with random weights, bf16 (run by benchmarks/perf/gpu.sh).

    python -m benchmarks.perf.gpu --device cuda --out gpu.md     # Qwen2.5-VL-7B and GLM-4.1V-9B shapes (< 10 min)
    python -m benchmarks.perf.gpu --device cpu --fallback        # the same path on the tiny models (CI)

For each model: a 16-chunk store compiled by the real ingest stages (benchmarks/tools/ttft_store.py) with the
model itself, then, in this process:
- TTFT per mode at 16 chunks — qvpic vs full_image vs text_pic (the paper's comparison): route + load +
  generate one token, modes interleaved per round, medians;
- tokens/s at 1 and 16 concurrent clients, the batched engine vs the serialised one (benchmarks/perf/batching.py);
- TTFT with the chunks resident in the device hot tier vs fetched from the loader's host LRU.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.perf import batching
from benchmarks.tools import real_size, ttft_store
from pipeline.eval import markdown_table
from schemas.api import AnswerRequest
from schemas.config import DType, ModelSpec
from schemas.modes import Mode
from schemas.render import RenderSpec
from schemas.sampling import Sampling
from serve import build_local

MODES = (Mode.QVPIC, Mode.FULL_IMAGE, Mode.TEXT_PIC)
REAL = ("qwen2.5-vl-7b", "glm-4.1v-9b")
FALLBACK = ("tiny-qwen", "tiny-glm")


def bench_model(name: str, spec: ModelSpec, workdir: str, args) -> str:
    started = time.perf_counter()
    store = ttft_store.build(f"{workdir}/{name}-store", spec, RenderSpec(), 256, args.chunks)
    built_s = time.perf_counter() - started
    stack = build_local({"store": store.uri, "model": spec.model_dump(), "router": {"max_chunks": max(64, args.chunks)},
                         "loader": {"max_nbytes": 8 << 30}})
    router, generator = stack.router, stack.generator
    ids, one = list(store.chunk_ids), Sampling(max_new_tokens=1)

    def ttft(mode: Mode) -> float:
        begun = time.perf_counter()
        request = AnswerRequest(query=store.query, chunk_ids=ids, mode=mode, max_new_tokens=1)
        generator.generate_blocking(asyncio.run(router.plan(request)), one)
        return (time.perf_counter() - begun) * 1e3

    runs: dict[Mode, list[float]] = {m: [] for m in MODES}
    for round_index in range(1 + args.repeats):  # the first round warms up (LRU, hot tier, kernels)
        for mode in MODES:
            elapsed = ttft(mode)
            if round_index:
                runs[mode].append(elapsed)
    medians = {m: statistics.median(v) for m, v in runs.items()}

    serial = batching.SerialisedEngine(generator)
    sampling = Sampling(max_new_tokens=args.new_tokens)
    plans = [asyncio.run(router.plan(AnswerRequest(query=f"{store.query} ({i})", chunk_ids=ids[i % len(ids):]
                                                   + ids[:i % len(ids)], max_new_tokens=args.new_tokens)))
             for i in range(max(args.concurrency))]
    engines = {"batched": generator.stream, "serialised": serial.stream}
    levels = {}
    for concurrency in args.concurrency:
        for engine, stream in engines.items():
            levels[engine, concurrency] = asyncio.run(batching.run_level(stream, plans[:concurrency], concurrency,
                                                                         sampling, engine))
    hit_ms, miss_ms = batching.hot_tier_ttft(generator, plans[0])

    ttft_table = markdown_table(["mode", "TTFT ms", "qvpic / mode"],
                                [[m.value, round(medians[m], 1), round(medians[Mode.QVPIC] / medians[m], 3)]
                                 for m in MODES])
    rows = []
    for concurrency in args.concurrency:
        b, s = levels["batched", concurrency], levels["serialised", concurrency]
        rows.append([concurrency, round(s.tokens_per_s, 1), round(b.tokens_per_s, 1),
                     f"{b.tokens_per_s / s.tokens_per_s:.2f}×", round(statistics.median(b.ttft_ms), 1),
                     "yes" if batching.same_answers(b, s) else "no"])
    batch_table = markdown_table(["clients", "serialised tokens/s", "batched tokens/s", "batched / serialised",
                                  "batched TTFT p50 ms", "same answers"], rows)
    context_tokens = generator.generate_blocking(plans[0], one).report.usage.context_tokens
    stack.close()
    return (f"### {name} ({spec.dtype.value}, {spec.device})\n\n"
            f"Store of {args.chunks} chunks built in {built_s:.0f} s; "
            f"qvpic context {context_tokens} tokens.\n\nTTFT per mode at {args.chunks} chunks (medians of "
            f"{args.repeats}):\n\n{ttft_table}\n\nTokens/s, {args.new_tokens} new tokens per request:\n\n{batch_table}"
            f"\n\nDevice hot tier: TTFT {hit_ms:.1f} ms resident vs {miss_ms:.1f} ms from the loader's host LRU.\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.perf.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--fallback", action="store_true", help="tiny models in float32, small sizes (no GPU)")
    p.add_argument("--out", default="gpu.md")
    args = p.parse_args(argv)
    args.chunks, args.repeats = (4, 1) if args.fallback else (16, 5)
    args.new_tokens, args.concurrency = (8, [1, 4]) if args.fallback else (32, [1, 16])
    started, sections = time.perf_counter(), []
    device_name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"

    def write() -> None:  # after every model: a run cut short by its time limit keeps what it measured
        header = (f"# GPU benchmark\n\nCommand: `python -m benchmarks.perf.gpu {' '.join(argv)}`  \nDevice: "
                  f"{device_name}; random weights of the public architectures (benchmarks/tools/real_size.py); "
                  "wall time "
                  f"{time.perf_counter() - started:.0f} s.\n\n")
        Path(args.out).write_text(header + "\n".join(sections))

    with tempfile.TemporaryDirectory(prefix="qvpic-gpu-") as workdir, real_size.random_weights(args.device):
        for name in FALLBACK if args.fallback else REAL:
            path = name if args.fallback else str(real_size.materialise(name, Path(workdir) / "models"))
            spec = ModelSpec(path=path, dtype=DType.FLOAT32 if args.fallback else DType.BFLOAT16, device=args.device)
            sections.append(bench_model(name, spec, workdir, args))
            print(sections[-1], flush=True)
            write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
