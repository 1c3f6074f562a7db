"""`qvpic eval` (also `python -m jobs.evaluate`): F1, TTFT, fidelity to full prefill and evidence legibility.

Items come from LongBench-format JSONL (a folder of `<task>.jsonl` or LongBench's `data.zip`), a generic
`{question, context | chunk_ids, answers}` JSONL, the synthetic fine-evidence generator, or by default
the bundled offline fixtures. Their contexts are ingested by the real Ray Data job into `--store`; the
items then run through every mode in-process (the serving roles as plain objects, no Serve) or
through a running service (`--url http://host:port/v1/answer`, which must serve that store).
`--paper` runs the paper's grid instead (every baseline, uniform tiers, qvpic, the compile prefix ×
allocation ablation, the τ/B and DPI sweeps; its store compiles the ablation variants at every tier)
and writes its tables. Every configuration is measured cold and warm, in a seeded shuffled order
(pipeline/eval/runner.py). The report (Markdown, JSON, predictions, PNG plots) lands in `--out`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import httpx
from pydantic import ValidationError

from jobs import logs
from jobs.eval_items import ingest_documents, load_items
from jobs.help import HelpFormatter
from jobs.ingest import model_args, parse_tiers, render_args
from pipeline.eval import (
    DEFAULT_BUDGETS,
    DEFAULT_TAUS,
    LONGBENCH_QA_TASKS,
    PAPER_TIERS,
    QATask,
)
from schemas.config import ModelSpec, RouterSpec, ScoreNormalisation
from schemas.modes import Mode

# The evaluation harness, the store and the serving roles import torch, Ray and pyarrow: they are
# imported where used, so that `qvpic eval --help` answers at once.
if TYPE_CHECKING:
    from pipeline.eval import ServingSpec, StoreView

DEFAULT_GRID = ((0.3, 1), (0.5, 4), (0.9, 8))
DEFAULT_TIERS = ("low=72", "high=120")


def parse_grid(values: list[str]) -> tuple[tuple[float, int], ...]:
    grid = []
    for value in values:
        tau, sep, budget = value.partition(":")
        try:
            grid.append((float(tau), int(budget)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"grid point {value!r} must look like TAU:B, e.g. 0.5:4") from None
        if not sep or not 0 <= grid[-1][0] <= 1 or grid[-1][1] < 0:
            raise argparse.ArgumentTypeError(f"grid point {value!r}: TAU in [0, 1], B >= 0")
    return tuple(grid)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qvpic eval", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--data", help="LongBench folder of <task>.jsonl, or LongBench's data.zip "
                        "(default: bundled fixtures)")
    source.add_argument("--generic", help="JSONL of {id?, question, context | chunk_ids, answers}")
    source.add_argument("--synthetic", type=int, metavar="N", help="N synthetic fine-evidence items")
    p.add_argument("--tasks", nargs="+", type=QATask, choices=[t.value for t in LONGBENCH_QA_TASKS],
                   default=list(LONGBENCH_QA_TASKS), help="LongBench tasks to read (default: all six QA tasks)")
    p.add_argument("--limit", type=int, help="first N items of each task")
    p.add_argument("--context-words", type=int, default=1500, help="synthetic: words per context")
    p.add_argument("--seed", type=int, default=0, help="synthetic: generator seed")
    p.add_argument("--modes", nargs="+", type=Mode, choices=[m.value for m in Mode], default=list(Mode))
    p.add_argument("--paper", action="store_true", help="the paper's grid and tables instead of --modes "
                   f"(tiers default to {' '.join(PAPER_TIERS)} for the DPI sweep)")
    p.add_argument("--tau-grid", nargs="+", type=float, default=list(DEFAULT_TAUS),
                   help="--paper: τ values of the sweep")
    p.add_argument("--budget-grid", nargs="+", type=int, default=list(DEFAULT_BUDGETS), help="--paper: B values")
    p.add_argument("--store", help="store the contexts are ingested into (default: <out>/store, or <out>/paper-store "
                   "with --paper; reused across runs)")
    p.add_argument("--url", help="a running service's /v1/answer (it must serve --store); default: in-process")
    p.add_argument("--ingest-only", action="store_true", help="ingest the items' documents into --store and stop")
    model_args(p)
    render_args(p)
    p.set_defaults(tiers=None)  # resolved in `tiers()`: the paper's three, else low=72 high=120
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--tau", type=float, default=RouterSpec().tau, help="router τ of the qvpic and full_image requests")
    p.add_argument("--max-high-res", type=int, default=RouterSpec().max_high_res, help="router budget B")
    p.add_argument("--normalisation", type=ScoreNormalisation, choices=[n.value for n in ScoreNormalisation],
                   default=RouterSpec().normalisation, help="how relevance becomes the shares τ is compared with")
    p.add_argument("--temperature", type=float, default=RouterSpec().temperature, help="of the softmax normalisation")
    p.add_argument("--max-new-tokens", type=int, help="cap on LongBench's per-task answer lengths")
    p.add_argument("--order-seed", type=int, default=0, help="seed of each item's shuffled configuration order")
    p.add_argument("--no-fidelity", action="store_true", help="skip fidelity to full prefill (in-process runs only)")
    p.add_argument("--fidelity-tokens", type=int, default=16, help="gold answer tokens teacher-forced for fidelity")
    p.add_argument("--legibility-grid", nargs="+", default=[f"{t}:{b}" for t, b in DEFAULT_GRID], metavar="TAU:B")
    p.add_argument("--no-legibility", action="store_true", help="skip the OCR evidence check")
    p.add_argument("--out", default=".qvpic/eval", help="report folder")
    p.add_argument("--write-benchmarks", action="store_true", help="also write the legibility (and, with --paper, "
                   "the paper's and fidelity) tables into docs/BENCHMARKS.md")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    logs.add_verbose_flag(p)
    return p


@dataclass(frozen=True)
class EvalOutcome:
    paths: dict[str, str]
    legibility_md: str | None
    meta: dict[str, object]
    paper_md: str | None = None


def configurations(args: argparse.Namespace, view: StoreView) -> tuple[list[ServingSpec], object | None]:
    """What to run: the paper's grid over the store's tiers, or the chosen modes with the server's routing."""
    from pipeline.eval import ServingSpec, paper_grid

    if not args.paper:
        return [ServingSpec.of(m) for m in args.modes], None
    grid = paper_grid(view.render.tiers, args.tau_grid, args.budget_grid)
    return grid.configs, grid


