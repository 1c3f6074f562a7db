"""Quantised KV in the store: bytes, load time, TTFT and fidelity of int8 / fp8 entries vs unquantised.

    python -m benchmarks.perf.kv_quant --quick                        # tiny-qwen and tiny-glm (section kv_quant)
    python -m benchmarks.perf.kv_quant --models bench-qwen bench-glm  # bench-size models (section kv_quant_bench)

Without --quick or --models it runs all four (one section, kv_quant_bench); on 2 busy cores the bench-size
models take minutes per request count — size them with --requests / --repeats.

Per model (bf16 weights, so "unquantised" is the bf16 store a user runs today) the chunks of one synthetic
document are compiled once per tier — pages at `low` and `high` under the template prefix, and the
source text (the text entry) — and written to one store per format with the compile stage's own
`stored()` and shard writer. A request links `--chunks-per-request` consecutive chunks of one tier.

- bytes/chunk: mean stored bytes of an entry (record incl. scales), and its ratio to bf16;
- load ms/chunk: median of a cold `ShardReader.load_many` (ranged reads + sha256) plus dequantisation
  into the model dtype (`serve.kv.loader.kv_tensor`, what the generator runs on its device);
- TTFT ms: median of load + assemble (re-anchoring) + the query prefill to the first token's logits,
  in-process (no Serve hop), `--repeats` passes per request; formats interleaved in every pass (first
  place rotating), so machine noise hits all alike;
- fidelity vs the unquantised entry: `pipeline/eval/fidelity.py` `compare` of the quantised context's
  teacher-forced trace against the bf16 context's (KL in nats, top-1 agreement over `--decode-steps`
  steps; median and worst over requests). `KL none vs full` puts it in scale: what linking the
  unquantised entries costs against one full prefill of the same pieces.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from benchmarks.tools.ttft_store import chunk_texts
from jobs.help import HelpFormatter
from pipeline.eval import compare, markdown_table, trace_full, trace_linked, write_section
from pipeline.runtime import VLM, ChunkKV, Renderer
from pipeline.store import Blobs, ShardReader, stored, write_shard
from schemas.config import DType, KVQuant, ModelSpec
from schemas.modes import Variant
from schemas.render import RenderSpec
from schemas.store import StoreSpec
from serve.kv import kv_tensor, to_wire
from serve.plan import Entry, EntryRow, KVLocation, LoadedKV

FORMATS = tuple(KVQuant)
TIERS = (("low", Variant.TEMPLATE), ("high", Variant.TEMPLATE), (None, Variant.TEXT))


def tier_name(tier: str | None) -> str:
    return tier or "text"


def compile_tier(vlm: VLM, renderer: Renderer, texts: list[str], tier: str | None, variant: Variant) -> list[ChunkKV]:
    if tier is None:
        return [vlm.compile_variant(variant, text=t) for t in texts]
    return [vlm.compile_variant(variant, pages=renderer.render(t, renderer.spec.tier(tier)).pages) for t in texts]


def placed(row: dict) -> Entry:
    """The entry of a bare shard row (no chunk behind it): what `kv_tensor` reads is its location."""
    location = KVLocation(**{f: row[f] for f in ("shard_path", "tensor_key", "byte_offset", "nbytes", "checksum",
                                                 "dtype")}, shape=tuple(row["shape"]))
    variant = Variant(row["variant"])
    entry_row = EntryRow(kind=variant.kind, compile_start=0, grid_thw=(), image_sizes_px=(), stored=location)
    return Entry(key="k", tier=row["tier"], variant=variant, num_tokens=row["shape"][3], vision_tokens=0,
                 position_span=1, row=entry_row)


def load(reader: ShardReader, rows: list[dict], vlm: VLM) -> list[torch.Tensor]:
    """What the loader and generator do to a miss: verified ranged reads, then onto the device in the model dtype."""
    out = []
    for row, entry in zip(rows, reader.load_many(rows)):
        array, dtype = to_wire(entry)
        out.append(kv_tensor(LoadedKV(array=array, dtype=dtype, entry=placed(row)), vlm.device, vlm.dtype, copy=True))
    return out


def measure_model(name: str, args: argparse.Namespace) -> list[dict]:
    model = ModelSpec(path=name, dtype=DType.BFLOAT16, device=args.device)
    vlm, renderer = VLM(model), Renderer(RenderSpec())
    num_chunks = args.requests + args.chunks_per_request - 1
    texts, _, query = chunk_texts(model, args.chunk_tokens, num_chunks, seed=3)
    answer = vlm.adapter.encode(" " + texts[1])[:args.decode_steps]  # teacher-forced: copying the evidence chunk
    results = []
    with tempfile.TemporaryDirectory() as root:
        blobs = Blobs.open(StoreSpec(uri=root))
        for tier, variant in TIERS:
            compiled = compile_tier(vlm, renderer, texts, tier, variant)
            rows = {q: [e.index_fields() | {"tier": tier, "variant": variant.value}
                        for e in write_shard(blobs, {f"c{i}": stored(kv.kv, q) for i, kv in enumerate(compiled)})]
                    for q in FORMATS}
            reader = ShardReader(blobs)
            load_ms = {q: [] for q in FORMATS}
            ttft_ms = {q: [] for q in FORMATS}
            fidelity = {q: [] for q in FORMATS if q is not KVQuant.NONE}
            linking = []
            for r in range(-1, args.requests):  # request -1 warms every path up, untimed
                window = range(max(r, 0), max(r, 0) + args.chunks_per_request)
                contexts = {}
                for rep in range(args.repeats if r >= 0 else 1):
                    for q in FORMATS[rep % 3:] + FORMATS[:rep % 3]:  # interleaved, first place rotating
                        started = time.perf_counter()
                        tensors = load(reader, [rows[q][i] for i in window], vlm)
                        loaded = time.perf_counter()
                        chunks = [ChunkKV(t, compiled[i].position_span, compiled[i].compile_start, compiled[i].kind,
                                          compiled[i].grid_thw) for t, i in zip(tensors, window)]
                        contexts[q] = vlm.assemble(chunks)
                        vlm.prefill_query(contexts[q], query)
                        done = time.perf_counter()
                        if r >= 0:
                            load_ms[q].append((loaded - started) * 1e3 / len(window))
                            ttft_ms[q].append((done - started) * 1e3)
                if r < 0:
                    continue
                traces = {q: trace_linked(vlm, contexts[q], query, answer) for q in FORMATS}
                for q in fidelity:
                    fidelity[q].append(compare(traces[q], traces[KVQuant.NONE]))
                pieces = [texts[i] if tier is None else renderer.render(texts[i], renderer.spec.tier(tier)).pages
                          for i in window]
                linking.append(compare(traces[KVQuant.NONE], trace_full(vlm, pieces, query, answer)).kl)
            bf16 = statistics.fmean(r["nbytes"] for r in rows[KVQuant.NONE])
            for q in FORMATS:
                nbytes = statistics.fmean(r["nbytes"] for r in rows[q])
                f = fidelity.get(q, [])
                results.append({
                    "model": name, "tier": tier_name(tier), "format": q.value,
                    "tokens": statistics.fmean(kv.num_tokens for kv in compiled), "nbytes": nbytes,
                    "ratio": nbytes / bf16, "load_ms": statistics.median(load_ms[q]),
                    "ttft_ms": statistics.median(ttft_ms[q]),
                    "kl": statistics.median(x.kl for x in f) if f else 0.0,
                    "kl_max": max((x.kl for x in f), default=0.0),
                    "top1": statistics.median(x.top1_agreement for x in f) if f else 1.0,
                    "top1_min": min((x.top1_agreement for x in f), default=1.0),
                    "kl_linking": statistics.median(linking),
                })
    return results


def table(results: list[dict]) -> str:
    header = ["model", "tier", "format", "tokens/chunk", "bytes/chunk", "× bf16", "load ms/chunk", "TTFT ms",
              "KL vs bf16 (median / max)", "top-1 vs bf16 (median / min)", "KL bf16 linked vs full"]
    rows = [[r["model"], r["tier"], r["format"], f"{r['tokens']:.0f}", f"{r['nbytes']:,.0f}", f"{r['ratio']:.3f}",
             f"{r['load_ms']:.2f}", f"{r['ttft_ms']:.1f}",
             "—" if r["format"] == "none" else f"{r['kl']:.2e} / {r['kl_max']:.2e}",
             "—" if r["format"] == "none" else f"{r['top1']:.3f} / {r['top1_min']:.3f}", f"{r['kl_linking']:.2e}"]
            for r in results]
    return markdown_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.perf.kv_quant", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny models only, fewer requests")
    p.add_argument("--models", nargs="+", default=None)
    p.add_argument("--requests", type=int, default=None, help="requests per tier (each a window of chunks)")
    p.add_argument("--chunks-per-request", type=int, default=4)
    p.add_argument("--chunk-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=None,
                   help="timed passes of every format per request (default 5 with --quick, else 3)")
    p.add_argument("--decode-steps", type=int, default=16, help="teacher-forced decode steps of the fidelity trace")
    p.add_argument("--device", default="auto")
    p.add_argument("--no-write", action="store_true", help="print, do not write docs/BENCHMARKS.md")
    args = p.parse_args(argv)
    args.models = args.models or (["tiny-qwen", "tiny-glm"] if args.quick
                                  else ["tiny-qwen", "tiny-glm", "bench-qwen", "bench-glm"])
    args.requests = args.requests or (4 if args.quick else 6)
    args.repeats = args.repeats or (5 if args.quick else 3)
    torch.manual_seed(0)
    results = [r for name in args.models for r in measure_model(name, args)]
    body = table(results)
    print(body)
    if not args.no_write:
        command = " ".join(["python -m benchmarks.perf.kv_quant", *(sys.argv[1:] if argv is None else argv)])
        bench = any(not m.startswith("tiny-") for m in args.models)  # bench-size models get a section of their own
        note = (f"{args.requests} requests of {args.chunks_per_request} chunks per tier ({args.repeats} timed passes "
                f"each), ≤{args.chunk_tokens}-token "
                f"chunks, {args.decode_steps} teacher-forced decode steps, bf16 weights, device {args.device}. "
                "Random weights: fidelity numbers say how far quantisation moves the model's distributions, not answer "
                "quality. int8's overhead over 0.5× is the per-token value scales (2 bytes per head_dim bytes): "
                "1/16 at the tiny models' head_dim 16, 1/64 at bench's 64, 1/128 at Qwen2.5-VL-7B's 128.")
        write_section("kv_quant_bench" if bench else "kv_quant",
                      "Quantised KV entries: bytes, load, TTFT and fidelity (issue 16)"
                      + (", bench-size models" if bench else ""),
                      command, note + "\n\n" + body)
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
