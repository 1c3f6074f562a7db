"""The generator and the engines behind it.

    interface.py   the engine seam: `Engine` (add, abort, stats) and its contract, `EngineStats`
    prepared.py    what a request puts in context, as an engine takes it: `LinkedContext`, `OnlineContext`
    sequence.py    one request inside an engine: what it asked for, what it produced, how it ended
    generator.py   the Serve deployment: a request's context built (context.py), handed to its engine, streamed
    context.py     a plan's context: chunk KV through the tiers (serve/kv/), or the chunks' source online
    repair.py      unreadable or lazily compiled entries rebuilt by the generator's model
    report.py      the answer report; detokenizer.py, stops.py: the answer's text as it decodes
    qvpic/         qvpic's own engine, the first `Engine`
"""

from pipeline.facade import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "detokenizer": ["Detokenizer"],
    "generator": ["Generator"],
    "interface": ["Engine", "EngineStats", "PrefixCacheStats"],
    "prepared": ["LinkedContext", "LinkedPrompt", "OnlineContext", "PreparedContext"],
    "sequence": ["End", "Finished", "Sequence", "Status"],
})
