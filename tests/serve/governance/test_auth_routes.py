"""API-key auth covers every route: with keys configured, only the probes (and the inspector's static pages)
answer without one; keys can come from a file (a Kubernetes Secret); a key is checked against every digest."""

from __future__ import annotations

import re

import pytest
from fastapi.routing import APIRoute

from serve.governance import key_digest
from serve.governance.auth import Authenticator, read_key_file
from serve.governance.config import AuthConfig
from tests.serve.governance.test_budget import governed_app
from tests.serve.http.test_api import call
from tests.support.store_factory import roles, serving_store  # noqa: F401  (fixtures)

KEY = "key-acme-1"
PROBES = {"/healthz", "/readyz", "/health"}  # vLLM's /health is a probe too


def every_route(routes) -> list[tuple[str, str]]:
    """(method, path) of each route the app serves, path parameters filled in (included routers flattened:
    FastAPI 0.165 keeps an included router as one `_IncludedRouter` entry)."""
    found = []
    for route in routes:
        if hasattr(route, "original_router"):
            found += every_route(route.original_router.routes)
            continue
        methods = route.methods if isinstance(route, APIRoute) else getattr(route, "methods", None) or {"GET"}
        for method in sorted(methods - {"HEAD"}):
            found.append((method, re.sub(r"\{[a-z_]+\}", "x", route.path)))
    return found


@pytest.fixture(scope="module")
def app(roles, serving_store):
    return governed_app(roles, serving_store, auth={"api_key_sha256": {key_digest(KEY): "acme"}})[0]


def test_every_route_but_the_probes_needs_a_key(app):
    routes = every_route(app.routes)
    assert {"/v1/store", "/metrics", "/docs", "/openapi.json", "/v1/models", "/v1/answer"} <= {p for _, p in routes}
    for method, path in routes + [("GET", "/no/such/route"), ("GET", "/ui/api/store")]:
        response = call(app, method, path, json={})
        if path in PROBES:
            assert response.status_code != 401, path
        else:  # refused before the route runs: no body parsed, nothing about the route told
            assert response.status_code == 401, (method, path, response.status_code)
            assert response.headers["WWW-Authenticate"] == "Bearer"
    assert call(app, "GET", "/v1/store", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert call(app, "GET", "/healthz").status_code == 200


def test_open_paths_are_configurable(roles, serving_store):
    app = governed_app(roles, serving_store, auth={"api_key_sha256": {key_digest(KEY): "acme"},
                                                   "open_paths": ["/healthz", "/metrics"]})[0]
    assert call(app, "GET", "/metrics").status_code == 200  # a scraper without a key
    assert call(app, "GET", "/v1/store").status_code == 401


def test_without_keys_nothing_is_gated(roles, serving_store):
    app = governed_app(roles, serving_store)[0]
    assert call(app, "GET", "/v1/store").status_code == 200


def test_keys_from_a_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"# rotated 2026-12-03\n{key_digest('key-globex-2')} globex\n\n"
                    f"{key_digest('key-initech')} initech\n")
    auth = Authenticator(AuthConfig(api_key_sha256={key_digest(KEY): "acme"}, api_key_sha256_file=path), "anonymous")
    assert [auth.tenant({"authorization": f"Bearer {k}"}) for k in (KEY, "key-globex-2", "key-initech")] == [
        "acme", "globex", "initech"]
    path.write_text("not-a-digest globex\n")
    with pytest.raises(ValueError, match="64 lowercase hex"):
        read_key_file(path)
    path.write_text(f"{key_digest('k')} globex extra\n")
    with pytest.raises(ValueError, match="keys:1: expected"):
        read_key_file(path)


def test_a_key_is_compared_with_every_digest_in_constant_time(monkeypatch):
    """No early exit: an unknown key and the first key both compare against all digests (hmac.compare_digest)."""
    import serve.governance.auth as auth_module

    compared = []
    real = auth_module.hmac.compare_digest
    monkeypatch.setattr(auth_module.hmac, "compare_digest", lambda a, b: compared.append(b) or real(a, b))
    keys = {key_digest(f"key-{i}"): f"t{i}" for i in range(5)}
    auth = Authenticator(AuthConfig(api_key_sha256=keys), "anonymous")
    assert auth.tenant({"authorization": "Bearer key-0"}) == "t0"
    assert len(compared) == 5
    with pytest.raises(Exception, match="unknown API key"):
        auth.tenant({"authorization": "Bearer key-9"})
    assert len(compared) == 10


def test_x_tenant_counts_only_from_a_trusted_proxy():
    """A tenant's own key fixes the tenant (X-Tenant ignored); a trusted gateway's key names it in X-Tenant."""
    auth = Authenticator(AuthConfig(api_key_sha256={key_digest(KEY): "acme"},
                                    trusted_proxy_sha256={key_digest("gateway-1")}), "anonymous")
    assert auth.tenant({"authorization": f"Bearer {KEY}", "X-Tenant": "globex"}) == "acme"
    assert auth.tenant({"authorization": "Bearer gateway-1", "X-Tenant": "globex"}) == "globex"
    with pytest.raises(Exception, match="name the tenant in X-Tenant"):
        auth.tenant({"authorization": "Bearer gateway-1"})
    with pytest.raises(Exception, match="unknown API key"):
        auth.tenant({"authorization": "Bearer gateway-2", "X-Tenant": "globex"})
