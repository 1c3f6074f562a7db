"""Test-only perturbations of a served system, installed in every Ray worker process of a deploy through Ray's
`runtime_env.worker_process_setup_hook` (tests/cluster/test_cluster.py): product code has no hook for them."""

from __future__ import annotations


def swap_first_two_chunk_slots() -> None:
    """Link each request's first two chunks in each other's position slots (as if their order were reversed)
    while their KV columns stay in the reported order: a wrong chunk placement, nothing else changed."""
    from pipeline.runtime import kv

    placed = kv.chunk_starts

    def swapped(prefix_span, chunks):
        starts = placed(prefix_span, chunks)
        if len(chunks) < 2:
            return starts
        reversed_starts = placed(prefix_span, [chunks[1], chunks[0], *chunks[2:]])
        return [reversed_starts[1], reversed_starts[0], *starts[2:]]

    kv.chunk_starts = swapped
