"""Selective recompute across linked chunks: fidelity gained against time to first token, per model family.

    python -m benchmarks.quality.recompute          # bench-qwen and bench-glm, fixture items + 8 synthetic requests
    python -m benchmarks.quality.recompute --quick  # the same models, 3 synthetic requests (~4 min on 2 shared cores)

One request per QA item: the LongBench instruction, the item's context chunked (≤ --chunk-tokens, the
first --max-chunks chunks) and rendered at the lowest tier, compiled under the template prefix, linked
and compared with one full prefill of the same pages (`pipeline/eval/fidelity.py`: KL and top-1
agreement over the teacher-forced gold answer tokens). Configurations: no recompute (k = 0), the first
k ∈ {4, 16, 64} tokens of every chunk (EPIC), the r ∈ {5, 15, 30}% most deviating tokens (CacheBlend).

TTFT here is what the generator spends after the chunk KV is on the device: assemble, the chunks'
sources (pages rendered again from the stored text and run through the image processor; only when
recomputing), the recompute (input embeddings with the vision tower, the deviation estimate, the
forward), and the query prefill — configurations interleaved, the fastest of --repeats runs per request,
then the median over requests.
The store keeps nothing new for recompute; the table at the end sets that against the alternative of
storing each image entry's merged vision embeddings (bytes from each model's config).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
from tqdm import tqdm

from benchmarks.tools.real_size import REAL_SIZE
from jobs.eval_items import FIXTURES
from pipeline.eval import (
    LONGBENCH_QA_TASKS,
    QAItem,
    QATask,
    answer_token_ids,
    compare,
    load_tasks,
    markdown_table,
    synthetic,
    trace_full,
    trace_linked,
    write_section,
)
from pipeline.ingest import Chunker
from pipeline.runtime import VLM, Renderer, chunk_inputs, input_embeddings, recompute
from schemas.config import DType, ModelSpec, RecomputeKind, RecomputeSpec
from schemas.corpus import Document
from schemas.render import RenderSpec

LEADING_NUM_TOKENS = (0, 4, 16, 64)  # 0: no recompute
DEVIATION_PERCENT = (5, 15, 30)


def configurations() -> list[tuple[str, RecomputeSpec]]:
    configs = [(f"k = {k}" + (" (linked as is)" if k == 0 else ""),
                RecomputeSpec(kind=RecomputeKind.LEADING, leading_num_tokens=k) if k else RecomputeSpec())
               for k in LEADING_NUM_TOKENS]
    return configs + [(f"r = {r}%", RecomputeSpec(kind=RecomputeKind.DEVIATION, deviation_fraction=r / 100))
                      for r in DEVIATION_PERCENT]


def items_for(num_synthetic: int, context_words: int, limit: int | None) -> list[QAItem]:
    """The first `limit` fixture items per task (all by default; none at 0), then synthetic requests whose
    contexts span several chunks."""
    items = load_tasks(str(FIXTURES), LONGBENCH_QA_TASKS)
    if limit is not None:
        items = [i for t in LONGBENCH_QA_TASKS for i in [x for x in items if x.task is t][:limit]]
    if num_synthetic:
        with tempfile.TemporaryDirectory() as folder:
            records = synthetic.generate(num_synthetic, context_words=context_words, num_distractors=3, seed=11)
            synthetic.write_jsonl(records, folder)
            items += load_tasks(folder, [QATask.SYNTHETIC])
    return items


# Timed with the calling thread's CPU time when torch runs on one CPU thread: what the work costs, whatever
# else shares the machine (wall time on a shared 2-core box swings several-fold). Wall time otherwise.
clock = time.perf_counter


def ms_since(started: float) -> float:
    return (clock() - started) * 1e3


def linked_ttft(vlm: VLM, chunks, texts: list[str], renderer: Renderer, tier, instruction: str, query: str,
                spec: RecomputeSpec) -> tuple[float, float, object]:
    """(TTFT ms, of which sources ms, the context) of one linked request as the generator serves it: assemble,
    and when recomputing render the stored text again, tokenise and recompute; then the query prefill."""
    started = clock()
    context, sources_ms, recomputed = vlm.assemble(chunks, instruction), 0.0, 0
    if spec.enabled:
        sources_started = clock()
        inputs = [chunk_inputs(vlm, renderer.render(t, tier).pages) for t in texts]
        sources_ms = ms_since(sources_started)
        recomputed = recompute(vlm, context, chunks, inputs, spec).num_tokens
    vlm.prefill_query(context, query)
    return ms_since(started), sources_ms, (context, recomputed)


def measure(vlm: VLM, texts: list[str], renderer: Renderer, tier, instruction: str, query: str, answer: list[int],
            repeats: int):
    """Per configuration: (fidelity, TTFT ms, sources ms, recomputed share); full prefill's TTFT; the chunks'
    vision-and-embedding time per chunk (what stored merged embeddings would save); the chunk tokens.
    Each TTFT is the fastest of `repeats` runs, configurations interleaved (a shared machine's spikes fall out)."""
    pages = [renderer.render(t, tier).pages for t in texts]
    chunks = vlm.compile_many(pages)
    num_tokens = sum(c.num_tokens for c in chunks)
    vlm.assemble(chunks, instruction)  # this instruction's serving prefix and the rotations, as a warm server has them
    configs = configurations()
    ttfts = {name: [] for name, _ in configs} | {"full": [], "embed": []}
    for _ in range(repeats):
        started = clock()
        vlm.prefill_full([instruction, *[renderer.render(t, tier).pages for t in texts]], query)
        ttfts["full"].append(ms_since(started))
        started = clock()
        for chunk_pages in pages:
            input_embeddings(vlm, chunk_inputs(vlm, chunk_pages))
        ttfts["embed"].append(ms_since(started) / len(chunks))
        for name, spec in configs:
            ttfts[name].append(linked_ttft(vlm, chunks, texts, renderer, tier, instruction, query, spec)[:2])
    reference = trace_full(vlm, [instruction, *pages], query, answer)
    out = {}
    for name, spec in configs:
        _, _, (context, recomputed) = linked_ttft(vlm, chunks, texts, renderer, tier, instruction, query, spec)
        ttft, sources_ms = min(ttfts[name])
        out[name] = (compare(trace_linked(vlm, context, query, answer), reference), ttft, sources_ms,
                     recomputed / num_tokens)
    return out, min(ttfts["full"]), min(ttfts["embed"]), num_tokens


def embedding_bytes_ratio(config: dict) -> tuple[int, int, float]:
    """(KV bytes, merged-embedding bytes, their ratio) per vision token at one dtype's element: a merged vision
    embedding is one hidden vector; the token's KV is keys and values of every layer."""
    text = config.get("text_config", config)
    hidden, layers, kv_heads = text["hidden_size"], text["num_hidden_layers"], text["num_key_value_heads"]
    head_dim = text.get("head_dim", hidden // text["num_attention_heads"])
    kv = 2 * layers * kv_heads * head_dim
    return kv, hidden, hidden / kv


def report(model: str, results, full_ttfts: list[float], embed_ms: list[float]) -> str:
    rows = []
    base = [r["k = 0 (linked as is)"] for r in results]
    for name, _ in configurations():
        runs = [r[name] for r in results]
        kl = np.array([f.kl for f, *_ in runs])
        p10, p50, p90 = np.percentile(kl, [10, 50, 90])
        ratio = statistics.median(f.kl / b[0].kl for (f, *_), b in zip(runs, base) if b[0].kl > 0)
        closer = 100 * np.mean([f.kl < b[0].kl for (f, *_), b in zip(runs, base)])
        ttft = statistics.median(t for _, t, _, _ in runs)
        rows.append([name, f"{100 * statistics.median(s for *_, s in runs):.1f}", f"{p50:.3g} [{p10:.3g}, {p90:.3g}]",
                     f"{ratio:.2f}", f"{closer:.0f}", f"{statistics.median(f.top1_agreement for f, *_ in runs):.3f}",
                     f"{ttft:.0f}", f"{statistics.median(s for _, _, s, _ in runs):.0f}",
                     f"{ttft / statistics.median(t for _, t, _, _ in base):.2f}",
                     f"{ttft / statistics.median(full_ttfts):.2f}"])
    table = markdown_table(["recompute", "chunk tokens recomputed %", "KL median [p10, p90]", "KL / linked",
                            "closer than linked %", "top-1 agreement", "TTFT ms", "of which sources ms",
                            "× linked", "× full prefill"], rows)
    return (f"**{model}** — full prefill TTFT (render + prefill, the uncached reference) median "
            f"{statistics.median(full_ttfts):.0f} ms; "
            f"vision tower + embeddings {statistics.median(embed_ms):.0f} ms per chunk.\n\n" + table)


def store_table(models: dict[str, VLM]) -> str:
    rows = []
    configs = {name: vlm.model.config.to_dict() for name, vlm in models.items()} | REAL_SIZE
    for name, config in configs.items():
        kv, hidden, ratio = embedding_bytes_ratio(config)
        rows.append([name, kv, hidden, f"{ratio:.3f}"])
    return markdown_table(["model", "KV elements per token", "merged vision embedding elements per token",
                           "embedding / KV bytes"], rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quality.recompute", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["bench-qwen", "bench-glm"])
    p.add_argument("--dtype", type=DType, default=DType.FLOAT32, choices=list(DType),
                   metavar="{float32,bfloat16,float16}")
    p.add_argument("--synthetic", type=int, default=8, help="synthetic requests on top of the fixture items")
    p.add_argument("--context-words", type=int, default=1200, help="words of each synthetic request's context")
    p.add_argument("--limit", type=int, help="fixture items per task (default all)")
    p.add_argument("--chunk-tokens", type=int, default=512, help="text tokens per chunk (a 72-DPI page of them is "
                   "~100 vision tokens)")
    p.add_argument("--max-chunks", type=int, default=4, help="chunks per request (the first of the item's context)")
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs per configuration and request (the fastest counts)")
    p.add_argument("--quick", action="store_true", help="3 synthetic requests, no fixture items, 1 timed run")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = p.parse_args(argv)
    if args.quick:
        args.limit, args.synthetic, args.repeats = 0, 3, 1
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    global clock
    started = time.perf_counter()
    render = RenderSpec()
    renderer = Renderer(render)
    items = items_for(args.synthetic, args.context_words, args.limit)
    sections, loaded = [], {}
    for model in args.models:
        vlm = loaded[model] = VLM(ModelSpec(path=model, dtype=args.dtype))
        clock = time.thread_time if vlm.device.type == "cpu" and args.threads == 1 else time.perf_counter
        chunker = Chunker(lambda text, vlm=vlm: len(vlm.adapter.encode(text)), args.chunk_tokens)
        results, full_ttfts, embed_ms, sizes = [], [], [], []
        for item in tqdm(items, desc=f"recompute {model}", unit="request"):
            texts = [c.text for c in chunker.chunk(Document(doc_id=item.id, text=item.context, source="bench"))]
            answer = answer_token_ids(vlm, item, args.answer_tokens)
            out, full_ttft, per_chunk_ms, num_tokens = measure(
                vlm, texts[:args.max_chunks], renderer, render.lowest_tier, item.prompt_before_context,
                item.query_after_context, answer, args.repeats)
            results.append(out)
            full_ttfts.append(full_ttft)
            embed_ms.append(per_chunk_ms)
            sizes.append(num_tokens)
        sections.append(report(model, results, full_ttfts, embed_ms)
                        + f"\n\n{len(items)} requests, {statistics.median(sizes):.0f} chunk tokens each (median).")
    body = (f"Models {', '.join(args.models)} ({args.dtype.value}, random weights, CPU, {args.threads} thread); "
            f"chunks of ≤{args.chunk_tokens} text tokens, ≤{args.max_chunks} per request, rendered at "
            f"{render.lowest_tier.dpi} DPI under the template prefix; ≤{args.answer_tokens} gold answer tokens "
            f"teacher-forced; {time.perf_counter() - started:.0f} s. Fidelity is to full prefill of the same pages "
            "(`pipeline/eval/fidelity.py`); `KL / linked` is the median paired ratio to no recompute (lower is "
            "closer), `closer than linked %` the share of requests where KL fell. Times are "
            f"{'CPU time of the one torch thread' if clock is time.thread_time else 'wall time'} (a shared 2-core "
            "machine under load); compare ratios within one run.\n\n" + "\n\n".join(sections)
            + "\n\nWhat recompute needs at serve time is each chunk's input embeddings. The store keeps nothing new "
            "for it: the generator renders the stored text again (or scales the scanned page) and runs the vision "
            "tower (`of which sources ms`, plus the vision tower inside the recompute). Storing each image entry's "
            "merged vision embeddings instead would skip both, at this many extra bytes per vision token "
            "(same dtype as the KV):\n\n" + store_table(loaded))
    print(body)
    if not args.no_write:
        command = ("python -m benchmarks.quality.recompute"
                   + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip())
        write_section("recompute", "Selective recompute across chunks: fidelity gain against TTFT (issue 16)",
                      command, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
