"""qvpic's offline path and the model runtime both paths share.

    runtime/   the VLM (load, compile, re-anchor, assemble, forward, recompute), renderer, token estimator,
               embedder, OCR
    store/     the KV store: blob I/O, part log, shards, entries, generations; catalog/, check/
    ingest/    the Ray Data jobs (ingest, recompile) and their stages/
    eval/      LongBench and synthetic QA, fidelity, legibility, the paper grid, reports
    facade.py  how each package's `__init__` exports its names (lazily)
    priority.py  the CPU priority of work whose size a client chooses (os calls only: the ingress uses it too)

Imports run one way: `schemas` ← `runtime` ← `store` ← `ingest`, `eval` (tests/project/test_layering.py).
"""
