"""Fidelity to full prefill: what caching costs, measured without trained weights.

A cached context (chunks compiled offline, linked at serve time) and the uncached reference built from
the same pieces (one full prefill: the same pages at the same tiers for image modes, the same text for
text PIC) are each fed the same N answer tokens, teacher-forced after the query. At the N positions
that predict them we compare:

- `hidden_rel_l2`: ‖H − H_ref‖ / ‖H_ref‖ over the last layer's hidden states (after the final norm), `[N, hidden]`;
- `kl`: mean over positions of KL(p_ref ‖ p) of the next-token distributions, in nats;
- `top1_agreement`: share of positions whose most likely next token agrees;
- `top5_overlap`: mean share of the reference's top-5 tokens also in the cached top 5.

This is real computation with random weights too: the gap is exactly what linking costs (no
attention across chunks or to the instruction, how the chunk's KV was conditioned at compile).
Random-weight distributions are nearly flat, so agreement metrics saturate; see docs/BENCHMARKS.md
(`fidelity`) for which metrics separate the compile variants. `trace_full`, `trace_linked` and
`compare` are the reusable core: a KV-quantisation or recompute option builds its own context and
calls `trace_linked` on it against one `trace_full` reference.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from pipeline.eval.evaluation import ServingSpec
from pipeline.eval.longbench import QAItem
from pipeline.runtime import AssembledContext
from schemas.modes import ChunkKind, Mode


@dataclass(frozen=True)
class Trace:
    """What a context makes of the teacher-forced answer: one row per predicting position."""

    hidden: torch.Tensor  # [N, hidden] float32, last layer after the final norm
    logits: torch.Tensor  # [N, vocab] float32


@dataclass(frozen=True)
class Fidelity:
    hidden_rel_l2: float
    kl: float
    top1_agreement: float
    top5_overlap: float
    num_tokens: int


METRICS = ("hidden_rel_l2", "kl", "top1_agreement", "top5_overlap")


@contextmanager
def _final_hidden(vlm) -> Iterator[list[torch.Tensor]]:
    """Hidden states leaving the LLM's final norm, `[L, hidden]` per forward, while the block runs."""
    captured: list[torch.Tensor] = []
    norm = vlm.model.model.language_model.norm
    handle = norm.register_forward_hook(lambda _module, _inputs, output: captured.append(output[0].float()))
    try:
        yield captured
    finally:
        handle.remove()


def _teacher_force(vlm, prefill: Callable[[], object], answer_ids: Sequence[int]) -> Trace:
    """Prefill (its last position predicts answer token 1), then feed answer tokens 1..N-1."""
    if not answer_ids:
        raise ValueError("fidelity needs at least one answer token")
    with _final_hidden(vlm) as hidden:
        state = prefill()
        logits = [state.logits[0, -1:].float()]
        if len(answer_ids) > 1:
            logits.append(vlm.extend(state, answer_ids[:-1]).logits[0].float())
    rows = [hidden[0][-1:]] + ([hidden[1]] if len(answer_ids) > 1 else [])
    return Trace(torch.cat(rows), torch.cat(logits))


def trace_full(vlm, pieces: Sequence, query: str, answer_ids: Sequence[int]) -> Trace:
    """The uncached reference: one full prefill of `[prefix][pieces…][query turn]` (a piece is text or pages)."""
    return _teacher_force(vlm, lambda: vlm.prefill_full(pieces, query), answer_ids)


def trace_linked(vlm, context: AssembledContext, query: str, answer_ids: Sequence[int]) -> Trace:
    """A cached context: the query prefilled on an assembled cache (which it does not modify)."""
    return _teacher_force(vlm, lambda: vlm.prefill_query(context, query), answer_ids)


