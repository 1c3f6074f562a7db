"""The paper's experiments as one grid, and its tables.

Main grid: the six LongBench QA tasks × {full_text, full_image, text_pic, text_pic (prefix-free),
image_pic (at the lowest and the highest tier), image_pic (dummy prefix), uniform at every tier, qvpic};
the ablation (compile prefix none / dummy / template × allocation uniform lowest / uniform highest /
query-aware dual: image_pic, image_pic_dummy and uniform at both tiers, qvpic_plain, qvpic_dummy and
qvpic); the τ/B sweep (qvpic at every (τ, B)); the DPI sweep (uniform at every tier, and qvpic promoting
to every tier between the lowest and the highest). Tables follow the paper's layout: F1 per task and
their average, TTFT cold and warm, context and vision tokens; plus the fidelity-to-full-prefill table of
every cached configuration. The ablation needs a store with the plain and dummy variants at every tier
(`qvpic ingest --ablation-tiers every`, which `--paper` ingests with).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline.eval.longbench import LONGBENCH_QA_TASKS
from pipeline.eval.markdown import markdown_table
from schemas.modes import CompilePrefix, Mode
from schemas.render import TierSpec

# `qvpic eval --help` reads this module's defaults: the harness (store, torch) is imported where used.
if TYPE_CHECKING:
    from pipeline.eval.evaluation import ServingSpec
    from pipeline.eval.fidelity import FidelitySummary
    from pipeline.eval.runner import ModeSummary

PAPER_TIERS = ("low=72", "mid=96", "high=120")  # the DPI sweep's default tiers
DEFAULT_TAUS = (0.3, 0.5, 0.9)
DEFAULT_BUDGETS = (1, 2, 4)
SWEEP_PNG = "sweeps.png"
TASK_LABELS = {"narrativeqa": "NQA", "qasper": "Qasper", "multifieldqa_en": "MFQA-en", "hotpotqa": "HotpotQA",
               "2wikimqa": "2WikiMQA", "musique": "MuSiQue", "synthetic": "Synthetic", "generic": "Generic"}
BASELINES = (Mode.FULL_TEXT, Mode.FULL_IMAGE, Mode.TEXT_PIC, Mode.TEXT_PIC_PLAIN, Mode.IMAGE_PIC, Mode.IMAGE_PIC_DUMMY)
NAMES = {Mode.TEXT_PIC_PLAIN: "text_pic (prefix-free)", Mode.IMAGE_PIC: "image_pic (prefix-free)",
         Mode.IMAGE_PIC_DUMMY: "image_pic (dummy prefix)"}
# the ablation's rows: per compile prefix, its uniform mode and its routed (query-aware dual) mode
ABLATION_MODES = {CompilePrefix.NONE: (Mode.IMAGE_PIC, Mode.QVPIC_PLAIN),
                  CompilePrefix.DUMMY: (Mode.IMAGE_PIC_DUMMY, Mode.QVPIC_DUMMY),
                  CompilePrefix.TEMPLATE: (Mode.UNIFORM, Mode.QVPIC)}
ALLOCATIONS = ("uniform lowest", "uniform highest", "query-aware dual")


def uniform_name(tier: TierSpec) -> str:
    return f"uniform {tier.name} ({tier.dpi} DPI)"


def at_tier_name(mode: Mode, tier: TierSpec) -> str:
    """A uniform baseline served at `tier`: `image_pic (prefix-free) high (120 DPI)`."""
    return f"{NAMES.get(mode, mode.value)} {tier.name} ({tier.dpi} DPI)"


def promote_name(tier: TierSpec, tiers_by_dpi: Sequence[TierSpec]) -> str:
    """qvpic promoting to `tier`; to the highest tier that is plain qvpic (the main grid's row)."""
    return "qvpic" if tier == tiers_by_dpi[-1] else f"qvpic → {tier.name} ({tier.dpi} DPI)"


@dataclass(frozen=True)
class PaperGrid:
    main: tuple[ServingSpec, ...]
    tau_budget: tuple[ServingSpec, ...]
    dpi: tuple[ServingSpec, ...]
    tiers: tuple[TierSpec, ...]  # by DPI
    ablation: dict[tuple[CompilePrefix, str], ServingSpec]  # (compile prefix, allocation) → configuration

    @property
    def configs(self) -> list[ServingSpec]:
        """Every distinct configuration once, main grid first."""
        every = self.main + tuple(self.ablation.values()) + self.tau_budget + self.dpi
        return list({c.name: c for c in every}.values())


def paper_grid(tiers: Sequence[TierSpec], taus: Sequence[float] = DEFAULT_TAUS,
               budgets: Sequence[int] = DEFAULT_BUDGETS) -> PaperGrid:
    """The configurations of the paper's grid over a store's `tiers` (qvpic and full_image: server τ/B defaults)."""
    from pipeline.eval.evaluation import ServingSpec

    by_dpi = tuple(sorted(tiers, key=lambda t: t.dpi))
    highest = by_dpi[-1]
    uniform = tuple(ServingSpec(uniform_name(t), Mode.UNIFORM, tier=t.name) for t in by_dpi)
    baselines = {m: ServingSpec(NAMES.get(m, m.value), m) for m in BASELINES}  # image_pic*: the lowest tier
    at_highest = {m: ServingSpec(at_tier_name(m, highest), m, tier=highest.name)
                  for m in (Mode.IMAGE_PIC, Mode.IMAGE_PIC_DUMMY)}
    main = (tuple(baselines.values()) + (at_highest[Mode.IMAGE_PIC],) + uniform + (ServingSpec.of(Mode.QVPIC),))
    ablation = {}
    for prefix, (uniform_mode, routed) in ABLATION_MODES.items():
        low_high = (uniform[0], uniform[-1]) if uniform_mode is Mode.UNIFORM else \
            (baselines[uniform_mode], at_highest[uniform_mode])
        for allocation, config in zip(ALLOCATIONS, low_high + (ServingSpec.of(routed),)):
            ablation[(prefix, allocation)] = config
    sweep = tuple(ServingSpec(f"qvpic τ={tau:g} B={b}", Mode.QVPIC, tau, b) for tau in taus for b in budgets)
    promote = tuple(ServingSpec(promote_name(t, by_dpi), Mode.QVPIC, tier=t.name) for t in by_dpi[1:-1])
    return PaperGrid(main, sweep, uniform + promote, by_dpi, ablation)


def _all(summaries: Sequence[ModeSummary]) -> dict[str, ModeSummary]:
    return {s.config: s for s in summaries if s.task == "all"}


def paper_table(summaries: Sequence[ModeSummary], configs: Sequence[ServingSpec]) -> str:
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
                    + [overall.f1_percent, overall.ttft_median_ms, overall.ttft_warm_median_ms,
                       overall.render_median_ms, overall.prefill_median_ms, overall.context_tokens_median,
                       overall.vision_tokens_median, overall.num_truncated])
    headers = (["method"] + [TASK_LABELS.get(t, t) for t in tasks]
               + ["Avg", "TTFT ms cold", "TTFT ms warm", "render ms", "prefill ms", "context tokens",
                  "vision tokens", "truncated"])
    return markdown_table(headers, rows)


