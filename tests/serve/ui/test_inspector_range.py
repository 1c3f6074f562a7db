"""The inspector checks a requested page against the chunk's page count before it renders anything: a page past
the end is a 404 that cost a layout, never a render of every page of the chunk (docs/SECURITY.md, "Cost")."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipeline.runtime import Renderer
from serve.app import api_spec
from serve.config import AppConfig
from serve.governance import Governor
from serve.http import make_api
from serve.local import InProcessBackend
from serve.ui import Inspector, InspectorConfig, install_ui
from serve.ui.routes import MAX_PAGE
from tests.serve.http.test_api import call
from tests.support.store_factory import MAX_CHUNKS, roles, serving_store  # noqa: F401  (fixtures)


@pytest.fixture(scope="module")
def app(roles, serving_store):
    args = AppConfig(store={"uri": serving_store.uri}, model=serving_store.model, router={"max_chunks": MAX_CHUNKS},
                     ingress={"default_top_k": 2})
    spec = api_spec(args)
    governor = Governor(args.ingress.governance, spec.store)
    backend = InProcessBackend(roles.router, roles.loader, roles.generator)
    app = make_api(backend, spec, governor)
    inspector = Inspector(InspectorConfig(store=serving_store.uri, page_cache_nbytes=0))  # no cache: every call renders

    async def page_png(*args):
        return inspector.page_png(*args)

    install_ui(app, SimpleNamespace(page_png=SimpleNamespace(remote=page_png)), backend, governor)
    return app


@pytest.fixture
def drawn(monkeypatch) -> list[int]:
    """One item per page the renderer draws."""
    calls: list[int] = []
    real = Renderer._draw_page

    def spy(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Renderer, "_draw_page", spy)
    return calls


def test_a_page_past_the_chunks_end_is_a_404_before_any_page_is_drawn(app, drawn):
    params = {"chunk_id": "manual#00000", "tier": "low"}
    first = call(app, "GET", "/ui/api/page", params={**params, "page": 0})
    assert first.status_code == 200 and first.content.startswith(b"\x89PNG")
    assert drawn  # the control: a page in range is drawn
    count = len(drawn)  # render draws every page of the chunk: this is its page count
    drawn.clear()
    for page in (count, MAX_PAGE):
        past = call(app, "GET", "/ui/api/page", params={**params, "page": page})
        assert past.status_code == 404 and f"has {count} page(s) at tier 'low'" in past.json()["detail"], past.text
    assert drawn == []  # refused on the layout's count: nothing rendered
