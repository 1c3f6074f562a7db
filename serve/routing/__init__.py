"""Relevance routing: the router deployment, retrieval over a serving generation, placement (which chunks are
promoted to the high tier under τ, B and the token budget), the hybrid text/page rule, and the
chunk-affinity request router across generator replicas."""

from pipeline.facade import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "affinity": ["ChunkAffinityRouter", "Decision", "ReplicaView", "choose"],
    "placement": ["PlacementSpec", "Selection", "place", "servable_modes"],
    "router": ["BatchingRouter", "Router"],
})
