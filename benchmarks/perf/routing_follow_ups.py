"""A conversation's follow-ups through `Router.route` (benchmarks/perf/routing.py's second part): each turn places
every earlier question's chunks again (`history_chunks`) and frames the whole conversation, so the route grows
with the turns. Two configurations, interleaved conversation by conversation in one process, on one thread (a
router replica's): as served — the tokenizer's backend copied per setting (pipeline/runtime/text_encoder.py) and
each chunk's entries kept per snapshot (serve/routing/retrieval.py `EntryCache`) — and as before them:
transformers' tokenizer call per piece (under a lock, as that code had it) and the entries made anew per request.
The query vectors are embedded beforehand (that part is the first table's), so this is the route after embedding.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time

import numpy as np

TURNS = 4
REPLY = "The passage says the committee approved the budget after a long debate about roads and schools."


@contextlib.contextmanager
def before_this_change(router):
    """The router as it routed before the copies and the kept entries (restored after)."""
    from pipeline.runtime import text_encoder as encoders
    from serve.routing.retrieval import EntryCache

    snapshot, tokenizer = router.snapshot, router.prompt.tokenizer
    kept_encoder = encoders.text_encoder(tokenizer)
    per_call = encoders.TextEncoder(tokenizer)
    per_call._backends, per_call._lock = None, threading.RLock()
    encoders._ENCODERS[tokenizer] = per_call
    try:
        with snapshot.using(EntryCache(0)):
            yield
    finally:
        encoders._ENCODERS[tokenizer] = kept_encoder


def measure_follow_ups(router, questions: list[str], conversations: int, top_k: int) -> list[list]:
    """Rows of (turn, as served p50 / p90, before p50 / p90, before / served) over `conversations` of 4 turns."""
    from schemas.api import AnswerRequest
    from schemas.conversation import Message

    vectors = dict(zip(questions, router.embedder.embed(questions)))
    times: dict[tuple[str, int], list[float]] = {}
    for c in range(conversations + 1):  # the first: warm-up
        asked = [questions[(c * TURNS + t) % len(questions)] for t in range(TURNS)]
        for name in ("served", "before"):
            with before_this_change(router) if name == "before" else contextlib.nullcontext():
                messages = [Message(role="system", content="Answer from the pages.")]
                for t, question in enumerate(asked):
                    messages.append(Message(role="user", content=question))
                    request = AnswerRequest(query=question, top_k=top_k, mode="qvpic", messages=list(messages),
                                            history_chunks=True)
                    started = time.perf_counter()
                    router.route(request, [vectors[q] for q in asked[:t + 1]])
                    if c:
                        times.setdefault((name, t), []).append((time.perf_counter() - started) * 1e3)
                    messages.append(Message(role="assistant", content=REPLY))
    rows = []
    for t in range(TURNS):
        served, before = times[("served", t)], times[("before", t)]
        rows.append([f"turn {t + 1}", f"{statistics.median(served):.2f} / {np.percentile(served, 90):.2f}",
                     f"{statistics.median(before):.2f} / {np.percentile(before, 90):.2f}",
                     f"{statistics.median(before) / statistics.median(served):.2f}×"])
    return rows


HEADER = ["turn", "as served: route p50 / p90 ms", "before: route p50 / p90 ms", "before / served"]


def describe(conversations: int, top_k: int) -> str:
    return (f"A conversation's follow-ups (`Router.route` after embedding, 1 torch thread; {conversations} "
            f"conversations of {TURNS} turns after a warm-up one, a system prompt and one reply per turn, each "
            f"turn retrieving {top_k} chunks and every earlier question keeping its own): as served, and as before "
            "this change (transformers' tokenizer call per piece, entries made anew per request), interleaved "
            "conversation by conversation:")
