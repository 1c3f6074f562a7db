"""Calibration of an approximate (IVF) index: recall@k against exact search as a function of the
share of rows a search reads, and the verdict of whether the approximate index is worth keeping.

Queries are stored rows moved to cosine `calibration_query_cosine` from where they were: related to a
chunk, not a copy of one, as a user's question is (a copy would be found in its own list and flatter
the recall). Truth is exact float32 search over every row.
"""

from __future__ import annotations

from dataclasses import dataclass

import faiss
import numpy as np

from pipeline.store.catalog.embedding_rows import EmbeddingRows
from schemas.generation import CalibrationPoint, SearchSpec

_BLOCK_ROWS = 65_536


@dataclass(frozen=True)
class Verdict:
    accepted: bool
    point: CalibrationPoint | None  # the chosen point (accepted), or the best within the scan cap
    reason: str


def calibrate(ivf: faiss.IndexIVF, embeddings: EmbeddingRows, scale: float, spec: SearchSpec,
              rng: np.random.Generator) -> list[CalibrationPoint]:
    """Recall@k of IVF search + float16 rerank against exact search, at doubling `nprobe` until the
    target is met (then bisected down) or the scan passes `max_scan_fraction`."""
    rows = len(embeddings)
    sources = embeddings.take(np.sort(rng.choice(rows, min(rows, spec.num_calibration_queries), replace=False)))
    queries = calibration_queries(sources.astype(np.float32), spec.calibration_query_cosine, rng)
    k = spec.recall_k
    truth = exact_top_k(embeddings, queries, k)
    candidates = min(rows, max(spec.rerank_candidates, 8 * k))

    def measure(nprobe: int) -> CalibrationPoint:
        faiss.cvar.indexIVF_stats.reset()
        _, found = ivf.search(queries * scale, candidates, params=faiss.SearchParametersIVF(nprobe=nprobe))
        scanned = faiss.cvar.indexIVF_stats.ndis / (len(queries) * rows)
        answers = np.stack([embeddings.rerank(q, f[f >= 0], k)[0] for q, f in zip(queries, found)])
        return CalibrationPoint(nprobe=nprobe, scan_fraction=scanned, recall=recall_at_k(answers, truth))

    points = [measure(1)]
    while points[-1].recall < spec.target_recall:  # doubling until the target is met ...
        if points[-1].scan_fraction > spec.max_scan_fraction or points[-1].nprobe >= ivf.nlist:
            return points
        points.append(measure(min(2 * points[-1].nprobe, ivf.nlist)))
    low, high = (points[-2].nprobe if len(points) > 1 else 0), points[-1].nprobe
    while high - low > max(1, high // 8):  # ... then bisected to the smallest that meets it (within 1/8)
        points.append(measure((low + high) // 2))
        low, high = (low, points[-1].nprobe) if points[-1].recall >= spec.target_recall else (points[-1].nprobe, high)
    return sorted(points, key=lambda p: p.nprobe)


def choose(points: list[CalibrationPoint], spec: SearchSpec) -> Verdict:
    """The smallest `nprobe` that reaches the target recall within `max_scan_fraction`, if any."""
    chosen = min((p for p in points if p.recall >= spec.target_recall), key=lambda p: p.nprobe, default=None)
    if chosen is not None and chosen.scan_fraction <= spec.max_scan_fraction:
        return Verdict(True, chosen, f"reaches recall@{spec.recall_k} {chosen.recall:.3f} reading "
                                     f"{chosen.scan_fraction:.1%} of the rows")
    within = [p for p in points if p.scan_fraction <= spec.max_scan_fraction]
    at_cap = max(within, key=lambda p: p.recall) if within else max(points, key=lambda p: p.recall)
    return Verdict(False, at_cap, f"IVF reaches only recall@{spec.recall_k} {at_cap.recall:.3f} reading "
                                  f"{at_cap.scan_fraction:.1%} of the rows (target {spec.target_recall} within "
                                  f"{spec.max_scan_fraction:.0%}): no neighbourhood structure to exploit")


def exact_top_k(embeddings: EmbeddingRows | np.ndarray, queries: np.ndarray, k: int,
                exclude: np.ndarray | None = None) -> np.ndarray:
    """[queries, k] rows of the best float32 scores (scanned in blocks); `exclude[i]` is never query i's answer."""
    best_scores = np.full((len(queries), k), -np.inf, np.float32)
    best_rows = np.full((len(queries), k), -1, np.int64)
    for start, block in EmbeddingRows.of(embeddings).blocks(_BLOCK_ROWS):
        scores = queries @ block.astype(np.float32).T  # [queries, block rows]
        if exclude is not None:
            inside = (exclude >= start) & (exclude < start + len(block))
            scores[np.flatnonzero(inside), exclude[inside] - start] = -np.inf
        scores = np.concatenate([best_scores, scores], axis=1)
        rows = np.concatenate([best_rows, np.broadcast_to(np.arange(start, start + len(block)), scores[:, k:].shape)],
                              axis=1)
        top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        best_scores, best_rows = np.take_along_axis(scores, top, 1), np.take_along_axis(rows, top, 1)
    return best_rows


def recall_at_k(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean share of each query's true top-k rows among the rows found for it."""
    return float(np.mean([len(set(f.tolist()) & set(t.tolist())) / truth.shape[1] for f, t in zip(found, truth)]))


def calibration_queries(sources: np.ndarray, cosine: float, rng: np.random.Generator) -> np.ndarray:
    """Unit vectors at exactly `cosine` from each (unit) source row, in a random direction."""
    noise = rng.standard_normal(sources.shape).astype(np.float32)
    noise -= (noise * sources).sum(axis=1, keepdims=True) * sources  # orthogonal to the source
    noise /= np.linalg.norm(noise, axis=1, keepdims=True)
    return (cosine * sources + np.sqrt(1.0 - cosine**2) * noise).astype(np.float32)
