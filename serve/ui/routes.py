"""The inspector's HTTP routes, mounted on the ingress: `GET /ui` (a request inspector), `GET /ui/store` (a
store overview), their static assets, and the two data endpoints the pages read.

The pages are plain HTML, CSS and JavaScript shipped inside the package (`serve/ui/static/`, read with
importlib.resources) — no framework, no CDN, nothing fetched at run time: the UI must work on an
air-gapped cluster, and plain DOM calls (`textContent`, never `innerHTML`) keep every chunk text, doc id
and answer inert. Each UI response carries a strict Content-Security-Policy (scripts and styles from
this origin only, no inline script, images from this origin and `blob:`), so even a markup slip could
not run a corpus's script. The pages hold no data: everything comes from the data endpoints, which
authenticate like the API (`Authorization: Bearer`, sent by the page from a key kept in memory —
never in a URL, which is why page images are fetched and shown as `blob:` URLs rather than `<img src>`).
This module imports no model stack; the store side is the `Inspector` deployment (serve/ui/inspector.py).
"""

from __future__ import annotations

from importlib.resources import files
from typing import Annotated, Protocol

from fastapi import APIRouter, FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse
from ray.serve.handle import DeploymentHandle

from schemas.api import StoreId
from schemas.service import CacheStats
from serve.governance import Governor
from serve.ui.overview import CacheTier, UiStore

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                    "Referrer-Policy": "no-referrer"}
# Every asset by name: a request names one of these or gets a 404; no path is built from a request.
ASSETS = {"inspector.js": "text/javascript", "store.js": "text/javascript", "common.js": "text/javascript",
          "ui.css": "text/css", "icon.svg": "image/svg+xml"}
PAGES = {"/ui": "inspector.html", "/ui/store": "store.html"}
# What a browser loads before it can send a key: no data in them, so API-key auth leaves them open.
STATIC_UI_PATHS = frozenset(PAGES)
STATIC_UI_PREFIX = "/ui/static/"
TierName = Annotated[str, Query(pattern=r"^[a-z][a-z0-9_]{0,31}$")]  # as schemas.api.Routing.tier
MAX_PAGE = 4096


class CacheStatsSource(Protocol):
    """What the store overview asks the ingress's backend (serve/http/backend.py `Backend`)."""

    async def cache_stats(self) -> CacheStats: ...
    async def device_cache_stats(self) -> CacheStats: ...


def asset(name: str) -> bytes:
    return (files("serve.ui") / "static" / name).read_bytes()


def ui_routes(inspector: DeploymentHandle, backend: CacheStatsSource, governor: Governor) -> APIRouter:
    router = APIRouter(include_in_schema=False)

    def page(name: str):
        async def serve_page() -> Response:
            return Response(asset(name), media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS)
        return serve_page

    for path, name in PAGES.items():
        router.add_api_route(path, page(name), methods=["GET"])

    @router.get(STATIC_UI_PREFIX + "{name}")
    async def static(name: str) -> Response:
        if name not in ASSETS:
            return JSONResponse({"detail": f"no asset {name!r}"}, status_code=404, headers=SECURITY_HEADERS)
        return Response(asset(name), media_type=ASSETS[name], headers=SECURITY_HEADERS)

    @router.get("/ui/api/page")
    async def page_image(http: Request, chunk_id: Annotated[StoreId, Query()], tier: TierName,
                         page: Annotated[int, Query(ge=0, le=MAX_PAGE)] = 0) -> Response:
        """One page of a chunk at a tier, as PNG: 422 for a malformed id, 404 for a chunk, tier or page the
        store lacks (the inspector's `UnknownIdsError`, answered by the app's ApiError handler)."""
        collections = await governor.inspect(http)  # 401 / 429 before any work
        png = await inspector.page_png.remote(chunk_id, tier, page, collections)
        return Response(png, media_type="image/png",
                        headers={**SECURITY_HEADERS, "Cache-Control": "private, max-age=3600"})

    @router.get("/ui/api/store")
    async def store(http: Request) -> UiStore:
        collections = await governor.inspect(http)
        overview = await inspector.overview.remote(collections)
        return UiStore(store=overview, host_cache=CacheTier.of(await backend.cache_stats()),
                       device_cache=CacheTier.of(await backend.device_cache_stats()))

    return router


def install_ui(app: FastAPI, inspector: DeploymentHandle, backend: CacheStatsSource, governor: Governor) -> None:
    app.include_router(ui_routes(inspector, backend, governor))
