"""The inspector's data routes (`/ui/api/*`) are governed like the API: a key when keys exist, the tenant's request
rate charged before any rendering (429 past it), counted in the metrics (route `inspect`) and logged (issue 37:
they had no rate limit, no log)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from serve.governance import key_digest
from serve.ui import install_ui
from tests.serve.governance.test_budget import governed_app
from tests.serve.http.test_api import call
from tests.serve.http.test_metrics import metric
from tests.support.store_factory import roles, serving_store  # noqa: F401  (fixtures)

KEY = "key-acme-1"


class FakeInspector:
    """Counts what reaches the inspector deployment: nothing may, for a refused request."""

    def __init__(self):
        self.pages = 0

        async def page_png(chunk_id, tier, page, collections):
            self.pages += 1
            return b"\x89PNG fake"
        self.page_png = SimpleNamespace(remote=page_png)


@pytest.fixture
def app(roles, serving_store):
    app, governor = governed_app(roles, serving_store, limits={"default": {"requests_per_s": 0.01, "request_burst": 2}},
                                 auth={"api_key_sha256": {key_digest(KEY): "acme"},
                                       "open_paths": ["/healthz", "/metrics"]})
    inspector = FakeInspector()
    install_ui(app, inspector, None, governor)
    return app, inspector


def test_inspector_pages_need_a_key_and_spend_the_tenants_rate(app, caplog):
    app, inspector = app
    caplog.set_level(logging.INFO, logger="serve.governance.governor")
    params = {"chunk_id": "manual#00000", "tier": "low"}
    assert call(app, "GET", "/ui/api/page", params=params).status_code == 401
    before = metric(app, "qvpic_requests_total", route="inspect")
    auth = {"Authorization": f"Bearer {KEY}"}
    codes = [call(app, "GET", "/ui/api/page", params=params, headers=auth).status_code for _ in range(4)]
    assert codes == [200, 200, 429, 429]  # a burst of 2, then the rate (one per 100 s)
    assert inspector.pages == 2  # the refused ones rendered nothing
    assert metric(app, "qvpic_requests_total", route="inspect") - before == 4
    assert caplog.text.count("inspect tenant=acme path=/ui/api/page") == 4
