"""Collections (issue 37 item 3): documents belong to tenants. With a second tenant as the attacker: retrieval
never returns a chunk outside the key's collections; `chunk_ids` / `doc_ids` naming one answer exactly as a
nonexistent id does; the inspector does not render it (cached or not); `/v1/store` and the inspector's overview
count only the key's collections. The store is the shared test store with two of its documents moved into
collections, the third left in a part written before collections existed (null: public)."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest

from pipeline.store import Store, publish_generation
from schemas.errors import UnknownIdsError
from serve.app import api_spec
from serve.config import AppConfig, RouterConfig
from serve.governance import Governor, key_digest
from serve.http import make_api
from serve.local import InProcessBackend
from serve.routing import Router
from serve.ui import Inspector, InspectorConfig, install_ui
from tests.serve.http.test_api import call
from tests.support.store_factory import MAX_CHUNKS, roles, serving_store  # noqa: F401  (fixtures)

KEYS = {"acme": "key-acme", "acme-eu": "key-acme-eu", "mallory": "key-mallory", "ops": "key-ops"}
AUTH = {"api_key_sha256": {key_digest(key): tenant for tenant, key in KEYS.items()},
        # acme reads its own and the public collection; mallory is not listed: the default, public only
        "collections": {"acme": ["public", "acme"], "acme-eu": ["public", "acme"], "ops": ["*"]}}
INVOICE = "What is the total of invoice 4471 for part XK-4471-B?"


def headers(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


@pytest.fixture(scope="module")
def collected(serving_store, tmp_path_factory) -> str:
    """The test store with "invoices" in collection acme and "recipes" in globex (republished rows: the newest
    wins); "manual" keeps its rows from the part written without the column."""
    root = tmp_path_factory.mktemp("collections") / "store"
    shutil.copytree(serving_store.uri, root)
    store = Store.open(str(root))
    chunks = store.chunks().to_pylist()
    moved = {"invoices": "acme", "recipes": "globex"}
    store.publish_chunks([{**row, "collection": moved[row["doc_id"]]} for row in chunks if row["doc_id"] in moved])
    publish_generation(store, "tests-collections")
    return str(root)


@pytest.fixture(scope="module")
def router(collected, serving_store) -> Router:
    return Router(RouterConfig(store=collected, model=serving_store.model, max_chunks=MAX_CHUNKS))


@pytest.fixture(scope="module")
def app(collected, roles, serving_store, router):
    return collections_app(collected, roles, serving_store, router)


def collections_app(collected, roles, serving_store, router, **governance):
    args = AppConfig(store={"uri": collected}, model=serving_store.model, router={"max_chunks": MAX_CHUNKS},
                     ingress={"default_top_k": 4, "governance": {"auth": AUTH, **governance}})
    spec = api_spec(args)
    governor = Governor(args.ingress.governance, spec.store)
    backend = InProcessBackend(router, roles.loader, roles.generator)
    app = make_api(backend, spec, governor)
    inspector = Inspector(InspectorConfig(store=collected))

    async def page_png(*args):
        return inspector.page_png(*args)

    async def overview(*args):
        return inspector.overview(*args)
    install_ui(app, SimpleNamespace(page_png=SimpleNamespace(remote=page_png),
                                    overview=SimpleNamespace(remote=overview)),
               backend, governor)
    return app


def routed(app, tenant: str, **body) -> list[str]:
    response = call(app, "POST", "/v1/estimate", json={"query": INVOICE, **body}, headers=headers(tenant))
    assert response.status_code == 200, response.text
    return [c["chunk_id"] for c in response.json()["chunks"]]


def test_ingested_collection_is_in_the_catalog(collected):
    record = Store.open(collected)
    assert {r["doc_id"]: r["collection"] for r in record.chunks().to_pylist()} == {
        "invoices": "acme", "recipes": "globex", "manual": None}  # None: a part from before collections


def test_retrieval_returns_only_the_keys_collections(app):
    acme = routed(app, "acme", top_k=4)
    assert "invoices#00000" in acme  # the control: the invoice is what the question retrieves
    assert {c.split("#")[0] for c in acme} == {"invoices", "manual"}
    assert sorted(routed(app, "mallory", top_k=4)) == ["manual#00000", "manual#00001"]  # all that public holds
    assert {c.split("#")[0] for c in routed(app, "ops", top_k=4)} >= {"invoices"}
    assert "recipes#00000" not in acme


@pytest.mark.parametrize("field, hidden, absent", [("chunk_ids", "invoices#00000", "invoices#00099"),
                                                   ("doc_ids", "invoices", "no-such-doc")])
def test_naming_another_collections_chunk_is_a_nonexistent_one(app, field, hidden, absent):
    assert call(app, "POST", "/v1/estimate", json={"query": INVOICE, field: [hidden]},
                headers=headers("acme")).status_code == 200  # it is there, for a key that reads it
    for path, body in (("/v1/estimate", {"query": INVOICE}), ("/v1/answer", {"query": INVOICE, "max_new_tokens": 1})):
        seen = call(app, "POST", path, json={**body, field: [hidden]}, headers=headers("mallory"))
        unseen = call(app, "POST", path, json={**body, field: [absent]}, headers=headers("mallory"))
        assert seen.status_code == unseen.status_code == 404
        assert seen.json() == {"detail": f"unknown {field}: [{hidden!r}]"}
        assert unseen.json() == {"detail": f"unknown {field}: [{absent!r}]"}
        assert set(seen.headers) == set(unseen.headers)
    # mixed with a readable id: only the hidden one is named, as a missing one would be
    readable = "manual#00000" if field == "chunk_ids" else "manual"
    mixed = call(app, "POST", "/v1/estimate", json={"query": INVOICE, field: [readable, hidden]},
                 headers=headers("mallory"))
    assert mixed.status_code == 404 and mixed.json() == {"detail": f"unknown {field}: [{hidden!r}]"}


def test_chat_completions_see_only_the_keys_collections(app):
    body = {"model": "qvpic", "messages": [{"role": "user", "content": INVOICE}], "max_tokens": 1,
            "qvpic": {"doc_ids": ["invoices"]}}
    assert call(app, "POST", "/v1/chat/completions", json=body, headers=headers("acme")).status_code == 200
    refused = call(app, "POST", "/v1/chat/completions", json=body, headers=headers("mallory"))
    assert refused.status_code == 404 and "invoices" in refused.text


def test_store_counts_only_the_keys_collections(app):
    def counts(tenant):
        body = call(app, "GET", "/v1/store", headers=headers(tenant)).json()
        return body["num_documents"], body["num_chunks"], body["num_entries"]
    everything = counts("ops")
    assert everything[:2] == (3, 5) and everything[2] > 0
    assert counts("acme") == (2, 4, None)
    assert counts("mallory") == (1, 2, None)


def test_inspector_renders_only_the_keys_collections(app):
    page = {"chunk_id": "invoices#00000", "tier": "low"}
    absent = {"chunk_id": "invoices#00099", "tier": "low"}
    assert call(app, "GET", "/ui/api/page", params=page, headers=headers("mallory")).status_code == 404  # uncached
    shown = call(app, "GET", "/ui/api/page", params=page, headers=headers("acme"))
    assert shown.status_code == 200 and shown.content.startswith(b"\x89PNG")
    seen = call(app, "GET", "/ui/api/page", params=page, headers=headers("mallory"))  # now cached for acme
    unseen = call(app, "GET", "/ui/api/page", params=absent, headers=headers("mallory"))
    assert seen.status_code == unseen.status_code == 404
    assert seen.json()["detail"] == "unknown chunk 'invoices#00000'"
    assert unseen.json()["detail"] == "unknown chunk 'invoices#00099'"
    overview = call(app, "GET", "/ui/api/store", headers=headers("mallory")).json()["store"]
    assert (overview["num_documents"], overview["num_chunks"], overview["num_entries"]) == (1, 2, None)
    assert overview["entries"] == [] and overview["quarantine"] == []
    full = call(app, "GET", "/ui/api/store", headers=headers("ops")).json()["store"]
    assert (full["num_documents"], full["num_chunks"]) == (3, 5) and full["entries"]


def test_the_grant_comes_from_the_key_not_the_request(app):
    """A client cannot widen its grant: X-Tenant is ignored with keys, and no body field names collections."""
    spoofed = call(app, "POST", "/v1/estimate", json={"query": INVOICE, "doc_ids": ["invoices"]},
                   headers={**headers("mallory"), "X-Tenant": "acme"})
    assert spoofed.status_code == 404
    field = call(app, "POST", "/v1/estimate", json={"query": INVOICE, "collections": ["acme"]},
                 headers=headers("mallory"))
    assert field.status_code == 422  # an unknown field, not a grant


def test_inspector_unknown_and_hidden_raise_the_same_error(collected):
    inspector = Inspector(InspectorConfig(store=collected))
    with pytest.raises(UnknownIdsError, match=r"^unknown chunk 'recipes#00000'$"):
        inspector.page_png("recipes#00000", "low", 0, frozenset({"public", "acme"}))
    assert inspector.page_png("recipes#00000", "low", 0, frozenset({"globex"})).startswith(b"\x89PNG")
    assert inspector.page_png("manual#00000", "low", 0, frozenset({"public"})).startswith(b"\x89PNG")


def test_a_shared_cache_entry_never_serves_a_key_that_cannot_read_its_chunks(collected, roles, serving_store, router):
    """A `shared` task type crosses tenants, keyed by the routed context: the context holds only chunks the
    asking key reads, so an answer over acme's invoices is found by a tenant with the same grant and never by
    mallory, whose plan routes public chunks only."""
    app = collections_app(collected, roles, serving_store, router, response_cache={
        "levels": ["l1", "l3"], "task_types": {"faq": {"query_independent": True, "shared": True}}})

    def ask(tenant, query):
        response = call(app, "POST", "/v1/answer", json={"query": query, "task_type": "faq", "top_k": 4,
                                                         "max_new_tokens": 1}, headers=headers(tenant))
        assert response.status_code == 200, response.text
        return response
    first = ask("acme", INVOICE).json()
    assert "invoices#00000" in [c["chunk_id"] for c in first["chunks"]] and not first["cache_hit"]
    same_grant = ask("acme-eu", INVOICE)  # the control: the shared entry crosses tenants whose context is equal
    assert same_grant.headers["Cache-Status"] == "qvpic; hit; detail=l1"
    attacker = ask("mallory", INVOICE)
    assert attacker.headers["Cache-Status"] == "qvpic; fwd=uri-miss" and not attacker.json()["cache_hit"]
    assert {c["chunk_id"].split("#")[0] for c in attacker.json()["chunks"]} == {"manual"}
