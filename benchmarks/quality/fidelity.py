"""Fidelity to full prefill per compile prefix: template vs prefix-free vs dummy, with random weights.

    python -m benchmarks.quality.fidelity                 # bench-qwen, the six fixture tasks + 12 synthetic requests
    python -m benchmarks.quality.fidelity --quick         # tiny-qwen, fewer requests (CI-sized smoke run)

One request per QA item: the LongBench instruction, the item's context chunked (≤ --chunk-tokens) and
rendered at the lowest tier, the question with its answer cue. Each chunk is compiled under every
compile prefix (pages: template / none / dummy; text: template / none), linked, and compared with one
full prefill of the same pages (or texts), teacher-forcing the item's gold answer tokens
(`pipeline/eval/fidelity.py`). Reported: per variant the median [p10, p90] of each metric over requests,
and per metric the paired comparison that says whether it discriminates: on what share of requests the
template variant is closer to full prefill than the other one (ties apart), and the median paired ratio.
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

from jobs.eval_items import FIXTURES
from jobs.help import HelpFormatter
from pipeline.eval import (
    LONGBENCH_QA_TASKS,
    METRICS,
    Fidelity,
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
from pipeline.runtime import VLM, Renderer
from schemas.config import DType, ModelSpec
from schemas.corpus import Document
from schemas.modes import Variant
from schemas.render import RenderSpec

IMAGE_VARIANTS = (Variant.TEMPLATE, Variant.PLAIN, Variant.DUMMY)
TEXT_VARIANTS = (Variant.TEXT, Variant.TEXT_PLAIN)
LOWER_IS_CLOSER = {"hidden_rel_l2": True, "kl": True, "top1_agreement": False, "top5_overlap": False}
LABEL = {Variant.TEMPLATE: "pages, template prefix", Variant.PLAIN: "pages, prefix-free",
         Variant.DUMMY: "pages, dummy prefix", Variant.TEXT: "text, template prefix",
         Variant.TEXT_PLAIN: "text, prefix-free"}


def items_for(num_synthetic: int, limit: int | None) -> list[QAItem]:
    items = load_tasks(str(FIXTURES), LONGBENCH_QA_TASKS)
    if limit is not None:
        items = [i for t in LONGBENCH_QA_TASKS for i in [x for x in items if x.task is t][:limit]]
    if num_synthetic:
        with tempfile.TemporaryDirectory() as folder:
            synthetic.write_jsonl(synthetic.generate(num_synthetic, context_words=220, num_distractors=2, seed=11),
                                  folder)
            items += load_tasks(folder, [QATask.SYNTHETIC])
    return items


def measure(vlm: VLM, item: QAItem, chunker: Chunker, renderer: Renderer, render: RenderSpec,
            num_answer_tokens: int) -> dict[Variant, Fidelity]:
    """Every variant's fidelity on one request; the pages are the same for every image variant."""
    texts = [c.text for c in chunker.chunk(Document(doc_id=item.id, text=item.context, source="bench"))]
    pages = [renderer.render(t, render.lowest_tier).pages for t in texts]
    answer = answer_token_ids(vlm, item, num_answer_tokens)
    instruction, query = [item.prompt_before_context], item.query_after_context
    out = {}
    for variants, pieces in ((IMAGE_VARIANTS, pages), (TEXT_VARIANTS, texts)):
        reference = trace_full(vlm, instruction + list(pieces), query, answer)
        for variant in variants:
            chunks = [vlm.compile_variant(variant, text, page) for text, page in zip(texts, pages)]
            context = vlm.assemble(chunks, item.prompt_before_context)
            out[variant] = compare(trace_linked(vlm, context, query, answer), reference)
    return out


def paired(results: list[dict[Variant, Fidelity]], base: Variant, other: Variant,
           metric: str) -> tuple[float, float, float]:
    """(share of requests where `base` is closer, share of ties, median ratio other/base) for one metric."""
    a = np.array([getattr(r[base], metric) for r in results])
    b = np.array([getattr(r[other], metric) for r in results])
    closer = (a < b) if LOWER_IS_CLOSER[metric] else (a > b)
    ties = np.isclose(a, b, rtol=0, atol=1e-12)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = float(np.nanmedian(np.where(a != 0, b / a, np.nan))) if (a != 0).any() else float("nan")
    return float(closer[~ties].mean()) if (~ties).any() else float("nan"), float(ties.mean()), ratio


