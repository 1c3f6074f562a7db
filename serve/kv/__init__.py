"""Cache loading: the loader deployment (host-memory LRU over the store), the generator's device hot tier
(and the key sketch it reports for routing), the lazily compiled tier and its pending entries, each chunk's
source for recompute, and the wire codec that moves KV between deployments."""

from pipeline.facade import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "chunk_sources": ["recompute_inputs"],
    "hot_tier": ["HotTier", "HotTierReport", "KeySketch", "key_hash"],
    "lazy_tier": ["LazyTier"],
    "loader": ["CacheLoader", "store_row"],
    "pending": ["PendingPlanner", "is_pending", "lazy_planner"],
    "wire": ["from_wire", "kv_tensor", "to_wire"],
})
