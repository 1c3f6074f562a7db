"""Cache loading: one interface for every cache tier and the fall-through over them (tier.py); the generator's device
hot tier (and the key sketch it reports for replica dispatch); the loader (host-memory LRU over the store's shards)
and the `KVSource` a generator reads it through, a hop away or in-process (source.py); the lazily compiled tier and
its pending entries; each chunk's source for recompute; and the wire codec that moves KV between deployments."""

from pipeline.facade import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "chunk_sources": ["recompute_inputs"],
    "hot_tier": ["HotTier", "HotTierReport", "KeySketch", "key_hash"],
    "lazy_tier": ["LazyTier"],
    "loader": ["CacheLoader", "HostTier", "StoreTier", "store_row"],
    "pending": ["PendingPlanner", "is_pending", "lazy_planner"],
    "source": ["GivenKV", "KVSource", "LoaderDeployment", "LocalLoader"],
    "tier": ["KVTier", "TierRead", "fall_through"],
    "wire": ["from_wire", "kv_tensor", "to_wire"],
})
