"""Writes an evaluation's report: Markdown (read it), JSON (feed it on), a PNG scatter of F1 vs TTFT."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from pipeline.eval.evaluation import MODE_CONTEXT
from pipeline.eval.evidence import EvidenceResult, EvidenceSummary
from pipeline.eval.markdown import markdown_table
from pipeline.eval.runner import ItemResult, ModeSummary

REPORT_MD, REPORT_JSON, SCATTER_PNG, PREDICTIONS_JSONL = ("report.md", "report.json", "f1_vs_ttft.png",
                                                          "predictions.jsonl")


def _mib(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / 2**20


def summary_markdown(summaries: Sequence[ModeSummary], per_task: bool = True) -> str:
    headers = ["served as", "items", "errors", "F1 %", "TTFT p50 ms cold", "TTFT p90 ms cold", "TTFT p50 ms warm",
               "render p50 ms", "prefill p50 ms", "context tokens (p50)", "vision tokens (p50)", "KV MiB linked (p50)",
               "truncated", "fallbacks"]

    def row(s: ModeSummary) -> list[Any]:
        return [s.config, s.num_items, s.num_errors, s.f1_percent, s.ttft_median_ms, s.ttft_p90_ms,
                s.ttft_warm_median_ms, s.render_median_ms, s.prefill_median_ms, s.context_tokens_median,
                s.vision_tokens_median, _mib(s.kv_nbytes_median), s.num_truncated, s.num_fallbacks]

    overall = [row(s) for s in summaries if s.task == "all"]
    text = ("F1 of \"all\" is the mean over tasks (LongBench's average); TTFT, tokens and KV bytes are medians "
            "over the items that were answered; cold: the serving caches emptied first, warm: the same request "
            "again (render and prefill: of the cold request; truncated: items cut in the middle to fit the "
            "context; fallbacks: chunks served at another tier than planned).\n\n" + markdown_table(headers, overall))
    if not per_task:
        return text
    tasks = [[s.task] + row(s) for s in sorted((s for s in summaries if s.task != "all"), key=lambda s: s.task)]
    return text + "\n\nPer task:\n\n" + markdown_table(["task"] + headers, tasks)


def legibility_markdown(summaries: Sequence[EvidenceSummary], num_unlocated: int) -> str:
    headers = ["served as", "items", "answer recovered %", "char accuracy", "evidence at high tier %",
               "vision tokens (p50)", "× uniform_high tokens"]
    high = next((s.vision_tokens_median for s in summaries if s.config == "uniform_high"), None)
    rows = [[s.config, s.num_items, s.recovered_percent, s.char_accuracy_mean, s.evidence_high_percent,
             s.vision_tokens_median, s.vision_tokens_median / high if high and s.vision_tokens_median else None]
            for s in summaries]
    note = (f"\n\n{num_unlocated} item(s) had no gold answer in their context (e.g. \"unanswerable\") "
            "and are not judged.")
    return markdown_table(headers, rows) + (note if num_unlocated else "")


def prompt_markdown() -> str:
    rows = [[mode.value, text] for mode, text in MODE_CONTEXT.items()]
    return ("Every request is `[chat prefix][instruction][context chunks][question + answer cue][assistant header]`: "
            "the LongBench template is split at `{context}`; the text before it (the task instruction) is prefilled "
            "online as prompt, never a chunk; the text after it (question filled in) is prefilled after the chunks; "
            "the router scores chunks against the bare question alone. What the context chunks are, per mode:"
            "\n\n" + markdown_table(["mode", "context chunks as"], rows))


def scatter_png(summaries: Sequence[ModeSummary], path: str) -> str:
    """F1 vs median TTFT, one large point per mode over all tasks and a small one per task."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    colors = plt.get_cmap("tab20")
    for i, config in enumerate(dict.fromkeys(s.config for s in summaries)):
        rows = [s for s in summaries if s.config == config and s.ttft_median_ms is not None]
        tasks = [s for s in rows if s.task != "all"]
        ax.scatter([s.ttft_median_ms for s in tasks], [s.f1_percent for s in tasks], s=14, alpha=0.35,
                   color=colors(i % 20))
        for s in rows:
            if s.task == "all":
                ax.scatter([s.ttft_median_ms], [s.f1_percent], s=70, color=colors(i % 20), label=config,
                           edgecolors="black")
    top_f1 = max((s.f1_percent for s in summaries), default=0.0)
    ax.set_ylim(-2, max(10.0, top_f1 * 1.1))
    ax.set_xscale("log")
    ax.set_xlabel("TTFT, median ms (log)")
    ax.set_ylabel("F1 %")
    ax.set_title("F1 vs TTFT per configuration (large: all tasks, small: per task)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_report(out_dir: str, meta: dict[str, Any], summaries: Sequence[ModeSummary], results: Sequence[ItemResult],
                 evidence: Sequence[EvidenceSummary], evidence_results: Sequence[EvidenceResult],
                 num_unlocated: int, sections: Sequence[tuple[str, str]] = (),
                 extra: dict[str, Any] | None = None) -> dict[str, str]:
    """report.md, report.json, predictions.jsonl and f1_vs_ttft.png under `out_dir`; their paths.
    `sections` are (title, Markdown) placed after the prompt; `extra` goes into report.json beside the rest."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {name: os.path.join(out_dir, name) for name in (REPORT_MD, REPORT_JSON, SCATTER_PNG, PREDICTIONS_JSONL)}
    scatter_png(summaries, paths[SCATTER_PNG])
    header = "\n".join(f"- {key}: {value}" for key, value in meta.items())
    parts = [f"# qvpic eval\n\n{header}", "## Prompt\n\n" + prompt_markdown()]
    parts += [f"## {title}\n\n{body}" for title, body in sections]
    parts += ["## Quality and latency per configuration\n\n" + summary_markdown(summaries),
              f"![F1 vs TTFT]({SCATTER_PNG})"]
    if evidence:
        parts.append("## Evidence legibility (OCR of the served page image of the evidence chunk)\n\n"
                        + legibility_markdown(evidence, num_unlocated))
    with open(paths[REPORT_MD], "w", encoding="utf-8") as f:
        f.write("\n\n".join(parts) + "\n")
    document = {"meta": meta, "summary": [asdict(s) for s in summaries],
                "legibility": {"summary": [asdict(s) for s in evidence], "num_unlocated": num_unlocated,
                               "results": [asdict(r) for r in evidence_results]}, **(extra or {})}
    with open(paths[REPORT_JSON], "w", encoding="utf-8") as f:
        json.dump(document, f, indent=2, default=str)
    with open(paths[PREDICTIONS_JSONL], "w", encoding="utf-8") as f:
        f.writelines(json.dumps(asdict(r), ensure_ascii=False, default=str) + "\n" for r in results)
    return paths
