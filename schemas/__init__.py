"""Data contracts only: nothing here imports the rest of qvpic, torch or Ray. Import a contract from the
module that states it — each module is one kind of contract:

    frozen.py      the frozen, validated base every spec builds on
    modes.py       chunk kinds, compile prefixes, variants, modes and their shapes, chunk order
    render.py      resolution tiers and the page layout chunks are rendered with
    config.py      model, router, hybrid, recompute, engine (forward, prefix cache) and image-URL specs
    corpus.py      documents, chunks, chunk keys, rejection reasons
    store.py       the manifest, cache keys, shard entries, store statistics
    tables.py      Arrow schemas of the index, chunk and quarantine tables and their row rules
    generation.py  serving generations, leases, search and reload specs
    api.py         the native HTTP API's requests
    report.py      what it answers: an answer's report, estimates, stream events
    service.py     the service's own routes: liveness, the store's status
    chat.py        the OpenAI-compatible models
    errors.py      API errors and their HTTP status
    health.py      readiness
    sampling.py    sampling parameters
    wire.py        what crosses between deployments
"""