def evaluate(args: argparse.Namespace, argv: list[str]) -> EvalOutcome:
    from jobs.eval_serving import InProcessAnswerer, ServedTraces, planner
    from pipeline.eval import (
        REFERENCE_MODE,
        REPORT_MD,
        SWEEP_PNG,
        HttpAnswerer,
        OcrJudge,
        StoreView,
        ablation_table,
        dpi_table,
        judge_items,
        legibility_markdown,
        paper_table,
        protocol,
        run,
        run_fidelity,
        serving_configs,
        summarize,
        summarize_evidence,
        summarize_fidelity,
        summary_markdown,
        sweep_png,
        tau_budget_table,
        write_report,
    )
    from pipeline.store import Store
    from schemas.api import MAX_IDS_PER_REQUEST
    from serve.config import RouterConfig
    from serve.routing import Router

    started = time.perf_counter()
    items, source = load_items(args)
    args.tiers = args.tiers or list(PAPER_TIERS if args.paper else DEFAULT_TIERS)
    model = ModelSpec(path=args.model, dtype=args.dtype, device=args.device, revision=args.revision)
    # --paper renders three tiers: a store of its own, so an earlier two-tier run's store is not refused
    store_uri = args.store or os.path.join(args.out, "paper-store" if args.paper else "store")
    if args.url is None or args.ingest_only:
        ingest_documents(items, store_uri, model, args)
    if args.ingest_only:
        return EvalOutcome({}, None, {})
    view = StoreView(Store.open(store_uri))
    view.check(items)
    router_spec = RouterSpec(tau=args.tau, max_high_res=args.max_high_res, normalisation=args.normalisation,
                             temperature=args.temperature)
    local = InProcessAnswerer.open(store_uri, model, router_spec) if args.url is None else None
    configs, grid = configurations(args, view)
    results = run(items, configs, local or HttpAnswerer(args.url), view, clear_caches=local and local.clear_caches,
                  seed=args.order_seed, max_new_tokens=args.max_new_tokens, progress=not args.quiet)
    summaries = summarize(items, results)
    fidelity = []
    if local is not None and not args.no_fidelity:
        cached = [c for c in (grid.main + tuple(grid.ablation.values()) + grid.dpi if grid else configs)
                  if c.mode in REFERENCE_MODE]
        fidelity = run_fidelity(items, list({c.name: c for c in cached}.values()),
                                ServedTraces(local, view, args.fidelity_tokens), progress=not args.quiet)
    fidelity_summaries = summarize_fidelity(fidelity)
    evidence, evidence_results, num_unlocated = [], [], 0
    if not args.no_legibility:
        router = local.router if local else Router(RouterConfig(store=store_uri, model=model, defaults=router_spec,
                                                                max_chunks=MAX_IDS_PER_REQUEST))
        evidence_results, num_unlocated = judge_items(items, view, planner(router),
                                                      serving_configs(args.legibility_grid), OcrJudge(view),
                                                      progress=not args.quiet)
        evidence = summarize_evidence(evidence_results, view.high_tier) if evidence_results else []
    render = view.render
    meta = {
        "command": "qvpic eval " + " ".join(argv), "data": source,
        "items per task": dict(Counter(item.task.value for item in items)),
        "model": f"{model.path} ({model.dtype.value}, device {model.device})", "store": store_uri,
        "chunk tokens": args.chunk_tokens, "render": f"{render.font_size_pt:g} pt, tiers "
        + ", ".join(f"{t.name}={t.dpi} DPI" for t in render.tiers),
        "router": f"τ={args.tau:g}, B={args.max_high_res}, {args.normalisation.value} normalisation"
        + (f" (T={args.temperature:g})" if args.normalisation is ScoreNormalisation.SOFTMAX else ""),
        "client": args.url or "in-process (no Serve)",
        "TTFT": "client wait for the first streamed event" if args.url else
        "route + load + render + re-anchor + prefill, as timed by the serving roles",
        **protocol(args.url is None, args.order_seed, summaries),
        "fidelity": f"{args.fidelity_tokens} gold answer tokens teacher-forced" if fidelity else "not measured",
        "response-cache answers": sum(r.response_cache is not None for r in results),
        "wall time": f"{time.perf_counter() - started:.0f} s",
    }
    sections, paper_md = [], None
    if grid is not None:
        paper_md = ("F1 % per task and their average; TTFT, context and vision tokens are medians over items.\n\n"
                    + paper_table(summaries, grid.main)
                    + "\n\nThe ablation: compile prefix × allocation (KL: median over items, see fidelity):\n\n"
                    + ablation_table(summaries, fidelity_summaries, grid) + "\n\nτ/B sweep (qvpic):\n\n"
                    + tau_budget_table(summaries, grid)
                    + "\n\nDPI sweep:\n\n" + dpi_table(summaries, grid))
        os.makedirs(args.out, exist_ok=True)
        sweep_png(summaries, grid, os.path.join(args.out, SWEEP_PNG))
        sections.append(("The paper's table", paper_md + f"\n\n![sweeps]({SWEEP_PNG})"))
    if fidelity_summaries:
        fidelity_md = fidelity_markdown(fidelity_summaries)
        sections.append(("Fidelity to full prefill", fidelity_md))
        paper_md = paper_md and paper_md + "\n\nFidelity to full prefill:\n\n" + fidelity_md
    paths = write_report(args.out, meta, summaries, results, evidence, evidence_results, num_unlocated, sections,
                         {"fidelity": {"summary": [asdict(s) for s in fidelity_summaries],
                                       "results": [asdict(r) for r in fidelity]}})
    print(summary_markdown(summaries, per_task=False))
    legibility_md = None
    if evidence:
        legibility_md = legibility_markdown(evidence, num_unlocated)
        print("\nEvidence legibility:\n\n" + legibility_md)
    print(f"\nreport: {paths[REPORT_MD]}")
    return EvalOutcome(paths, legibility_md, meta, paper_md)


