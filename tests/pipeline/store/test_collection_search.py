"""Vector search within collections: the top-k of the rows a grant reads, checked against an exhaustive float
search over exactly those rows at 10^5 rows — for the flat scan (several shards) and for an IVF."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from pipeline.store.catalog import EmbeddingRows, calibration_queries, exact_top_k, recall_at_k, vector_index
from pipeline.store.catalog.collections import RowCollections, RowFilter, write_collections
from pipeline.store.catalog.vector_index import IVF_FILE, VectorIndex, _ivf, build_index, code_scale
from schemas.generation import ScanSpec, SearchInfo, SearchKind, SearchSpec

ROWS, DIM, K = 100_000, 32, 8


def unit(rows: np.ndarray) -> np.ndarray:
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


def padded(rows: np.ndarray, k: int) -> np.ndarray:
    """`rows` to length k with -1 (a search that found fewer rows than asked: those count as misses)."""
    return np.pad(rows, (0, k - len(rows)), constant_values=-1)


def exact_within(stored: np.ndarray, rows: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    """The independent reference: float32 scores of every readable row, best k (rows of the whole table)."""
    return rows[exact_top_k(stored[rows], queries, k)]


@pytest.fixture(scope="module")
def collections() -> np.ndarray:
    """A code per row: 0 most rows, 1 a tenth, 2 a thousandth (~100 rows), 3 twenty rows."""
    rng = np.random.default_rng(11)
    codes = rng.choice(3, ROWS, p=[0.899, 0.1, 0.001]).astype(np.int32)
    codes[rng.choice(ROWS, 20, replace=False)] = 3
    return codes


GRANTS = [frozenset({1}), frozenset({2}), frozenset({3}), frozenset({1, 2})]


def test_flat_search_is_the_exact_top_k_within_the_collections(tmp_path, collections, monkeypatch):
    monkeypatch.setattr(vector_index, "FLAT_SHARD_ROWS", 40_000)  # three shards: the filter is cut per shard
    embeddings = unit(np.random.default_rng(12).standard_normal((ROWS, DIM)))
    stored = embeddings.astype(np.float16)
    np.save(tmp_path / "e.npy", stored)
    info = build_index(EmbeddingRows(path=tmp_path / "e.npy"), SearchSpec(), tmp_path)
    assert info.kind is SearchKind.FLAT and len(info.files) == 3
    index = VectorIndex(tmp_path, EmbeddingRows(path=tmp_path / "e.npy"), info, ScanSpec())
    queries = unit(np.random.default_rng(13).standard_normal((40, DIM)))
    for grant in GRANTS:
        readable = RowFilter(np.isin(collections, list(grant)))
        found = [index.search(q, K, readable) for q in queries]
        assert all(np.isin(rows, readable.rows).all() for rows, _ in found), grant  # nothing outside the grant
        truth = exact_within(stored, readable.rows, queries, min(K, readable.count))  # K, or all 20 of code 3
        k = min(K, readable.count)
        assert recall_at_k(np.stack([padded(rows, k) for rows, _ in found]), truth) == 1.0, grant
        rows, scores = found[0]
        assert np.allclose(scores, stored[rows].astype(np.float32) @ queries[0], atol=1e-6)
    # unfiltered search is unchanged: the best rows of the whole table
    assert recall_at_k(np.stack([index.search(q, K)[0] for q in queries]), exact_top_k(stored, queries, K)) == 1.0


def test_ivf_search_keeps_its_recall_within_the_collections(tmp_path, collections):
    """An IVF probes `nprobe / readable share` lists under a filter: a collection holding a tenth of the rows
    gets the recall the unfiltered search has, not the much lower one of the same lists with most rows filtered
    out (measured below as the control)."""
    rng = np.random.default_rng(14)
    centres = unit(rng.standard_normal((300, DIM)))
    embeddings = unit(centres[rng.integers(0, 300, ROWS)] + 0.5 * rng.standard_normal((ROWS, DIM)) / np.sqrt(DIM))
    stored = embeddings.astype(np.float16)
    np.save(tmp_path / "e.npy", stored)
    rows_file = EmbeddingRows(path=tmp_path / "e.npy")
    scale = code_scale(rows_file)
    spec = SearchSpec(num_lists=316)
    faiss.write_index(_ivf(rows_file, scale, spec, 0), str(tmp_path / IVF_FILE))
    info = SearchInfo(kind=SearchKind.IVF, files=(IVF_FILE,), num_rows=ROWS, dim=DIM, code_scale=scale,
                      num_lists=316, nprobe=8)
    index = VectorIndex(tmp_path, rows_file, info, ScanSpec())
    # queries near any stored row: a small collection's best rows then lie in lists far from the query's
    queries = calibration_queries(stored[rng.choice(ROWS, 60)].astype(np.float32), 0.7, rng)
    unfiltered = recall_at_k(np.stack([index.search(q, K)[0] for q in queries]), exact_top_k(stored, queries, K))
    codes = (queries * scale).astype(np.float32)
    for grant in (frozenset({1}), frozenset({2})):
        readable = RowFilter(np.isin(collections, list(grant)))
        truth = exact_within(stored, readable.rows, queries, K)
        found = np.stack([padded(index.search(q, K, readable)[0], K) for q in queries])
        assert np.isin(found[found >= 0], readable.rows).all()
        filtered = recall_at_k(found, truth)
        assert filtered >= min(unfiltered, 0.95), (grant, filtered, unfiltered)
        # control: the same filter over the unfiltered search's nprobe lists misses much of what is there
        same_lists = faiss.SearchParametersIVF(nprobe=8)
        bits = np.packbits(readable.mask, bitorder="little")
        same_lists.sel = faiss.IDSelectorBitmap(ROWS, faiss.swig_ptr(bits))
        _, control = index.shards[0].search(codes, 64, params=same_lists)
        reranked = np.stack([np.pad(rows_file.rerank(q, c[c >= 0], K)[0], (0, K))[:K]
                             for q, c in zip(queries, control)])
        if grant == frozenset({2}):
            assert recall_at_k(reranked, truth) < filtered - 0.3


def test_a_chunks_dir_from_before_collections_is_all_public(tmp_path):
    """No collections.npy (a dir written before collections existed): every row is in the default collection."""
    rows = RowCollections(tmp_path, 5)
    assert rows.filter(frozenset({"public"})) is None  # reads every row: no filter at all
    hidden = rows.filter(frozenset({"acme"}))
    assert hidden is not None and hidden.count == 0 and not hidden.mask.any()


def test_codes_select_the_granted_rows(tmp_path):
    write_collections(tmp_path, np.array([0, 1, 0, 2, 1], np.int32), ["public", "acme", "globex"],
                      np.array([0, 1, 2], np.int32))
    rows = RowCollections(tmp_path, 5)
    assert rows.filter(frozenset({"acme"})).rows.tolist() == [1, 4]
    assert rows.filter(frozenset({"public", "globex"})).rows.tolist() == [0, 2, 3]
    assert rows.filter(frozenset({"public", "acme", "globex"})) is None and rows.filter(frozenset({"*"})) is None
    assert rows.filter(frozenset({"nobody"})).count == 0
    assert [(c.num_chunks, c.num_documents) for c in rows.record.counts] == [(2, 1), (2, 1), (1, 1)]
