"""Top-k cosine retrieval over a generation's chunk embeddings: faiss indexes of int8 codes whose
candidates are rescored on the float16 rows.

Embeddings are unit vectors, so cosine is a dot product. An index holds one int8 code per value
(`round(value * code_scale)`, a quarter of float32): the search reads codes to pick
`rerank_candidates` rows, and those rows' float16 embeddings (read by `pread`, never mapped) decide
the ranking and the scores. When the candidates cover every row, retrieval is exact.

Two kinds (`SearchKind`). FLAT scans every code, split in files of `FLAT_SHARD_ROWS` rows: the
publishing job holds one shard's codes at a time, and a router may scan shards on several threads.
IVF scans the codes of the `nprobe` k-means lists nearest the query (one file). The job that
publishes a generation builds the index once; the router memory-maps it (faiss `IO_FLAG_MMAP*`), so
start-up reads nothing and the codes are paged in by the first searches.

IVF's `nprobe` is calibrated (pipeline/store/catalog/ann_calibration.py) to a target recall@k against the exact
scan on held-out queries, and the IVF is kept only when it reads a small share of the rows:
embeddings without neighbourhood structure (uniformly random ones) need nearly every list for any
recall, and then the flat scan is both exact and cheaper. A sample is calibrated first, so a store
whose IVF would be rejected never pays for building it.

Why faiss: its int8 flat scan runs near memory bandwidth (10^6 x 384 codes: ~16 ms of one core
here, bandwidth alone ~12 ms), an IVF over 10^6 x 384 builds in tens of seconds on 2 cores (an HNSW
graph over the same rows took ~8 min per 10^5 rows here with usearch), both kinds persist in files
that read with mmap, MIT licence, one 19 MB abi3 wheel needing only numpy.
"""

from __future__ import annotations

import contextlib
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import faiss
import numpy as np

from pipeline.store.catalog.ann_calibration import calibrate, choose, exact_top_k, recall_at_k  # noqa: F401  (re-exported)
from pipeline.store.catalog.collections import RowFilter
from pipeline.store.catalog.embedding_rows import EmbeddingRows
from schemas.generation import ScanSpec, SearchInfo, SearchKind, SearchSpec

_DIRECT_INT8 = faiss.ScalarQuantizer.QT_8bit_direct_signed  # code = value + 128, value floored: we round first
_ADD_ROWS = 16_384  # rows converted to codes at a time while building: ~4 float32 copies of a block
FLAT_SHARD_ROWS = 262_144  # rows per flat index file (~100 MB of codes at 384 dims)
IVF_FILE = "vectors.faiss"
SAMPLE_SCAN_MARGIN = 2.0  # a sample rejects the IVF only if it misses the target reading this x max_scan_fraction
_READ_FLAGS = {SearchKind.FLAT: faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY,
               SearchKind.IVF: faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY}


def code_scale(embeddings: EmbeddingRows) -> float:
    """The factor that maps the largest |value| to 127."""
    peak = max((float(np.abs(block).max()) for _, block in embeddings.blocks(_ADD_ROWS)), default=1.0)
    return 127.0 / max(peak, 1e-12)


def int8_values(rows: np.ndarray, scale: float) -> np.ndarray:
    """float32 holding integers in [-128, 127]: what a direct int8 code stores exactly."""
    return np.clip(np.rint(rows.astype(np.float32) * scale), -128, 127)


