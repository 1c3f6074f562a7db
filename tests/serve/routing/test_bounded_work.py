"""Hostile requests cost the server nothing: named ids are deduplicated and their chunk count is checked against
max_chunks before any per-chunk array is built (serve/routing/retrieval.py `Snapshot.select`)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from schemas.api import AnswerRequest
from schemas.errors import TooLargeError
from tests.serve.http.test_api import QUERY, app, call  # noqa: F401  (fixture)
from tests.support.store_factory import MAX_CHUNKS, roles, serving_store  # noqa: F401  (fixtures)

LIMIT = f"at most {MAX_CHUNKS} per request (max_chunks)"


def test_repeated_ids_are_one_id(app):
    """1,024 copies of one document (or chunk) is that document once, not 2,048 chunks and a 413."""
    docs = call(app, "POST", "/v1/answer", json={"query": QUERY, "doc_ids": ["invoices"] * 1024, "max_new_tokens": 2})
    assert docs.status_code == 200, docs.text
    assert [c["chunk_id"] for c in docs.json()["chunks"]] == ["invoices#00000", "invoices#00001"]
    chunks = call(app, "POST", "/v1/answer", json={
        "query": QUERY, "chunk_ids": ["manual#00001", "invoices#00000"] * 512, "max_new_tokens": 2})
    assert chunks.status_code == 200, chunks.text
    assert [c["chunk_id"] for c in chunks.json()["chunks"]] == ["manual#00001", "invoices#00000"]  # first mention


def test_more_distinct_ids_than_max_chunks_is_413_naming_the_limit(app):
    ids = ["invoices#00000", "invoices#00001", "manual#00000", "manual#00001", "recipes#00000"]
    refused = call(app, "POST", "/v1/answer", json={"query": QUERY, "chunk_ids": ids})
    assert refused.status_code == 413 and LIMIT in refused.json()["detail"]
    refused = call(app, "POST", "/v1/answer", json={"query": QUERY, "doc_ids": ["invoices", "manual", "recipes"]})
    assert refused.status_code == 413 and LIMIT in refused.json()["detail"]


def test_naming_huge_documents_is_refused_before_their_rows_exist(roles, monkeypatch):
    """The store's documents as if each held a million chunks: refusing the request reads the lookup only. Expanding
    them first (as f175d1b did) built millions of rows to count them."""
    catalog = roles.router.snapshot.catalog
    huge = np.array(catalog.doc_lookup)
    huge["count"] = 1_000_000
    monkeypatch.setattr(catalog, "doc_lookup", huge)
    untouched = []
    for name in ("chunk_rows", "entries_of", "texts"):
        monkeypatch.setattr(catalog, name, lambda *a, name=name, **k: untouched.append(name))
    monkeypatch.setattr(catalog.vectors, "scores", lambda *a, **k: untouched.append("scores"))
    request = AnswerRequest(query=QUERY, doc_ids=["invoices", "manual", "recipes"] * 300)
    tracemalloc.start()
    try:
        with pytest.raises(TooLargeError, match=r"3000000 chunks selected; this server takes at most 4"):
            roles.router.route(request, np.ones(roles.router.embedder.dim, np.float32))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert untouched == [] and peak < 4 << 20, (untouched, peak)  # 3 M row ids would be ~100 MB
