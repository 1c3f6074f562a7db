"""Guards every route shares (docs/SECURITY.md): the keyless loopback mode answers only loopback Host names (DNS
rebinding), and a body nested past MAX_BODY_DEPTH is a 400 naming the limit on every JSON route, before it is
parsed."""

from __future__ import annotations

import time

import pytest

from serve.governance import key_digest
from serve.http.body_shape import MAX_BODY_DEPTH, nesting_depth
from tests.serve.governance.test_auth_routes import every_route
from tests.serve.governance.test_budget import governed_app
from tests.serve.http.test_api import QUERY, call
from tests.support.store_factory import roles, serving_store  # noqa: F401  (fixtures)

KEY = "key-acme-1"
JSON_ROUTES = {"/v1/answer", "/v1/estimate", "/v1/chat/completions", "/v1/completions", "/v1/embeddings",
               "/v1/responses", "/tokenize", "/detokenize"}


@pytest.fixture(scope="module")
def keyless(roles, serving_store):
    return governed_app(roles, serving_store)[0]


def test_the_keyless_mode_answers_only_loopback_host_names(keyless, roles, serving_store):
    for host in ("localhost", "LocalHost:8000", "127.0.0.1", "127.0.0.1:8000", "[::1]:8000", "127.0.0.2:8000"):
        assert call(keyless, "GET", "/v1/store", headers={"Host": host}).status_code == 200, host
    # a page on evil.com whose name now resolves to 127.0.0.1: the browser sends the name it resolved
    for host in ("evil.com", "evil.com:8000", "localhost.evil.com", "127.0.0.1.nip.io:8000", "[::1].evil.com",
                 "127.0.0.1:evil", "10.0.0.7:8000", ""):
        for method, path in (("GET", "/v1/store"), ("POST", "/v1/answer"), ("GET", "/ui"), ("GET", "/healthz")):
            response = call(keyless, method, path, headers={"Host": host}, json={"query": QUERY, "top_k": 2})
            assert response.status_code == 400, (host, path, response.status_code)
            assert "only Host localhost, 127.0.0.1 or [::1]" in response.text
    # with keys the key is the defence, and the bind may be anything: any Host is answered (control)
    keyed = governed_app(roles, serving_store, auth={"api_key_sha256": {key_digest(KEY): "acme"}})[0]
    assert call(keyed, "GET", "/v1/store", headers={"Host": "qvpic.example.com",
                                                    "Authorization": f"Bearer {KEY}"}).status_code == 200
    # an accepted open bind (insecure_no_auth) is reached by whatever name the network gives it
    accepted = governed_app(roles, serving_store, auth={"insecure_no_auth": True})[0]
    assert call(accepted, "GET", "/v1/store", headers={"Host": "10.0.0.7:8000"}).status_code == 200


def nested(depth: int) -> str:
    return '{"query": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"


def test_a_body_past_the_depth_limit_is_a_400_naming_it_on_every_json_route(keyless):
    routes = {path for method, path in every_route(keyless.routes) if method == "POST"}
    assert routes == JSON_ROUTES  # a new JSON route joins this list (and this test)
    for path in sorted(routes):
        for depth in (10_000, MAX_BODY_DEPTH + 1):
            started = time.perf_counter()
            response = call(keyless, "POST", path, content=nested(depth), headers={"Content-Type": "application/json"})
            assert response.status_code == 400, (path, depth, response.status_code, response.text[:200])
            assert f"nests deeper than {MAX_BODY_DEPTH} levels" in response.text, (path, response.text[:200])
            assert time.perf_counter() - started < 1.0  # the limit: refused before any parsing
        # the limit itself is parsed: whatever the route says of it, not the depth
        at_limit = call(keyless, "POST", path, content=nested(MAX_BODY_DEPTH),
                        headers={"Content-Type": "application/json"})
        assert at_limit.status_code in (400, 422) and "nests deeper" not in at_limit.text, (path, at_limit.text[:200])


def test_brackets_inside_strings_are_not_nesting(keyless):
    text = '["' + "[" * 5000 + '\\"{' * 300 + '"]'
    assert nesting_depth(text.encode()) == 1
    assert nesting_depth(b"[" * 300 + b"]" * 300) == 300
    query = "[" * (MAX_BODY_DEPTH + 10)  # a query that quotes brackets is an ordinary request
    assert call(keyless, "POST", "/v1/estimate", json={"query": query, "top_k": 2}).status_code == 200
