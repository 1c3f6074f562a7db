"""Evidence legibility: is the gold answer still readable on the page image each mode serves?

With random-weight models F1 says nothing about resolution; OCR of the served pixels does. For each
item the chunk holding the answer is located in the context (`synthetic.evidence_chunks`: the evidence
sentence when the dataset gives one, else a gold answer string), each serving configuration is routed
exactly as the server routes it (the `RoutePlanner` is the real router), and the evidence chunk is rendered
at the tier that configuration serves it at, with the store's own RenderSpec, and read with Tesseract.
Text modes are not judged: their context holds the answer verbatim by construction.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tqdm import tqdm

from pipeline.eval.evaluation import ServingSpec, StoreView, item_request
from pipeline.eval.legibility import best_window_distance
from pipeline.eval.longbench import QAItem
from pipeline.eval.synthetic import SyntheticError, evidence_chunks
from pipeline.runtime import Renderer, normalise, read_text
from schemas.api import AnswerRequest
from schemas.errors import ApiError
from schemas.modes import Mode


def serving_configs(grid: Sequence[tuple[float, int]]) -> list[ServingSpec]:
    """Uniform low, uniform high, then qvpic at each (τ, B) of `grid`."""
    return ([ServingSpec("image_pic (uniform low)", Mode.IMAGE_PIC),
             ServingSpec("uniform_high", Mode.UNIFORM_HIGH)]
            + [ServingSpec(f"qvpic τ={tau:g} B={budget}", Mode.QVPIC, tau, budget) for tau, budget in grid])


@dataclass(frozen=True)
class RoutedChunk:
    chunk_id: str
    tier: str | None
    vision_tokens: int


RoutePlanner = Callable[[AnswerRequest], Sequence[RoutedChunk]]  # the router's plan, no KV moved


@dataclass(frozen=True)
class EvidenceResult:
    task: str
    item_id: str
    config: str
    evidence_chunk_ids: tuple[str, ...]
    evidence_tiers: tuple[str, ...]
    recovered: bool  # a gold answer occurs verbatim in the OCR text (both normalised)
    char_accuracy: float  # 1 − best-window edit distance / answer length, best gold answer, in [0, 1]
    vision_tokens: int  # of the whole context, as routed
    error: str | None = None


class OcrJudge:
    """OCR text per (chunk, tier), rendered as ingest rendered it; each page image is read once."""

    def __init__(self, view: StoreView):
        self.view = view
        self.renderer = Renderer(view.render)
        self._texts: dict[tuple[str, str], str] = {}

    def text(self, chunk_id: str, tier: str) -> str:
        if (chunk_id, tier) not in self._texts:
            spec = self.view.render.tier(tier)
            pages = self.renderer.render(self.view.text_of[chunk_id], spec).pages
            self._texts[(chunk_id, tier)] = "\n".join(read_text(page, dpi=spec.dpi) for page in pages)
        return self._texts[(chunk_id, tier)]

    def judge(self, chunk_ids: Sequence[str], tiers: Sequence[str], answers: Sequence[str]) -> tuple[bool, float]:
        """(recovered, char accuracy) of the best gold answer in the OCR text of the chunks, in order
        (an answer cut between two chunks is read across the cut)."""
        haystack = normalise(" ".join(self.text(c, t) for c, t in zip(chunk_ids, tiers)))
        best = 0.0
        for answer in answers:
            needle = normalise(answer)
            if not needle:
                continue
            if needle in haystack:
                return True, 1.0
            best = max(best, 1.0 - best_window_distance(needle, haystack) / len(needle))
        return False, best


def find_evidence(item: QAItem, view: StoreView) -> list[str] | None:
    """Ids of the context chunks holding the evidence, or None when no gold answer occurs in the context
    (e.g. "unanswerable"; the task instruction is prompt, not context, and is never searched)."""
    context_ids = view.chunk_ids(item)
    texts = [view.text_of[c] for c in context_ids]
    for answer in item.answers:
        try:
            return [context_ids[i] for i in evidence_chunks(texts, item.evidence or answer, answer)]
        except SyntheticError:
            continue
    return None


def judge_items(items: Sequence[QAItem], view: StoreView, plan: RoutePlanner, configs: Sequence[ServingSpec],
                judge: OcrJudge, progress: bool = True) -> tuple[list[EvidenceResult], int]:
    """Results per (item with located evidence, config), and how many items had no evidence to judge."""
    results, num_unlocated = [], 0
    for item in tqdm(items, desc="legibility", unit="item", disable=not progress):
        evidence = find_evidence(item, view)
        if evidence is None:
            num_unlocated += 1
            continue
        for config in configs:
            request = item_request(item, view, config)
            try:
                routed = plan(request)
            except ApiError as error:
                results.append(EvidenceResult(item.task.value, item.id, config.name, tuple(evidence), (), False, 0.0,
                                              0, f"{type(error).__name__}: {error}"))
                continue
            tier_of = {c.chunk_id: c.tier for c in routed}
            tiers = tuple(tier_of[c] for c in evidence)
            recovered, accuracy = judge.judge(evidence, tiers, item.answers)
            results.append(EvidenceResult(item.task.value, item.id, config.name, tuple(evidence), tiers, recovered,
                                          accuracy, sum(c.vision_tokens for c in routed)))
    return results, num_unlocated


@dataclass(frozen=True)
class EvidenceSummary:
    config: str
    num_items: int
    num_errors: int
    recovered_percent: float
    char_accuracy_mean: float
    evidence_high_percent: float  # items whose evidence chunks were all served at the high tier
    vision_tokens_median: float | None


def summarize_evidence(results: Sequence[EvidenceResult], high_tier: str) -> list[EvidenceSummary]:
    rows = []
    for config in dict.fromkeys(r.config for r in results):
        group = [r for r in results if r.config == config]
        ok = [r for r in group if r.error is None]
        rows.append(EvidenceSummary(
            config, len(group), len(group) - len(ok), 100 * sum(r.recovered for r in group) / len(group),
            statistics.fmean(r.char_accuracy for r in group),
            100 * sum(bool(r.evidence_tiers) and all(t == high_tier for t in r.evidence_tiers) for r in group)
            / len(group),
            statistics.median(r.vision_tokens for r in ok) if ok else None))
    return rows
