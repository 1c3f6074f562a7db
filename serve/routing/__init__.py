"""Relevance routing: the router deployment, retrieval over a serving generation, placement (which chunks are
promoted to the high tier under τ, B and the token budget), the hybrid text/page rule, and the prompt around the
chunks. Which generator replica a request then goes to is serve/dispatch/'s."""

from pipeline.facade import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "placement": ["PlacementSpec", "Retrieved", "place", "servable_modes"],
    "router": ["BatchingRouter", "Router"],
})
