"""`/v1/embeddings` and `/v1/completions` are governed like the other routes: the tenant's key (401), its
request rate (429 before any work), counted on /metrics under their own route labels (refusals too), and one
request-log row per turn — a list of prompts is one turn per prompt."""

from __future__ import annotations

import dataclasses

from serve.governance import key_digest
from tests.serve.governance.test_budget import governed_app
from tests.serve.http.test_api import call
from tests.serve.http.test_metrics import samples
from tests.support.store_factory import roles, serving_store  # noqa: F401  (fixtures)

KEY = "key-acme-1"
PROMPT = "When does part XK-4471-B ship?"
SELECTION = {"qvpic": {"chunk_ids": ["invoices#00000"]}}


class Rows(list):
    """Stands in for the request log: the rows appended."""

    def close(self) -> None:
        pass


def test_both_routes_are_keyed_rate_limited_counted_and_logged(roles, serving_store):
    app, governor = governed_app(roles, serving_store, auth={"api_key_sha256": {key_digest(KEY): "acme"}},
                                 limits={"tenants": {"acme": {"requests_per_s": 0.01, "request_burst": 4}}})
    governor.log = rows = Rows()  # where every turn writes its row: the governor and its turns
    governor.services = dataclasses.replace(governor.services, log=rows)
    auth = {"Authorization": f"Bearer {KEY}", "Cache-Control": "no-cache"}
    before = call(app, "GET", "/metrics", headers=auth).text
    assert call(app, "POST", "/v1/embeddings", json={"model": "qvpic", "input": "hi"}).status_code == 401
    embedded = call(app, "POST", "/v1/embeddings", headers=auth, json={"model": "qvpic", "input": ["hi", "there"],
                                                                         "user": "u-7"})
    assert embedded.status_code == 200 and embedded.headers["X-Request-Id"] == rows[-1].request_id
    bad = call(app, "POST", "/v1/embeddings", headers=auth, json={"model": "qvpic", "input": [1, 2]})
    assert bad.status_code == 400
    listed = call(app, "POST", "/v1/completions", headers=auth, json={
        "model": "qvpic", "prompt": [PROMPT, "Which part ships on 3 April?"], "max_tokens": 2, **SELECTION})
    assert listed.status_code == 200, listed.text
    limited = call(app, "POST", "/v1/embeddings", headers=auth, json={"model": "qvpic", "input": "hi"})
    # 1 + 1 + 2 spent the burst of 4: the invalid body was charged on arrival too, before it was read
    assert limited.status_code == 429 and "Retry-After" in limited.headers
    after = call(app, "GET", "/metrics", headers=auth).text

    def delta(name: str, **labels: str) -> float:
        return samples(after, name, **labels) - samples(before, name, **labels)

    assert delta("qvpic_requests_total", route="embeddings") == 2  # the 429 was counted, then refused
    assert delta("qvpic_requests_total", route="completions") == 2
    assert delta("qvpic_errors_total", route="embeddings", status="400") == 1  # refused before a turn: by path
    assert delta("qvpic_errors_total", route="embeddings", status="429") == 1
    assert delta("qvpic_errors_total", route="other") == 0
    assert [(r.route, r.tenant, r.status) for r in rows] == [
        ("embeddings", "acme", 200), ("completions", "acme", 200), ("completions", "acme", 200),
        ("embeddings", "acme", 429)]
    assert rows[0].end_user == "u-7" and rows[0].query_tokens == embedded.json()["usage"]["prompt_tokens"]
    assert rows[1].completion_tokens + rows[2].completion_tokens == listed.json()["usage"]["completion_tokens"]
    assert not governor.in_flight  # every prompt's slot was given back
