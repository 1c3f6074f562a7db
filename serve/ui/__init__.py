"""The browser inspector: `GET /ui` (what the model saw for one request), `GET /ui/store` (the store at a
glance), their static assets, and the `Inspector` deployment that renders page images from the store."""

from pipeline.facade import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "inspector": ["Inspector", "InspectorConfig"],
    "routes": ["install_ui", "STATIC_UI_PATHS", "STATIC_UI_PREFIX"],
})
