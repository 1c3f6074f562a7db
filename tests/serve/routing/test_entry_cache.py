"""The router keeps each chunk's entries made, per snapshot (serve/routing/retrieval.py `EntryCache`): a
conversation's follow-up places its earlier questions' chunks again without reading the index. Expected plans
come from the same router with nothing kept (the control)."""

from __future__ import annotations

import asyncio

from schemas.api import AnswerRequest
from schemas.conversation import Message
from serve.routing.retrieval import EntryCache, Snapshot
from tests.support.store_factory import roles, serving_store  # noqa: F401  (fixtures)


def follow_up() -> AnswerRequest:
    messages = [Message(role="user", content="When does part XK-4471-B ship?"),
                Message(role="assistant", content="In March."),
                Message(role="user", content="How is the soup seasoned?")]
    return AnswerRequest(query="How is the soup seasoned?", messages=messages, top_k=2, history_chunks=True)


def test_a_follow_up_places_its_chunks_from_the_kept_entries(roles, monkeypatch):
    router = roles.router
    snapshot = router.snapshot
    reads: list[list[int]] = []
    entries_of = snapshot.catalog.entries_of

    def counted(rows):
        reads.append(list(rows))
        return entries_of(rows)

    monkeypatch.setattr(snapshot.catalog, "entries_of", counted)
    with snapshot.using(EntryCache(0)):  # the control: nothing kept, every group reads the index
        expected = asyncio.run(router.plan(follow_up()))
        again = asyncio.run(router.plan(follow_up()))
    assert len(reads) == 4 and again.chunks == expected.chunks
    assert {c.group for c in expected.chunks} == {0, 1} and len(expected.chunks) == 4
    reads.clear()
    with snapshot.using(EntryCache()) as cache:
        first = asyncio.run(router.plan(follow_up()))
        assert len(reads) == 2 and cache.loads == 2  # one read per group
        second = asyncio.run(router.plan(follow_up()))
        assert len(reads) == 2  # nothing read again
    assert first.chunks == second.chunks == expected.chunks  # the same entries, tiers and groups


def test_kept_entries_are_bounded_and_the_least_recently_used_go_first():
    loaded: list[list[int]] = []

    def load(rows):
        loaded.append(list(rows))
        return [{("low", row): {"row": row}} for row in rows]

    cache = EntryCache(max_rows=2)
    first = cache.get([1, 2], load)
    assert [e.rows for e in first] == [{("low", 1): {"row": 1}}, {("low", 2): {"row": 2}}]
    assert cache.get([2, 1, 2], load)[1] is first[0] and loaded == [[1, 2]]  # kept, the same objects
    cache.get([3], load)  # 2 was used before 1: it goes
    assert loaded == [[1, 2], [3]]
    cache.get([1, 3], load)
    assert loaded == [[1, 2], [3]]
    cache.get([2], load)
    assert loaded == [[1, 2], [3], [2]] and len(cache._rows) == 2


def test_each_snapshot_keeps_its_own(roles):
    snapshot = roles.router.snapshot
    other = Snapshot(snapshot.record, snapshot.catalog)  # as a reload opens the next generation
    assert other.entry_cache is not snapshot.entry_cache and not other.entry_cache._rows