def report(results: list[dict[Variant, Fidelity]], items: list[QAItem]) -> str:
    def spread(variant: Variant, metric: str, group: list[dict[Variant, Fidelity]]) -> str:
        values = [getattr(r[variant], metric) for r in group]
        p10, p50, p90 = np.percentile(values, [10, 50, 90])
        return f"{p50:.3g} [{p10:.3g}, {p90:.3g}]"

    variants = IMAGE_VARIANTS + TEXT_VARIANTS
    overall = markdown_table(["compiled as", "requests"] + [m for m in METRICS],
                             [[LABEL[v], len(results)] + [spread(v, m, results) for m in METRICS] for v in variants])
    pairs = [(Variant.TEMPLATE, Variant.PLAIN), (Variant.TEMPLATE, Variant.DUMMY), (Variant.TEXT, Variant.TEXT_PLAIN)]
    rows = []
    for base, other in pairs:
        for metric in METRICS:
            closer, ties, ratio = paired(results, base, other, metric)
            rows.append([f"{LABEL[base]} vs {LABEL[other]}", metric, 100 * closer, 100 * ties, ratio])
    comparison = markdown_table(["pair", "metric", "template closer % (ties apart)", "ties %",
                                 "median ratio other/template"], rows)
    # A metric discriminates when, for every pair, one side is closer on ≥75% of the untied requests and
    # at most a quarter of the requests tie (agreement metrics saturate on near-flat random logits).
    verdict = {m: all((r[2] >= 75 or r[2] <= 25) and r[3] <= 25 for r in rows if r[1] == m) for m in METRICS}
    separating = [m for m, ok in verdict.items() if ok] or ["none"]
    weak = [m for m, ok in verdict.items() if not ok] or ["none"]
    tasks = list(dict.fromkeys(i.task for i in items))
    per_task = markdown_table(
        ["task", "requests"] + [f"KL {LABEL[v]}" for v in IMAGE_VARIANTS]
        + [f"rel-L2 {LABEL[v]}" for v in IMAGE_VARIANTS],
        [[t.value, sum(i.task is t for i in items)]
         + [statistics.median(r[v].kl for r, i in zip(results, items) if i.task is t) for v in IMAGE_VARIANTS]
         + [statistics.median(r[v].hidden_rel_l2 for r, i in zip(results, items) if i.task is t)
            for v in IMAGE_VARIANTS]
         for t in tasks])
    return ("Median [p10, p90] over requests:\n\n" + overall + "\n\nPaired, request by request (a metric "
            "discriminates when one variant is closer on most requests):\n\n" + comparison
            + f"\n\nOn this run, metrics that separate every pair (one side closer on ≥75% of untied requests, ≤25% "
            f"ties): **{', '.join(separating)}**; too often tied or split: {', '.join(weak)}."
            + "\n\nPer task (medians):\n\n" + per_task)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quality.fidelity", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default="bench-qwen")
    p.add_argument("--dtype", type=DType, default=DType.FLOAT32, choices=list(DType))
    p.add_argument("--synthetic", type=int, default=12, help="synthetic requests on top of the fixture items")
    p.add_argument("--limit", type=int, help="fixture items per task")
    p.add_argument("--chunk-tokens", type=int, default=64)
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads; results do not depend on it, and one "
                   "thread does not stall spin-waiting for a core on a shared machine")
    p.add_argument("--quick", action="store_true", help="tiny-qwen, one item per task, 4 synthetic requests")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.limit, args.synthetic = "tiny-qwen", 1, 4
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    vlm = VLM(ModelSpec(path=args.model, dtype=args.dtype))
    render = RenderSpec()
    chunker = Chunker(lambda text: len(vlm.adapter.encode(text)), args.chunk_tokens)
    items = items_for(args.synthetic, args.limit)
    results = [measure(vlm, item, chunker, Renderer(render), render, args.answer_tokens)
               for item in tqdm(items, desc="fidelity", unit="request")]
    body = (f"Model {args.model} ({args.dtype.value}, random weights, {vlm.device.type}); {len(items)} requests "
            f"({', '.join(sorted({i.task.value for i in items}))}), chunks of ≤{args.chunk_tokens} tokens rendered at "
            f"{render.lowest_tier.dpi} DPI; ≤{args.answer_tokens} gold answer tokens teacher-forced; "
            f"{time.perf_counter() - started:.0f} s.\n\n" + report(results, items))
    print(body)
    if not args.no_write:
        command = ("python -m benchmarks.quality.fidelity"
                   + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip())
        write_section("fidelity", "Fidelity to full prefill: template vs prefix-free vs dummy prefix (issue 15)",
                      command, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
