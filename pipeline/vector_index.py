"""Top-k cosine retrieval over a generation's chunk embeddings: a faiss index of int8 codes whose
candidates are rescored on the float16 rows.

Embeddings are unit vectors, so cosine is a dot product. The index holds one int8 code per value
(`round(value * code_scale)`, a quarter of float32): the search reads codes to pick
`rerank_candidates` rows, and those rows' float16 embeddings (memory-mapped) decide the ranking and
the scores. When the candidates cover every row, retrieval is exact.

Two kinds (`SearchKind`): FLAT scans every code; IVF scans the codes of the `nprobe` k-means lists
nearest the query. The job that publishes a generation builds the index once and persists it; the
router memory-maps it (faiss `IO_FLAG_MMAP*`), so start-up reads nothing and the codes are paged in
by the first searches. IVF's `nprobe` is calibrated at build time to a target recall@k against the
exact scan on held-out queries, and kept only when it reads a small share of the rows: embeddings
without neighbourhood structure (uniformly random ones) need nearly every list for any recall, and
then the flat scan is both exact and cheaper.

Why faiss: an IVF over 10^6 x 384 builds in tens of seconds on 2 cores (an HNSW graph over the same
rows took ~8 min per 10^5 rows here with usearch), both kinds persist in one file that reads with
mmap, `IDSelector`s filter when needed, MIT licence, one 19 MB abi3 wheel needing only numpy.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import faiss
import numpy as np

from schemas.generation import CalibrationPoint, SearchInfo, SearchKind, SearchSpec

_DIRECT_INT8 = faiss.ScalarQuantizer.QT_8bit_direct_signed  # code = value + 128, value floored: we round first
_ADD_ROWS = 65_536  # rows converted to codes at a time while building: bounded memory
_READ_FLAGS = {SearchKind.FLAT: faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY,
               SearchKind.IVF: faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY}


def code_scale(embeddings: np.ndarray) -> float:
    """The factor that maps the largest |value| to 127."""
    peak = max((float(np.abs(embeddings[i:i + _ADD_ROWS]).max()) for i in range(0, len(embeddings), _ADD_ROWS)),
               default=1.0)
    return 127.0 / max(peak, 1e-12)


def int8_values(rows: np.ndarray, scale: float) -> np.ndarray:
    """float32 holding integers in [-128, 127]: what a direct int8 code stores exactly."""
    return np.clip(np.rint(rows.astype(np.float32) * scale), -128, 127)


def _add(index: faiss.Index, embeddings: np.ndarray, scale: float) -> None:
    for start in range(0, len(embeddings), _ADD_ROWS):
        index.add(int8_values(embeddings[start:start + _ADD_ROWS], scale))


def exact_top_k(embeddings: np.ndarray, queries: np.ndarray, k: int, exclude: np.ndarray | None = None) -> np.ndarray:
    """[queries, k] rows of the best float32 scores (scanned in blocks); `exclude[i]` is never query i's answer."""
    best_scores = np.full((len(queries), k), -np.inf, np.float32)
    best_rows = np.full((len(queries), k), -1, np.int64)
    for start in range(0, len(embeddings), _ADD_ROWS):
        block = embeddings[start:start + _ADD_ROWS].astype(np.float32)
        scores = queries @ block.T  # [queries, block rows]
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


def build_index(embeddings: np.ndarray, spec: SearchSpec, path: Path, seed: int = 0) -> SearchInfo:
    """Build, calibrate and write the index of `embeddings` ([rows, dim] unit rows, float16) to `path`."""
    started = time.perf_counter()
    rows, dim = embeddings.shape
    scale = code_scale(embeddings)
    if rows < max(spec.ann_min_rows, 2):
        flat = faiss.IndexScalarQuantizer(dim, _DIRECT_INT8, faiss.METRIC_INNER_PRODUCT)
        _add(flat, embeddings, scale)
        faiss.write_index(flat, str(path))
        return SearchInfo(kind=SearchKind.FLAT, num_rows=rows, dim=dim, code_scale=scale, recall_k=spec.recall_k,
                          build_s=time.perf_counter() - started,
                          reason=f"{rows} rows < ann_min_rows {spec.ann_min_rows}: exhaustive scan")
    rng = np.random.default_rng(seed)
    num_lists = spec.num_lists or int(min(max(round(math.sqrt(rows)), 16), 65_536))
    ivf = faiss.IndexIVFScalarQuantizer(faiss.IndexFlatIP(dim), dim, num_lists, _DIRECT_INT8,
                                        faiss.METRIC_INNER_PRODUCT)
    ivf.cp.seed = seed
    sample = np.sort(rng.choice(rows, min(rows, 64 * num_lists), replace=False))
    ivf.train(int8_values(embeddings[sample], scale))
    _add(ivf, embeddings, scale)
    calibration = calibrate(ivf, embeddings, scale, spec, rng)
    chosen = min((p for p in calibration if p.recall >= spec.target_recall), key=lambda p: p.nprobe, default=None)
    base = dict(num_rows=rows, dim=dim, code_scale=scale, num_lists=num_lists, recall_k=spec.recall_k,
                calibration=tuple(calibration))
    if chosen is not None and chosen.scan_fraction <= spec.max_scan_fraction:
        faiss.write_index(ivf, str(path))
        return SearchInfo(kind=SearchKind.IVF, nprobe=chosen.nprobe, recall=chosen.recall,
                          build_s=time.perf_counter() - started, **base,
                          reason=f"IVF reaches recall@{spec.recall_k} {chosen.recall:.3f} reading "
                                 f"{chosen.scan_fraction:.1%} of the rows")
    del ivf
    flat = faiss.IndexScalarQuantizer(dim, _DIRECT_INT8, faiss.METRIC_INNER_PRODUCT)
    _add(flat, embeddings, scale)
    faiss.write_index(flat, str(path))
    best = max(calibration, key=lambda p: p.recall)
    within = [p for p in calibration if p.scan_fraction <= spec.max_scan_fraction]
    at_cap = max(within, key=lambda p: p.recall) if within else best
    return SearchInfo(kind=SearchKind.FLAT, build_s=time.perf_counter() - started, **base,
                      reason=f"IVF reaches only recall@{spec.recall_k} {at_cap.recall:.3f} reading "
                             f"{at_cap.scan_fraction:.1%} of the rows (target {spec.target_recall} within "
                             f"{spec.max_scan_fraction:.0%}): no neighbourhood structure to exploit, exhaustive scan")


