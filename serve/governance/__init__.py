"""Cost governance at the ingress: API-key auth, token budgets and rate limits, response caches, the request
log, and where shared state lives (memory or Redis). Its configs are in serve/governance/config.py."""

from pipeline.facade import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "auth": ["key_digest"],
    "governor": ["Governor", "Route"],
    "request_log": ["REQUEST_LOG_SCHEMA"],
    "turn": ["Turn", "replay"],
})