def build_index(embeddings: EmbeddingRows, spec: SearchSpec, out: Path, seed: int = 0) -> SearchInfo:
    """Build, calibrate and write the index of `embeddings` ([rows, dim] unit rows, float16) into dir `out`."""
    started = time.perf_counter()
    rows, dim = embeddings.shape
    scale = code_scale(embeddings)
    base = dict(num_rows=rows, dim=dim, code_scale=scale, recall_k=spec.recall_k)
    if rows < max(spec.ann_min_rows, 2):
        return SearchInfo(kind=SearchKind.FLAT, files=write_flat(embeddings, scale, out), **base,
                          build_s=time.perf_counter() - started,
                          reason=f"{rows} rows < ann_min_rows {spec.ann_min_rows}: exhaustive scan")
    rng = np.random.default_rng(seed)
    sample_size = min(rows, spec.calibration_sample_rows)
    if sample_size < rows:  # a rejection seen on a sample is not paid for at full size
        sample = EmbeddingRows.of(embeddings.take(np.sort(rng.choice(rows, sample_size, replace=False))))
        lenient = spec.model_copy(update={"max_scan_fraction": min(1.0, SAMPLE_SCAN_MARGIN * spec.max_scan_fraction)})
        points = calibrate(_ivf(sample, scale, spec, seed), sample, scale, lenient, rng)
        verdict = choose(points, lenient)
        if not verdict.accepted:
            return SearchInfo(kind=SearchKind.FLAT, files=write_flat(embeddings, scale, out), **base,
                              num_lists=_num_lists(sample_size, spec), calibration=tuple(points),
                              calibration_sample_rows=sample_size, build_s=time.perf_counter() - started,
                              reason=f"on a sample of {sample_size:,} rows {verdict.reason}: IVF not built, "
                                     "exhaustive scan")
    ivf = _ivf(embeddings, scale, spec, seed)
    points = calibrate(ivf, embeddings, scale, spec, rng)
    verdict = choose(points, spec)
    base.update(num_lists=ivf.nlist, calibration=tuple(points))
    if verdict.accepted:
        faiss.write_index(ivf, str(out / IVF_FILE))
        return SearchInfo(kind=SearchKind.IVF, files=(IVF_FILE,), nprobe=verdict.point.nprobe,
                          recall=verdict.point.recall, build_s=time.perf_counter() - started, **base,
                          reason=f"IVF {verdict.reason}")
    del ivf
    return SearchInfo(kind=SearchKind.FLAT, files=write_flat(embeddings, scale, out),
                      build_s=time.perf_counter() - started, **base, reason=f"{verdict.reason}: exhaustive scan")


def _num_lists(rows: int, spec: SearchSpec) -> int:
    return spec.num_lists or int(min(max(round(math.sqrt(rows)), 16), 65_536))


def _ivf(embeddings: EmbeddingRows, scale: float, spec: SearchSpec, seed: int) -> faiss.IndexIVFScalarQuantizer:
    rows, dim = embeddings.shape
    num_lists = _num_lists(rows, spec)
    ivf = faiss.IndexIVFScalarQuantizer(faiss.IndexFlatIP(dim), dim, num_lists, _DIRECT_INT8,
                                        faiss.METRIC_INNER_PRODUCT)
    ivf.cp.seed = seed
    train = np.sort(np.random.default_rng(seed).choice(rows, min(rows, 64 * num_lists), replace=False))
    ivf.train(int8_values(embeddings.take(train), scale))
    for _, block in embeddings.blocks(_ADD_ROWS):
        ivf.add(int8_values(block, scale))
    return ivf


def write_flat(embeddings: EmbeddingRows, scale: float, out: Path) -> tuple[str, ...]:
    """Flat int8 index files of FLAT_SHARD_ROWS rows each, built one at a time."""
    rows, dim = embeddings.shape
    files = []
    for shard, start in enumerate(range(0, max(rows, 1), FLAT_SHARD_ROWS)):
        flat = faiss.IndexScalarQuantizer(dim, _DIRECT_INT8, faiss.METRIC_INNER_PRODUCT)
        for _, block in embeddings.blocks(_ADD_ROWS, start, min(rows, start + FLAT_SHARD_ROWS)):
            flat.add(int8_values(block, scale))
        files.append(f"vectors-{shard:05d}.faiss")
        faiss.write_index(flat, str(out / files[-1]))
    return tuple(files)