def calibrate(ivf: faiss.IndexIVF, embeddings: np.ndarray, scale: float, spec: SearchSpec,
              rng: np.random.Generator) -> list[CalibrationPoint]:
    """Recall@k of IVF search + float16 rerank against exact search, at doubling `nprobe` until the
    target is met (then bisected down) or the scan passes `max_scan_fraction`. Queries are stored rows
    moved to cosine `calibration_query_cosine` from where they were: related to a chunk, not a copy of
    one, as a user's question is (a copy would be found in its own list and flatter the recall)."""
    rows, dim = embeddings.shape
    sources = embeddings[np.sort(rng.choice(rows, min(rows, spec.num_calibration_queries), replace=False))]
    queries = calibration_queries(sources.astype(np.float32), spec.calibration_query_cosine, rng)
    k = spec.recall_k
    truth = exact_top_k(embeddings, queries, k)
    candidates = min(rows, max(spec.rerank_candidates, 8 * k))

    def measure(nprobe: int) -> CalibrationPoint:
        faiss.cvar.indexIVF_stats.reset()
        _, found = ivf.search(queries * scale, candidates, params=faiss.SearchParametersIVF(nprobe=nprobe))
        scanned = faiss.cvar.indexIVF_stats.ndis / (len(queries) * rows)
        answers = np.stack([rerank(embeddings, q, f[f >= 0], k)[0] for q, f in zip(queries, found)])
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


def calibration_queries(sources: np.ndarray, cosine: float, rng: np.random.Generator) -> np.ndarray:
    """Unit vectors at exactly `cosine` from each (unit) source row, in a random direction."""
    noise = rng.standard_normal(sources.shape).astype(np.float32)
    noise -= (noise * sources).sum(axis=1, keepdims=True) * sources  # orthogonal to the source
    noise /= np.linalg.norm(noise, axis=1, keepdims=True)
    return (cosine * sources + np.sqrt(1.0 - cosine**2) * noise).astype(np.float32)


def rerank(embeddings: np.ndarray, query: np.ndarray, candidates: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The best `k` of `candidates` by float16-row score: (rows, scores), best first, ties by row."""
    candidates = np.unique(candidates)  # sorted: mmap pages read in order, ties broken by row
    scores = embeddings[candidates].astype(np.float32) @ query  # [candidates]
    order = np.argsort(-scores, kind="stable")[:k]
    if len(order) < k:  # fewer candidates than k (tiny stores, sparse lists): pad so answers stack
        return np.pad(candidates[order], (0, k - len(order)), constant_values=-1), scores[order]
    return candidates[order], scores[order]


class VectorIndex:
    """A persisted index opened for search: memory-mapped, read-only, safe to share between threads."""

    def __init__(self, path: Path, embeddings: np.ndarray, info: SearchInfo, rerank_candidates: int = 64):
        if embeddings.shape != (info.num_rows, info.dim):
            raise ValueError(f"embeddings {embeddings.shape} do not match the index ({info.num_rows}, {info.dim})")
        self.info, self.embeddings = info, embeddings  # [rows, dim] float16
        self.index = faiss.read_index(str(path), _READ_FLAGS[info.kind])
        if self.index.ntotal != info.num_rows:
            raise ValueError(f"index {path} holds {self.index.ntotal} rows, its record says {info.num_rows}")
        self.rerank_candidates = rerank_candidates
        # One query per search; concurrency comes from concurrent requests. OpenMP's fan-out of a single
        # query over busy cores costs more in barrier spinning than it saves: 20-47 ms vs 0.3 ms for a
        # 10^4-row scan measured on a loaded 2-core box. Process-wide, as faiss's setting is.
        faiss.omp_set_num_threads(1)
        self.params = faiss.SearchParametersIVF(nprobe=info.nprobe) if info.kind is SearchKind.IVF else None

    def __len__(self) -> int:
        return self.info.num_rows

    def search(self, query: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The `k` best rows for a unit `query` [dim]: (rows, float16-row cosines), best first, ties by row."""
        k = min(k, len(self))
        if k <= 0:
            return np.empty(0, np.int64), np.empty(0, np.float32)
        candidates = min(len(self), max(self.rerank_candidates, 8 * k))
        _, found = self.index.search((query * self.info.code_scale)[None].astype(np.float32), candidates,
                                     params=self.params)
        rows, scores = rerank(self.embeddings, query, found[0][found[0] >= 0], k)
        keep = rows >= 0
        return rows[keep], scores[:keep.sum()]

    def scores(self, rows: np.ndarray, query: np.ndarray) -> np.ndarray:
        """Cosines of `rows` (in their order) with `query`, from the float16 rows."""
        return self.embeddings[rows].astype(np.float32) @ query