def compare(trace: Trace, reference: Trace) -> Fidelity:
    if trace.logits.shape != reference.logits.shape:
        raise ValueError(f"traces of different shapes: {tuple(trace.logits.shape)} vs {tuple(reference.logits.shape)}")
    hidden_rel_l2 = float(torch.linalg.norm(trace.hidden - reference.hidden) / torch.linalg.norm(reference.hidden))
    log_p, log_ref = trace.logits.double().log_softmax(-1), reference.logits.double().log_softmax(-1)
    kl = float((log_ref.exp() * (log_ref - log_p)).sum(-1).mean())
    top1 = float((trace.logits.argmax(-1) == reference.logits.argmax(-1)).double().mean())
    top5, top5_ref = trace.logits.topk(5, -1).indices, reference.logits.topk(5, -1).indices
    overlap = (top5.unsqueeze(-1) == top5_ref.unsqueeze(-2)).any(-1).double().mean()
    return Fidelity(hidden_rel_l2, kl, top1, float(overlap), reference.logits.shape[0])


def answer_token_ids(vlm, item: QAItem, num_tokens: int) -> list[int]:
    """The first `num_tokens` tokens of the item's first gold answer: the same for every mode."""
    return vlm.adapter.encode(item.answers[0])[:num_tokens] or vlm.adapter.encode(" ")


# ---- over an evaluation's items and modes -----------------------------------------------------------
CACHED_MODES = tuple(m for m in Mode if not m.online)  # every linked mode
# each one's uncached reference: the same chunks prefilled online, as text or as the pages it links
REFERENCE_MODE = {mode: Mode.FULL_TEXT if mode.kind is ChunkKind.TEXT else Mode.FULL_IMAGE for mode in CACHED_MODES}

TracePair = Callable[[QAItem, ServingSpec], tuple[Trace, Trace]]  # (cached, reference) of an item


@dataclass(frozen=True)
class FidelityResult:
    task: str
    item_id: str
    config: str  # ServingSpec.name
    mode: Mode
    reference: Mode  # the uncached mode built from the same pieces (full_image at the same tiers, or full_text)
    fidelity: Fidelity | None
    error: str | None = None


def run_fidelity(items: Sequence[QAItem], configs: Sequence[ServingSpec], traces: TracePair,
                 progress: bool = True) -> list[FidelityResult]:
    """Fidelity of every cached configuration on every item (online modes have nothing to compare)."""
    cached = [c for c in configs if c.mode in REFERENCE_MODE]
    results = []
    for item in tqdm(items, desc="fidelity", unit="item", disable=not progress):
        for config in cached:
            reference = REFERENCE_MODE[config.mode]
            try:
                linked, full = traces(item, config)
            except ValueError as error:  # ApiError & co: recorded, never silently dropped
                results.append(FidelityResult(item.task.value, item.id, config.name, config.mode, reference, None,
                                              f"{type(error).__name__}: {error}"))
                continue
            results.append(FidelityResult(item.task.value, item.id, config.name, config.mode, reference,
                                          compare(linked, full)))
    return results


@dataclass(frozen=True)
class FidelitySummary:
    task: str  # a task, or "all"
    config: str
    mode: Mode
    reference: Mode
    num_items: int
    num_errors: int
    median: dict[str, float]  # per metric, over items
    p10: dict[str, float]
    p90: dict[str, float]


def summarize_fidelity(results: Sequence[FidelityResult]) -> list[FidelitySummary]:
    """Per task and configuration, then over all tasks: median and 10th/90th percentiles of each metric."""
    rows = []
    tasks = list(dict.fromkeys(r.task for r in results)) + ["all"]
    for config in dict.fromkeys(r.config for r in results):
        for task in tasks:
            group = [r for r in results if r.config == config and task in ("all", r.task)]
            if not group:
                continue
            ok = [r.fidelity for r in group if r.fidelity is not None]
            values = {m: [getattr(f, m) for f in ok] for m in METRICS}
            pick = lambda q, values=values: {m: float(np.percentile(v, q)) if v else float("nan")  # noqa: E731
                                             for m, v in values.items()}
            rows.append(FidelitySummary(task, config, group[0].mode, group[0].reference, len(group),
                                        len(group) - len(ok), pick(50), pick(10), pick(90)))
    return rows
