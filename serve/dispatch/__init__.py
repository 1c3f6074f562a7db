"""Dispatch: which generator replica a request goes to. A Serve request router (Ray's `RequestRouter`) that sends a
plan to the replica whose device hot tier holds most of its chunks' bytes (and its conversation's prefix), under a
load cap, else Serve's power of two choices (`dispatch: affinity | default`). "Routing" in qvpic is the relevance
router's alone (serve/routing/): which chunks, in which order, at which resolution tier."""

from pipeline.facade import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "affinity": ["AffinityDispatcher", "Decision", "ReplicaRanking", "ReplicaView", "choose"],
})