def ablation_table(summaries: Sequence[ModeSummary], fidelity: Sequence[FidelitySummary], grid: PaperGrid) -> str:
    """The paper's two factors apart: compile prefix × allocation (the lowest and highest tiers, or routed)."""
    overall = _all(summaries)
    kl = {s.config: s.median["kl"] for s in fidelity if s.task == "all"}
    rows = []
    for (prefix, allocation), config in grid.ablation.items():
        s = overall.get(config.name)
        rows.append([prefix.value, allocation, config.name] + ([s.f1_percent, s.ttft_median_ms, s.ttft_warm_median_ms,
                                                                s.context_tokens_median] if s else [None] * 4)
                    + [kl.get(config.name)])
    return markdown_table(["compile prefix", "allocation", "configuration", "Avg F1 %", "TTFT ms cold",
                           "TTFT ms warm", "context tokens", "KL to full prefill (nats)"], rows)


def tau_budget_table(summaries: Sequence[ModeSummary], grid: PaperGrid) -> str:
    overall = _all(summaries)
    rows = [[c.tau, c.max_high_res, overall[c.name].f1_percent, overall[c.name].ttft_median_ms,
             overall[c.name].ttft_warm_median_ms, overall[c.name].vision_tokens_median, overall[c.name].num_high_median]
            for c in grid.tau_budget if c.name in overall]
    return markdown_table(["τ", "B", "Avg F1 %", "TTFT ms cold", "TTFT ms warm", "vision tokens", "promoted chunks"],
                          rows)


def dpi_table(summaries: Sequence[ModeSummary], grid: PaperGrid) -> str:
    """Per tier: uniform at that DPI, and qvpic promoting the routed chunks to it (low = the lowest tier)."""
    overall = _all(summaries)
    rows = []
    for tier in grid.tiers:
        uniform = overall.get(uniform_name(tier))
        promoted = None if tier is grid.tiers[0] else overall.get(promote_name(tier, grid.tiers))
        rows.append([tier.name, tier.dpi] + [getattr(s, f) if s else None for s in (uniform, promoted)
                                             for f in ("f1_percent", "ttft_median_ms", "vision_tokens_median")])
    headers = ["tier", "DPI", "uniform F1 %", "uniform TTFT ms cold", "uniform vision tokens",
               "qvpic→tier F1 %", "qvpic→tier TTFT ms cold", "qvpic→tier vision tokens"]
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
