"""Vector index: exact below the threshold, IVF where the embeddings have structure, flat where they
have none — with recall@k against exact search measured, and the persisted index memory-mapped."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.store.catalog import EmbeddingRows, calibration_queries, exact_top_k, recall_at_k
from pipeline.store.catalog.vector_index import VectorIndex, build_index
from schemas.generation import ScanSpec, SearchKind, SearchSpec
from tests.support.paths import REPO


def unit(rows: np.ndarray) -> np.ndarray:
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


def random_unit(n: int, dim: int, seed: int) -> np.ndarray:
    return unit(np.random.default_rng(seed).standard_normal((n, dim)))


def clustered_unit(n: int, dim: int, clusters: int, seed: int) -> np.ndarray:
    """Topics on the sphere with members around them (cosine ~0.9 to the centre): neighbourhood
    structure like a real embedding model's, unlike uniformly random vectors."""
    rng = np.random.default_rng(seed)
    centres = random_unit(clusters, dim, seed + 1)
    return unit(centres[rng.integers(0, clusters, n)] + 0.5 * rng.standard_normal((n, dim)) / np.sqrt(dim))


def build(tmp_path, embeddings: np.ndarray, **spec) -> VectorIndex:
    stored = embeddings.astype(np.float16)
    np.save(tmp_path / "e.npy", stored)
    info = build_index(EmbeddingRows(path=tmp_path / "e.npy"), SearchSpec(**spec), tmp_path)
    return VectorIndex(tmp_path, EmbeddingRows(path=tmp_path / "e.npy"), info, ScanSpec())


def search_all(index: VectorIndex, queries: np.ndarray, k: int) -> np.ndarray:
    return np.stack([index.search(q, k)[0] for q in queries])


def test_below_the_threshold_search_is_exact(tmp_path):
    embeddings = random_unit(3000, 48, seed=0)
    index = build(tmp_path, embeddings)
    assert index.info.kind is SearchKind.FLAT and "ann_min_rows" in index.info.reason
    queries = random_unit(50, 48, seed=1)
    stored = embeddings.astype(np.float16)
    truth = exact_top_k(stored, queries, 8)
    found = search_all(index, queries, 8)
    assert recall_at_k(found, truth) == 1.0
    rows, scores = index.search(queries[0], 8)
    assert np.allclose(scores, stored[rows].astype(np.float32) @ queries[0], atol=1e-6)
    assert list(scores) == sorted(scores, reverse=True)
    assert np.allclose(index.scores(rows[::-1], queries[0]), scores[::-1])


def test_ties_go_to_the_earlier_row_and_k_is_capped(tmp_path):
    embeddings = np.repeat(random_unit(4, 16, seed=2), 3, axis=0)  # every vector three times
    index = build(tmp_path, embeddings)
    rows, scores = index.search(embeddings[5], 3)
    assert rows.tolist() == [3, 4, 5] and len(set(scores.tolist())) == 1
    assert sorted(index.search(embeddings[0], 100)[0].tolist()) == list(range(12))  # k past the rows: all of them
    assert len(index.search(embeddings[0], 0)[0]) == 0


def test_ivf_is_chosen_where_embeddings_have_structure(tmp_path):
    embeddings = clustered_unit(20_000, 32, clusters=400, seed=3)
    index = build(tmp_path, embeddings, ann_min_rows=5_000, num_calibration_queries=128,
                  calibration_query_cosine=0.7)
    info = index.info
    assert info.kind is SearchKind.IVF, info.reason
    assert info.recall >= 0.95 and info.nprobe < info.num_lists
    chosen = next(p for p in info.calibration if p.nprobe == info.nprobe)
    assert chosen.scan_fraction <= 0.25
    assert info.calibration[0].recall < 0.95 <= chosen.recall  # the curve rises: recall can miss
    # held-out queries at cosine 0.7 from stored rows, scored against exact search
    rng = np.random.default_rng(9)
    queries = calibration_queries(embeddings[rng.integers(0, len(embeddings), 200)], 0.7, rng)
    truth = exact_top_k(embeddings.astype(np.float16), queries, 8)
    assert recall_at_k(search_all(index, queries, 8), truth) >= 0.93