class VectorIndex:
    """A persisted index opened for search: memory-mapped, read-only, safe to share between threads.

    `scan.search_threads` > 1 scans a flat index's shards on that many threads (faiss releases the GIL);
    one query per search either way: concurrency across requests comes from concurrent requests.
    """

    def __init__(self, directory: Path, embeddings: EmbeddingRows, info: SearchInfo, scan: ScanSpec):
        if embeddings.shape != (info.num_rows, info.dim):
            raise ValueError(f"embeddings {embeddings.shape} do not match the index ({info.num_rows}, {info.dim})")
        self.info, self.embeddings = info, embeddings  # [rows, dim] float16
        files = info.files or (IVF_FILE,)  # generations published before indexes were sharded
        self.shards = [faiss.read_index(str(directory / name), _READ_FLAGS[info.kind]) for name in files]
        self.offsets = np.cumsum([0] + [s.ntotal for s in self.shards])
        if self.offsets[-1] != info.num_rows:
            raise ValueError(f"index {directory} holds {self.offsets[-1]} rows, its record says {info.num_rows}")
        self.rerank_candidates = scan.rerank_candidates
        self.pool = None
        self.set_search_threads(scan.search_threads)
        self.params = faiss.SearchParametersIVF(nprobe=info.nprobe) if info.kind is SearchKind.IVF else None

    def __len__(self) -> int:
        return self.info.num_rows

    def set_search_threads(self, search_threads: int) -> None:
        """Scan the shards on `search_threads` threads (at most one per shard) from the next search on."""
        threads = max(1, min(search_threads, len(self.shards)))
        self.groups = [list(range(len(self.shards)))[i::threads] for i in range(threads)]
        old, self.pool = self.pool, (ThreadPoolExecutor(threads, thread_name_prefix="vector-scan",
                                                        initializer=faiss.omp_set_num_threads, initargs=(1,))
                                     if threads > 1 else None)
        if old is not None:
            old.shutdown(wait=False)

    def candidates(self, query: np.ndarray, count: int, readable: RowFilter | None = None) -> np.ndarray:
        """Rows of the `count` best int8-code scores for a unit `query` [dim], among the `readable` rows (None:
        all). The filter runs inside the scan (a faiss ID selector), so the candidates are the best readable
        rows, not the best rows with the unreadable ones dropped afterwards (which could leave none)."""
        codes = (query * self.info.code_scale)[None].astype(np.float32)
        params = [self.params] * len(self.shards) if readable is None else self._filtered_params(readable)

        def scan(group: list[int]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
            for i in group:
                scores, rows = self.shards[i].search(codes, min(count, self.shards[i].ntotal), params=params[i])
                keep = rows[0] >= 0
                yield scores[0][keep], rows[0][keep] + self.offsets[i]

        if self.pool is not None:
            found = [r for g in self.pool.map(lambda g: list(scan(g)), self.groups) for r in g]
        else:
            with one_omp_thread():
                found = list(scan(self.groups[0]))
        scores = np.concatenate([s for s, _ in found])
        rows = np.concatenate([r for _, r in found])
        if len(rows) > count:
            rows = rows[np.argpartition(-scores, count - 1)[:count]]
        return rows

    def _filtered_params(self, readable: RowFilter) -> list[faiss.SearchParameters]:
        """Per shard: search parameters that scan only the readable rows. An IVF probes more lists the fewer
        rows are readable (`nprobe` / readable share, up to every list), so that about as many readable rows
        are scored as `nprobe` scores rows unfiltered: the calibrated recall holds within the collections."""
        params = []
        for i, shard in enumerate(self.shards):
            bits = np.packbits(readable.mask[self.offsets[i]:self.offsets[i + 1]], bitorder="little")
            selector = faiss.IDSelectorBitmap(shard.ntotal, faiss.swig_ptr(bits))
            selector.bits_kept = bits  # faiss holds a raw pointer: the array lives as long as the selector
            if self.info.kind is SearchKind.IVF:
                share = max(readable.count, 1) / len(self)
                nprobe = min(self.info.num_lists or shard.nlist, math.ceil(self.info.nprobe / share))
                params.append(faiss.SearchParametersIVF(nprobe=nprobe, sel=selector))
            else:
                params.append(faiss.SearchParameters(sel=selector))
            params[-1].selector_kept = selector
        return params

    def search(self, query: np.ndarray, k: int, readable: RowFilter | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The `k` best rows for a unit `query` [dim] among the `readable` rows (None: every row): (rows,
        float16-row cosines), best first, ties by row."""
        limit = len(self) if readable is None else readable.count
        k = min(k, limit)
        if k <= 0:
            return np.empty(0, np.int64), np.empty(0, np.float32)
        wanted = min(limit, max(self.rerank_candidates, 8 * k))
        if readable is not None and wanted == limit:  # few enough to rescore every readable row: exact
            found = readable.rows
        else:
            found = self.candidates(query, wanted, readable)
        rows, scores = self.embeddings.rerank(query, found, k)
        keep = rows >= 0
        return rows[keep], scores[:keep.sum()]

    def scores(self, rows: np.ndarray, query: np.ndarray) -> np.ndarray:
        """Cosines of `rows` (in their order) with `query`, from the float16 rows."""
        return self.embeddings.take(rows).astype(np.float32) @ query

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False)


@contextlib.contextmanager
def one_omp_thread() -> Iterator[None]:
    """Run faiss on one OpenMP thread on this thread, then give the thread its own count back.

    OpenMP's fan-out of a single query over busy cores costs more in barrier spinning than it saves
    (20-47 ms vs 0.3 ms for a 10^4-row scan on a loaded 2-core box); threads, where asked for, are ours,
    one per group of shards (their pool's threads are set to one at start). The setting is per thread and
    shared with torch, which calls the same `omp_set_num_threads`: set once for good, it left torch on one
    thread in whatever process built an index on the thread that runs the model (an in-process backend,
    the benchmarks' in-process engine, measured at 2 → 1)."""
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(threads)
