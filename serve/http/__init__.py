"""The HTTP surface of the Serve application: the FastAPI ingress (native and OpenAI-compatible routes),
the governed request turn both answer through, request guards and error answers, readiness, request
lifetimes (deadline, disconnect), and the backend interface the handlers call the serving roles through."""

from pipeline.facade import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "backend": ["Backend", "api_error"],
    "health": ["fetch_readiness"],
    "ingress": ["Ingress", "make_api", "respond"],
})
