"""qvpic's own engine, the first implementation of the engine seam (serve/engine/interface.py): one thread owns
the model and runs every request's forward passes as one batch over a KV slab.

    engine.py         the step: retire → admit (prefill the joining rows) → decode; `QvpicEngine`
    scheduler.py      admission under the batch's caps (rows, KV bytes, prefill tokens per step)
    batch.py          the slab (every row's KV, padded to the widest) and the batched prefill and decode forwards
    linked_prompt.py  a linked prompt resumed from the prefix cache: what is left to link and prefill
    prefix_cache.py   block-hashed prompt KV keyed by the linked chunks before each block and the tenant's salt
    slab_memory.py    on a CPU, memory of finished slabs reused for the next ones
    sampler.py        each row's next token under its request's decoding controls
    grammar.py        llguidance's constrained decoding (structured outputs, forced tool calls)

The model runtime it drives (forward, re-anchoring, selective recompute) is pipeline/runtime/, shared with ingest.
"""

from pipeline.facade import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "batch": ["Slab", "decode_step", "prefill_alone", "prefill_queries"],
    "engine": ["QvpicEngine", "column_nbytes"],
    "linked_prompt": ["Resumed", "native_prompt", "resume", "store"],
    "prefix_cache": ["PrefixCache"],
    "slab_memory": ["SLAB_MEMORY", "SlabMemory"],
})