def fidelity_markdown(summaries) -> str:
    from pipeline.eval import fidelity_table

    return ("Each cached configuration against the uncached reference built from the same pieces (full_image at "
            "the tiers it served, or full_text), the same gold answer tokens teacher-forced after the query: median "
            "[p10, p90] over items.\n\n" + fidelity_table(summaries))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    logs.configure(args.verbose)
    try:
        args.legibility_grid = parse_grid(args.legibility_grid)
        if args.tiers:
            parse_tiers(args.tiers)
    except argparse.ArgumentTypeError as error:
        parser().error(str(error))
    try:
        outcome = evaluate(args, argv)
    except (ValidationError, ValueError, FileNotFoundError) as error:  # bad data, store or model: EvalError & co
        print(f"qvpic eval: {error}", file=sys.stderr)
        return 2
    except httpx.HTTPError as error:
        print(f"qvpic eval: the service at {args.url} is unreachable: {error}", file=sys.stderr)
        return 1
    from pipeline.eval import write_section

    command, meta = "qvpic eval " + " ".join(argv), outcome.meta
    if args.write_benchmarks and outcome.legibility_md is not None:
        body = (f"Data: {meta['data']}, chunks of ≤{meta['chunk tokens']} tokens, rendered at {meta['render']}; "
                "relevance routing by the real router (MiniLM cosine). The page image each configuration serves for "
                "the chunk holding the answer is OCR'd with Tesseract (`pipeline/eval/evidence.py`): is the gold "
                "answer still readable at that tier? Vision tokens are the whole context's, as routed (the model's "
                "weights "
                "play no part here, only its image processor).\n\n" + outcome.legibility_md)
        write_section("legibility-eval", "Evidence legibility per serving mode (issue 7)", command, body)
    if args.write_benchmarks and outcome.paper_md is not None:
        body = (f"Data: {meta['data']} ({meta['items per task']}); model {meta['model']}; {meta['render']}; router "
                f"{meta['router']}. With random-weight models F1 measures nothing but the pipeline running; TTFT, "
                "tokens and fidelity are real.\n\n" + outcome.paper_md)
        write_section("paper-eval", "The paper's grid: F1, TTFT, tokens and fidelity per method (issue 15)", command,
                      body)
    return 0


if __name__ == "__main__":
    logs.as_program()
    sys.exit(main())
