"""The paper's experiments as one grid, and its tables.

Main grid: the six LongBench QA tasks × {full_text, full_image, text_pic, text_pic (prefix-free),
image_pic, image_pic (dummy prefix), uniform at every tier, qvpic}; the τ/B sweep (qvpic at every
(τ, B)); the DPI sweep (uniform at every tier, and qvpic promoting to every tier between the lowest and
the highest). Tables follow the paper's layout: F1 per task and their average, TTFT, context and
vision tokens; plus the fidelity-to-full-prefill table of every cached configuration.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline.eval.longbench import LONGBENCH_QA_TASKS
from pipeline.eval.markdown import markdown_table
from schemas.config import Mode, TierSpec

# `qvpic eval --help` reads this module's defaults: the harness (store, torch) is imported where used.
if TYPE_CHECKING:
    from pipeline.eval.evaluation import ModeSummary, ServingConfig
    from pipeline.eval.fidelity import FidelitySummary

PAPER_TIERS = ("low=72", "mid=96", "high=120")  # the DPI sweep's default tiers
DEFAULT_TAUS = (0.3, 0.5, 0.9)
DEFAULT_BUDGETS = (1, 2, 4)
SWEEP_PNG = "sweeps.png"
TASK_LABELS = {"narrativeqa": "NQA", "qasper": "Qasper", "multifieldqa_en": "MFQA-en", "hotpotqa": "HotpotQA",
               "2wikimqa": "2WikiMQA", "musique": "MuSiQue", "synthetic": "Synthetic", "generic": "Generic"}
BASELINES = (Mode.FULL_TEXT, Mode.FULL_IMAGE, Mode.TEXT_PIC, Mode.TEXT_PIC_PLAIN, Mode.IMAGE_PIC, Mode.IMAGE_PIC_DUMMY)
NAMES = {Mode.TEXT_PIC_PLAIN: "text_pic (prefix-free)", Mode.IMAGE_PIC: "image_pic (prefix-free)",
         Mode.IMAGE_PIC_DUMMY: "image_pic (dummy prefix)"}


def uniform_name(tier: TierSpec) -> str:
    return f"uniform {tier.name} ({tier.dpi} DPI)"


def promote_name(tier: TierSpec, tiers_by_dpi: Sequence[TierSpec]) -> str:
    """qvpic promoting to `tier`; to the highest tier that is plain qvpic (the main grid's row)."""
    return "qvpic" if tier == tiers_by_dpi[-1] else f"qvpic → {tier.name} ({tier.dpi} DPI)"


@dataclass(frozen=True)
class PaperGrid:
    main: tuple[ServingConfig, ...]
    tau_budget: tuple[ServingConfig, ...]
    dpi: tuple[ServingConfig, ...]
    tiers: tuple[TierSpec, ...]  # by DPI

    @property
    def configs(self) -> list[ServingConfig]:
        """Every distinct configuration once, main grid first."""
        return list({c.name: c for c in self.main + self.tau_budget + self.dpi}.values())


def paper_grid(tiers: Sequence[TierSpec], taus: Sequence[float] = DEFAULT_TAUS,
               budgets: Sequence[int] = DEFAULT_BUDGETS) -> PaperGrid:
    """The configurations of the paper's grid over a store's `tiers` (qvpic and full_image: server τ/B defaults)."""
    from pipeline.eval.evaluation import ServingConfig

    by_dpi = tuple(sorted(tiers, key=lambda t: t.dpi))
    uniform = tuple(ServingConfig(uniform_name(t), Mode.UNIFORM, tier=t.name) for t in by_dpi)
    main = tuple(ServingConfig(NAMES.get(m, m.value), m) for m in BASELINES) + uniform + (ServingConfig.of(Mode.QVPIC),)
    sweep = tuple(ServingConfig(f"qvpic τ={tau:g} B={b}", Mode.QVPIC, tau, b) for tau in taus for b in budgets)
    promote = tuple(ServingConfig(promote_name(t, by_dpi), Mode.QVPIC, tier=t.name) for t in by_dpi[1:-1])
    return PaperGrid(main, sweep, uniform + promote, by_dpi)


def _all(summaries: Sequence[ModeSummary]) -> dict[str, ModeSummary]:
    return {s.config: s for s in summaries if s.task == "all"}


def paper_table(summaries: Sequence[ModeSummary], configs: Sequence[ServingConfig]) -> str:
    """The paper's main table: F1 % per task and their average, median TTFT, context and vision tokens."""
    tasks = [t for t in dict.fromkeys(s.task for s in summaries) if t != "all"]
    tasks.sort(key=lambda t: [x.value for x in LONGBENCH_QA_TASKS].index(t) if t in TASK_LABELS else 99)
    cell = {(s.config, s.task): s for s in summaries}
    rows = []
    for config in configs:
        overall = cell.get((config.name, "all"))
        if overall is None:
            continue
        rows.append([config.name] + [cell[(config.name, t)].f1_percent for t in tasks]
                    + [overall.f1_percent, overall.ttft_median_ms, overall.context_tokens_median,
                       overall.vision_tokens_median])
    headers = (["method"] + [TASK_LABELS.get(t, t) for t in tasks]
               + ["Avg", "TTFT ms", "context tokens", "vision tokens"])
    return markdown_table(headers, rows)


def tau_budget_table(summaries: Sequence[ModeSummary], grid: PaperGrid) -> str:
    overall = _all(summaries)
    rows = [[c.tau, c.max_high_res, overall[c.name].f1_percent, overall[c.name].ttft_median_ms,
             overall[c.name].vision_tokens_median, overall[c.name].num_high_median]
            for c in grid.tau_budget if c.name in overall]
    return markdown_table(["τ", "B", "Avg F1 %", "TTFT ms", "vision tokens", "promoted chunks"], rows)


def dpi_table(summaries: Sequence[ModeSummary], grid: PaperGrid) -> str:
    """Per tier: uniform at that DPI, and qvpic promoting the routed chunks to it (low = the lowest tier)."""
    overall = _all(summaries)
    rows = []
    for tier in grid.tiers:
        uniform = overall.get(uniform_name(tier))
        promoted = None if tier is grid.tiers[0] else overall.get(promote_name(tier, grid.tiers))
        rows.append([tier.name, tier.dpi] + [getattr(s, f) if s else None for s in (uniform, promoted)
                                             for f in ("f1_percent", "ttft_median_ms", "vision_tokens_median")])
    headers = ["tier", "DPI", "uniform F1 %", "uniform TTFT ms", "uniform vision tokens",
               "qvpic→tier F1 %", "qvpic→tier TTFT ms", "qvpic→tier vision tokens"]
    return markdown_table(headers, rows)


def fidelity_table(summaries: Sequence[FidelitySummary]) -> str:
    """Per cached configuration over all tasks: median [p10, p90] of every fidelity metric."""
    from pipeline.eval.fidelity import METRICS

    def spread(s: FidelitySummary, metric: str) -> str:
        if math.isnan(s.median[metric]):
            return "–"
        return f"{s.median[metric]:.3g} [{s.p10[metric]:.3g}, {s.p90[metric]:.3g}]"

    rows = [[s.config, s.reference.value, s.num_items - s.num_errors] + [spread(s, m) for m in METRICS]
            for s in summaries if s.task == "all"]
    headers = ["cached", "reference", "items", "hidden rel-L2", "KL (nats)", "top-1 agreement", "top-5 overlap"]
    return markdown_table(headers, rows)


def sweep_png(summaries: Sequence[ModeSummary], grid: PaperGrid, path: str) -> str:
    """Two panels: the τ/B sweep (Avg F1 vs vision tokens, one line per B) and the DPI sweep."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    overall = _all(summaries)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), dpi=120)
    for budget in dict.fromkeys(c.max_high_res for c in grid.tau_budget):
        points = [(overall[c.name].vision_tokens_median, overall[c.name].f1_percent, c.tau)
                  for c in grid.tau_budget if c.max_high_res == budget and c.name in overall
                  and overall[c.name].vision_tokens_median is not None]
        if points:
            left.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"B={budget}")
            for x, y, tau in points:
                left.annotate(f"τ={tau:g}", (x, y), fontsize=6)
    left.set(xlabel="vision tokens (median)", ylabel="Avg F1 %", title="qvpic τ/B sweep")
    for label, configs in (("uniform", [c for c in grid.dpi if c.mode is Mode.UNIFORM]),
                           ("qvpic →tier", [c for c in grid.dpi if c.mode is Mode.QVPIC])):
        points = [(overall[c.name].vision_tokens_median, overall[c.name].f1_percent) for c in configs
                  if c.name in overall and overall[c.name].vision_tokens_median is not None]
        if points:
            right.plot([p[0] for p in points], [p[1] for p in points], marker="s", label=label)
    right.set(xlabel="vision tokens (median)", ylabel="Avg F1 %", title="DPI sweep")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
