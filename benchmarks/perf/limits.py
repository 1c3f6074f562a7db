"""The machine's limits and the engine's forwards against them, in one run (issue 39).

    python -m benchmarks.perf.limits            # bench-qwen and the Qwen2.5-VL-7B shape at 2 layers
    python -m benchmarks.perf.limits --quick    # bench-qwen only, fewer repeats
    python -m benchmarks.perf.limits --reanchoring-only   # section 5 alone, printed
    python -m benchmarks.perf.limits --device cuda --out limits_gpu.md   # on a GPU (benchmarks/perf/gpu.sh runs it)

1. Memory bandwidth: a STREAM-like copy and a read (sum) of a 1 GiB float32 array, far larger than the caches.
2. Matrix products at bench-qwen's decoder shapes, 1–64 rows: aten's fp32, oneDNN's prepacked fp32 and bf16
   (pipeline/runtime/fused.py's `Projection`), GFLOP/s of one layer's five products.
3. Bounds: a one-token forward reads every decoder and output weight once (bytes / read bandwidth); an n-token
   forward is the larger of that and its FLOPs (the products', and the attention's over the columns each new
   token sees) at the best product rate measured at the fewest rows not below n.
4. The forwards the engine runs (`serve/engine/qvpic/batch.py` `forward` over a slab with a 600-token context):
   transformers' forward, the fused forward in fp32 (its small operations as torch ops, and as the native calls
   it serves with: pipeline/runtime/decoder_ops.py), its attention as two products at any length (the control for
   SDPA on long turns: fused.py `SDPA_MIN_NEW`) and with bf16 products — one token, a 21-token query turn, a
   16-row decode step, a 56-token follow-up turn over 1,500 columns, and on the small model a 512-token user turn
   (its own context pasted in) — each timed side by side (interleaved, medians) and set against its bound.
   `--compiled` adds `engine.forward.compiled` (pipeline/runtime/compiled.py) for the fp32 and the bf16 model,
   after their start-up compile (minutes each); a path whose forwards fell back to the eager one fails the run.
5. Re-anchoring: 1,000 cached tokens assembled into a slab row by the matrix product, by per-channel factors on
   torch ops and on the native kernel (served on the CPU), and a plain copy, against the copy bound (interleaved).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import torch

from benchmarks.perf import limit_rates
from benchmarks.perf.limit_rates import (
    ROWS,
    bandwidth,
    layer_shapes,
    product_rates,
    sync,
    weight_bytes,
)
from benchmarks.perf.limits_reanchoring import reanchoring
from benchmarks.tools.machine import machine_line
from jobs.help import HelpFormatter
from pipeline.eval import markdown_table, write_section
from pipeline.runtime import VLM
from pipeline.runtime import fused as fused_module
from pipeline.runtime.compiled import CompiledForward
from pipeline.runtime.fused import FusedDecoder, language_model
from pipeline.runtime.real_shapes import ensure_real_shape
from schemas.config import DType, ForwardSpec, ModelSpec
from serve.engine.qvpic.batch import Slab, forward

CONTEXT_TOKENS = 600  # ~8 linked chunks before the query
QUERY_TOKENS = 21  # the query turn of issue 23's benchmark
# a conversation's follow-up turn (docs/BENCHMARKS.md `conversation`, turn 4): its new tokens over its columns
FOLLOW_UP_TOKENS, FOLLOW_UP_CONTEXT = 56, 1_500
# a user turn with its own context pasted in (a LangChain RAG chain with `retrieval: none`), the small model only
LONG_TURN_TOKENS, LONG_TURN_CONTEXT = 512, 88
DECODE_ROWS = 16
TARGET_QUERY_OVER_ONE, TARGET_ONE_OVER_BOUND = 1.5, 2.0


def context_slab(vlm: VLM, rows: int, context: int = CONTEXT_TOKENS, new: int = QUERY_TOKENS) -> Slab:
    shape = vlm.prefix.kv  # [layers, 2, kv_heads, tokens, head_dim]
    slab = Slab.empty(shape.shape[0], rows, shape.shape[2], context + new + 2, shape.shape[4], vlm.dtype, vlm.device)
    slab.kv[:, :, :, :, :context] = torch.randn_like(slab.kv[:, :, :, :, :context]) * 0.5
    slab.valid[:, :context] = True
    slab.lengths[:] = context
    slab.next_positions[:] = context
    return slab.read_back()


FOLLOW_UP_CASE = f"{FOLLOW_UP_TOKENS}-token follow-up turn over {FOLLOW_UP_CONTEXT:,} columns"
LONG_CASE = f"{LONG_TURN_TOKENS}-token user turn after {LONG_TURN_CONTEXT} columns"


def cases(long_turn: bool) -> dict[str, tuple[int, int, int]]:
    """The forwards measured: name -> (rows, new tokens a row, columns before them)."""
    out = {"one token": (1, 1, CONTEXT_TOKENS), f"{QUERY_TOKENS}-token query turn": (1, QUERY_TOKENS, CONTEXT_TOKENS),
           f"decode step, {DECODE_ROWS} rows": (DECODE_ROWS, 1, CONTEXT_TOKENS),
           FOLLOW_UP_CASE: (1, FOLLOW_UP_TOKENS, FOLLOW_UP_CONTEXT)}
    return out | ({LONG_CASE: (1, LONG_TURN_TOKENS, LONG_TURN_CONTEXT)} if long_turn else {})
PRODUCTS_ATTENTION = "fused fp32, attention as products"
# the checkpoint loaded in bf16 (weights, activations, KV): what `model.dtype: bfloat16` serves; "fused bf16" is the
# fp32 model with bf16 products (`engine.forward.matmul_dtype`)
BF16_MODEL = "bf16 model"
# `engine.forward.compiled` (pipeline/runtime/compiled.py): one-row forwards as one torch.compile graph; a decode
# step of several rows runs the eager fused forward there
COMPILED_FP32, COMPILED_BF16 = "compiled fp32", "compiled bf16 model"


@contextlib.contextmanager
def attention_as_products():
    """The fused forward's fp32 attention as two products at any number of new tokens (as before SDPA took long
    turns: pipeline/runtime/fused.py `SDPA_MIN_NEW`)."""
    kept = fused_module.SDPA_MIN_NEW
    fused_module.SDPA_MIN_NEW = 1 << 30
    try:
        yield
    finally:
        fused_module.SDPA_MIN_NEW = kept


def compiled_decoder(vlm: VLM, spent: dict[str, float], label: str) -> FusedDecoder:
    """A fused decoder with its one-row forwards compiled (`engine.forward.compiled`), warmed up as the engine
    does at start; the seconds that took go in `spent`."""
    decoder = FusedDecoder(vlm.model, ForwardSpec())
    started = time.perf_counter()
    decoder.compiled = CompiledForward(decoder)
    decoder.compiled.warm_up(vlm.dtype, vlm.device)
    spent[label] = time.perf_counter() - started
    return decoder


def forwards(vlm: VLM, repeats: int, long_turn: bool, bf16_vlm: VLM | None = None,
             compiled: dict[str, float] | None = None) -> dict[str, dict[str, float]]:
    """Seconds (median) of each engine forward per path, interleaved so noise hits every path alike. `bf16_vlm`:
    the same checkpoint loaded in bf16, timed as `BF16_MODEL` over a bf16 slab. `compiled` (a dict): the compiled
    paths too (`COMPILED_FP32`, `COMPILED_BF16`), their start-up compile seconds put in it."""
    fp32 = FusedDecoder(vlm.model, ForwardSpec())
    paths = {"transformers": (vlm, None),
             "fused fp32, torch ops": (vlm, FusedDecoder(vlm.model, ForwardSpec(native_ops=False))),
             PRODUCTS_ATTENTION: (vlm, fp32), "fused fp32": (vlm, fp32),
             "fused bf16": (vlm, FusedDecoder(vlm.model, ForwardSpec(matmul_dtype=DType.BFLOAT16)))}
    if bf16_vlm is not None:
        paths[BF16_MODEL] = (bf16_vlm, FusedDecoder(bf16_vlm.model, ForwardSpec()))
    if compiled is not None:
        paths[COMPILED_FP32] = (vlm, compiled_decoder(vlm, compiled, COMPILED_FP32))
        if bf16_vlm is not None:
            paths[COMPILED_BF16] = (bf16_vlm, compiled_decoder(bf16_vlm, compiled, COMPILED_BF16))
    measured = cases(long_turn)
    times: dict[str, dict[str, list[float]]] = {p: {c: [] for c in measured} for p in paths}
    models = {id(model): model for model, _ in paths.values()}
    slabs = {(c, key): context_slab(model, rows, context, new)
             for c, (rows, new, context) in measured.items() for key, model in models.items()}
    with torch.inference_mode():
        for repeat in range(repeats + 1):
            for case, (rows, new, context) in measured.items():
                ids = torch.randint(10, vlm.vocab_size - 10, (rows, new), device=vlm.device)
                real = torch.ones_like(ids, dtype=torch.bool)
                for path, (model, decoder) in paths.items():
                    slab = slabs[case, id(model)]
                    slab.lengths[:], slab.next_positions[:] = context, context
                    slab.read_back()  # the host's bookkeeping too (serve/engine/qvpic/batch.py `Slab`)
                    model.fused = decoder
                    sync()
                    started = time.perf_counter()
                    with attention_as_products() if path == PRODUCTS_ATTENTION else contextlib.nullcontext():
                        forward(model, slab, ids, real)
                    sync()
                    if repeat:  # the first round warms every path up
                        times[path][case].append(time.perf_counter() - started)
    for model in models.values():
        model.fused = None
    for path, (_, decoder) in paths.items():  # a compiled path that fell back to the eager forward measured nothing
        if decoder is not None and decoder.compiled is not None and decoder.compiled.refused:
            raise RuntimeError(f"{path}: {decoder.compiled.refused} forwards needed a recompile and ran eagerly")
    return {p: {c: statistics.median(t) for c, t in by_case.items()} for p, by_case in times.items()}


def model_section(label: str, vlm: VLM, bw: dict[str, float], repeats: int, long_turn: bool = False,
                  bf16_vlm: VLM | None = None, compiled: bool = False) -> tuple[str, dict]:
    shapes = layer_shapes(vlm.model)
    rates = product_rates(shapes, max(3, repeats // 2))
    layers = len(language_model(vlm.model).layers)
    flops_per_token = 2 * weight_bytes(vlm.model, 1)  # the products: 2 FLOPs per weight
    hidden = language_model(vlm.model).config.hidden_size

    def flops(rows: int, new: int, context: int) -> float:
        """The products' and the attention's (QKᵀ and PV over every column a new token sees: not small for a
        follow-up over 1,500 columns or a long turn; 2 FLOPs a multiply-add)."""
        seen = new * context + new * (new + 1) // 2
        return rows * (new * flops_per_token + 4 * hidden * layers * seen)

    bounds = {}
    for name, size in (("fp32", 4), ("bf16", 2)):
        memory_s = weight_bytes(vlm.model, size) / (bw["read"] * 1e9)
        bounds[name] = {}
        for case, (rows, new, context) in cases(long_turn).items():
            if rows * new == 1:  # one row's products are reads of the weights: the bandwidth bound
                bounds[name][case] = memory_s
                continue
            # the rate at the fewest measured rows not below this forward's (rates grow with rows: a lower bound)
            at = min((n for n in ROWS if n >= rows * new), default=ROWS[-1])
            best = max(r[at] for k, r in rates.items() if k.startswith(name))
            bounds[name][case] = max(memory_s, flops(rows, new, context) / best / 1e9)
    spent: dict[str, float] | None = {} if compiled else None
    measured = forwards(vlm, repeats, long_turn, bf16_vlm, spent)
    rows = []
    for case in bounds["fp32"]:
        row = [case, f"{bounds['fp32'][case] * 1e3:.1f}", f"{bounds['bf16'][case] * 1e3:.1f}"]
        for path, by_case in measured.items():
            bound = bounds["bf16" if "bf16" in path else "fp32"][case]
            row.append(f"{by_case[case] * 1e3:.1f} ({by_case[case] / bound:.2f}×)")
        rows.append(row)
    table = markdown_table(["forward", "bound fp32 ms", "bound bf16 ms", *[f"{p} ms (× bound)" for p in measured]],
                           rows)
    rate_rows = [[k, *[f"{r[n]:.0f}" for n in ROWS]] for k, r in rates.items()]
    rate_table = markdown_table(["GFLOP/s of one layer's products", *[f"{n} rows" for n in ROWS]], rate_rows)
    one = {p: m["one token"] for p, m in measured.items()}
    query = {p: m[f"{QUERY_TOKENS}-token query turn"] for p, m in measured.items()}
    ratios = {p: query[p] / one[p] for p in measured}
    summary = (f"Decoder: {layers} layers, shapes (out, in) {shapes}; weights read per token "
               f"{weight_bytes(vlm.model, 4) / 1e6:.0f} MB fp32. Query turn / one token: "
               + ", ".join(f"{p} {r:.2f}×" for p, r in ratios.items())
               + f" (target ≤ {TARGET_QUERY_OVER_ONE}×); one token / its bandwidth bound: "
               + ", ".join(f"{p} {one[p] / bounds['bf16' if 'bf16' in p else 'fp32']['one token']:.2f}×"
                           for p in measured) + f" (target ≤ {TARGET_ONE_OVER_BOUND}×)."
               + ("".join(f" {p}: compiled at start in {s:.0f} s." for p, s in spent.items()) if spent else ""))
    body = f"### {label}\n\n{summary}\n\n{table}\n\n{rate_table}\n\n{reanchoring(label, vlm, bw, repeats)}"
    return body, {"measured": measured, "bounds": bounds, "rates": rates}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the small model only, 5 repeats")
    parser.add_argument("--repeats", type=int, help="runs of each forward (default 15, 5 with --quick)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine")
    parser.add_argument("--model", default="bench-qwen", help="the small model measured first (a built-in name)")
    parser.add_argument("--out", help="write the section to this Markdown file instead of docs/BENCHMARKS.md")
    parser.add_argument("--compiled", action="store_true",
                        help="also the compiled forwards (engine.forward.compiled): minutes of compiling per dtype")
    parser.add_argument("--reanchoring-only", action="store_true",
                        help="the bandwidth and the re-anchoring tables alone, printed (docs/BENCHMARKS.md untouched)")
    args = parser.parse_args(argv)
    limit_rates.DEVICE = torch.device(args.device)
    repeats = args.repeats or (5 if args.quick else 15)
    print(machine_line(), flush=True)
    bw = bandwidth(max(3, repeats // 2))
    print(f"bandwidth: copy {bw['copy']:.1f} GB/s, read {bw['read']:.1f} GB/s", flush=True)
    models = [(args.model, ModelSpec(path=args.model, device=args.device))]
    if not args.quick:
        models.append(("Qwen2.5-VL-7B shape, 2 decoder layers",
                       ModelSpec(path=str(ensure_real_shape("qwen2.5-vl-7b")), device=args.device)))
    if args.reanchoring_only:
        for label, spec in models:
            print(reanchoring(label, VLM(spec), bw, repeats), flush=True)
        return
    sections = []
    # the bf16 model's column where bf16 runs natively (AMX / avx512_bf16, or a GPU): elsewhere it is emulated
    native_bf16 = limit_rates.DEVICE.type != "cpu" or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    for label, spec in models:
        bf16_vlm = VLM(spec.model_copy(update={"dtype": DType.BFLOAT16})) if native_bf16 else None
        body, _ = model_section(label, VLM(spec), bw, repeats, long_turn=not sections,  # the small model's
                                bf16_vlm=bf16_vlm, compiled=args.compiled)
        print(body, flush=True)
        sections.append(body)
    if not args.no_write:
        command = "python -m benchmarks.perf.limits" + (" --quick" if args.quick else "") + (
            " --compiled" if args.compiled else "") + (
            f" --device {args.device}" if args.device != "cpu" else "")
        intro = (f"Machine: {machine_line()}. Memory bandwidth (1 GiB float32): copy {bw['copy']:.1f} GB/s, read "
                 f"{bw['read']:.1f} GB/s (the faster of a sum and a one-row product). Bounds: one token = weight "
                 "bytes / read bandwidth; n tokens = the larger "
                 "of that and their FLOPs (2 per weight per token, and the attention's over the columns each token "
                 "sees) at the best product rate measured at the fewest rows not below n. Forwards: "
                 f"`serve/engine/qvpic/batch.py` `forward` over a slab holding a {CONTEXT_TOKENS}-token context "
                 f"(the follow-up turn {FOLLOW_UP_CONTEXT:,}, the long turn {LONG_TURN_CONTEXT}), "
                 f"medians of {repeats} interleaved runs. \"fused bf16\": the fp32 checkpoint with bf16 products "
                 "(`engine.forward.matmul_dtype`); \"bf16 model\": the checkpoint loaded in bf16 (weights, "
                 "activations, KV), as `model.dtype: bfloat16` serves it.\n\n")
        target = {"path": Path(args.out)} if args.out else {}
        if limit_rates.DEVICE.type == "cuda":
            intro = f"Device: {torch.cuda.get_device_name(limit_rates.DEVICE)}. " + intro
        print(write_section("limits", "The machine's limits and the engine's forward (issue 39)", command,
                            intro + "\n".join(sections), **target))


if __name__ == "__main__":
    main()