def test_random_embeddings_keep_the_exact_flat_scan(tmp_path):
    """Uniformly random vectors have no neighbourhoods: an IVF must read most lists for any recall, so
    the calibration rejects it and search stays exhaustive (recall 1)."""
    embeddings = random_unit(20_000, 64, seed=4)
    index = build(tmp_path, embeddings, ann_min_rows=5_000, num_calibration_queries=64)
    info = index.info
    assert info.kind is SearchKind.FLAT and "no neighbourhood structure" in info.reason
    within = [p for p in info.calibration if p.scan_fraction <= 0.25]
    assert within and max(p.recall for p in within) < 0.95  # the negative control: IVF recall measured low
    queries = random_unit(40, 64, seed=5)
    truth = exact_top_k(embeddings.astype(np.float16), queries, 8)
    assert recall_at_k(search_all(index, queries, 8), truth) == 1.0


def test_index_is_checked_against_its_record(tmp_path):
    embeddings = random_unit(100, 16, seed=6)
    index = build(tmp_path, embeddings)
    with pytest.raises(ValueError, match="do not match the index"):
        VectorIndex(tmp_path, EmbeddingRows(array=np.zeros((99, 16), np.float16)), index.info, ScanSpec())


def test_exact_top_k_excludes_the_query_row():
    embeddings = random_unit(500, 16, seed=7)
    rows = np.array([3, 42])
    assert not np.any(exact_top_k(embeddings, embeddings[rows], 5, exclude=rows) == rows[:, None])
    assert (exact_top_k(embeddings, embeddings[rows], 1)[:, 0] == rows).all()


def test_calibration_queries_sit_at_the_asked_cosine():
    sources = random_unit(10, 24, seed=8)
    queries = calibration_queries(sources, 0.5, np.random.default_rng(0))
    assert np.allclose(np.linalg.norm(queries, axis=1), 1.0, atol=1e-5)
    assert np.allclose((queries * sources).sum(axis=1), 0.5, atol=1e-5)


SHARED_OMP_SCRIPT = """
import sys
from pathlib import Path
import numpy as np
import torch  # first, as a serving process imports it: faiss's OpenMP calls then reach torch's runtime
import faiss
from pipeline.store.catalog import EmbeddingRows
from pipeline.store.catalog.vector_index import VectorIndex, build_index
from schemas.generation import ScanSpec, SearchSpec

folder, threads = Path(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(3)  # not a default, so a reset to any default shows too
torch.ones(256, 256) @ torch.ones(256, 256)  # torch's threads start (as a model's first forward starts them)
assert torch.get_num_threads() == 3
rows = np.random.default_rng(5).standard_normal((600, 16))
rows /= np.linalg.norm(rows, axis=1, keepdims=True)
np.save(folder / "e.npy", rows.astype(np.float16))
info = build_index(EmbeddingRows(path=folder / "e.npy"), SearchSpec(), folder)
index = VectorIndex(folder, EmbeddingRows(path=folder / "e.npy"), info, ScanSpec(search_threads=threads))
found = int(index.search(rows[7].astype(np.float32), 3)[0][0])
after = torch.get_num_threads()
faiss.omp_set_num_threads(1)  # negative control: what the constructor used to call, on this thread
print(found, after, torch.get_num_threads())
"""


@pytest.mark.parametrize("search_threads", [1, 2])
def test_searching_leaves_torch_its_threads(tmp_path, search_threads):
    """faiss and torch share OpenMP's per-thread count (torch imported first): an index that set it to one
    for its scans left the process's model on one core (an in-process backend builds its router's index on
    the model's thread; the benchmarks' in-process engine ran on 1 of 2 cores)."""
    import subprocess
    import sys

    root = REPO
    done = subprocess.run([sys.executable, "-c", SHARED_OMP_SCRIPT, str(tmp_path), str(search_threads)], cwd=root,
                          capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-2000:]
    found, after, control = map(int, done.stdout.split())
    assert found == 7 and after == 3
    assert control == 1  # the control: in this process a faiss-side setting does reach torch
