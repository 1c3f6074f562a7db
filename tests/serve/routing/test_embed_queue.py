"""serve/routing/embed_queue.py: one tenant's bulk /v1/embeddings request delays another's route by at most one
batch. The embedder here records the order of its calls and holds the first until told (no timing): a query that
arrives while a bulk request's first batch runs is embedded next, before the rest of the bulk request; two bulk
requests take turns; a bulk request cancelled mid-way queues nothing more."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from serve.routing.embed_queue import EmbedQueue, Priority


class HeldEmbedder:
    """Each text's vector is [len(text)]; the first call waits for `release`."""

    def __init__(self):
        self.calls: list[list[str]] = []
        self.first_running, self.release = threading.Event(), threading.Event()

    def __call__(self, texts: list[str]) -> np.ndarray:
        self.calls.append(list(texts))
        if len(self.calls) == 1:
            self.first_running.set()
            assert self.release.wait(30)
        return np.array([[float(len(t))] for t in texts], dtype=np.float32)


async def wait_for(event: threading.Event) -> None:
    assert await asyncio.to_thread(event.wait, 30)


def test_a_query_waits_for_one_batch_of_a_bulk_request_not_all_of_it():
    async def scenario():
        embedder = HeldEmbedder()
        queue = EmbedQueue(embedder, batch_size=2)
        bulk_texts = [f"bulk {i:02d}" for i in range(10)]  # five batches
        bulk = asyncio.ensure_future(queue.embed_texts(bulk_texts, Priority.BULK))
        await wait_for(embedder.first_running)
        query = asyncio.ensure_future(queue.embed_texts(["the question?"], Priority.QUERY))
        await asyncio.sleep(0.05)  # the query is queued while the first batch runs
        embedder.release.set()
        vectors, answer = await bulk, await query
        return embedder.calls, vectors, answer

    calls, vectors, answer = asyncio.run(scenario())
    assert calls[0] == ["bulk 00", "bulk 01"] and calls[1] == ["the question?"]  # next, not sixth
    assert [len(c) for c in calls[2:]] == [2, 2, 2, 2]
    assert vectors.shape == (10, 1) and vectors[:, 0].tolist() == [7.0] * 10  # in order, whole
    assert answer[0, 0] == len("the question?")


def test_two_bulk_requests_take_turns_a_batch_at_a_time():
    async def scenario():
        embedder = HeldEmbedder()
        queue = EmbedQueue(embedder, batch_size=1)
        first = asyncio.ensure_future(queue.embed_texts(["a1", "a2", "a3"], Priority.BULK))
        await wait_for(embedder.first_running)
        second = asyncio.ensure_future(queue.embed_texts(["b1", "b2", "b3"], Priority.BULK))
        await asyncio.sleep(0.05)
        embedder.release.set()
        await asyncio.gather(first, second)
        return [c[0] for c in embedder.calls]

    assert asyncio.run(scenario()) == ["a1", "b1", "a2", "b2", "a3", "b3"]


def test_a_cancelled_bulk_request_queues_nothing_more_and_errors_reach_their_request():
    async def scenario():
        embedder = HeldEmbedder()
        queue = EmbedQueue(embedder, batch_size=1)
        bulk = asyncio.ensure_future(queue.embed_texts(["x1", "x2", "x3"], Priority.BULK))
        await wait_for(embedder.first_running)
        bulk.cancel()
        embedder.release.set()
        with pytest.raises(asyncio.CancelledError):
            await bulk
        await queue.embed_texts(["after"], Priority.QUERY)
        broken = EmbedQueue(lambda texts: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            await broken.embed_texts(["q"], Priority.QUERY)
        return [c[0] for c in embedder.calls]

    assert asyncio.run(scenario()) == ["x1", "after"]


def test_with_a_bulk_embedder_a_query_never_waits_for_a_bulk_batch_and_bulk_runs_at_low_priority():
    """The router's wiring (`bulk=Embedder.on_one_thread().embed`): bulk batches run on a thread of their own,
    BULK_NICE nicer than the query thread. A bulk batch that never ends (held) does not hold a query back; without
    `bulk` (the control) the query waits behind it. Niceness is read by each embedder from its own thread."""
    import os

    from serve.routing.embed_queue import BULK_NICE

    def nice_here() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    async def scenario(separate: bool):
        bulk, niceness = HeldEmbedder(), {}

        def query(texts: list[str]) -> np.ndarray:
            niceness["query"] = nice_here()
            return np.ones((len(texts), 1), dtype=np.float32)

        def held_bulk(texts: list[str]) -> np.ndarray:
            niceness["bulk"] = nice_here()
            return bulk(texts)

        queue = EmbedQueue(query, batch_size=2, bulk=held_bulk) if separate else EmbedQueue(held_bulk, batch_size=2)
        pending = asyncio.ensure_future(queue.embed_texts([f"bulk {i}" for i in range(6)], Priority.BULK))
        await wait_for(bulk.first_running)
        try:
            answered = await asyncio.wait_for(queue.embed_texts(["the question?"], Priority.QUERY), 2)
        except TimeoutError:
            answered = None
        bulk.release.set()
        await pending
        return answered, niceness

    answered, niceness = asyncio.run(scenario(separate=True))
    assert answered is not None and answered.shape == (1, 1)  # while the bulk batch was still held
    if niceness["bulk"] == niceness["query"] and os.name == "posix":  # setpriority refused here: nothing to compare
        pytest.skip("this system refused to lower a thread's priority")
    assert niceness["bulk"] == min(19, niceness["query"] + BULK_NICE)
    assert asyncio.run(scenario(separate=False))[0] is None  # the control: one thread, the query waits


def test_close_finishes_the_batch_in_progress_cancels_the_queued_and_joins_the_threads():
    """A 2,048-input request still embedding when its server stopped left a thread inside the ONNX runtime at
    interpreter exit, which aborted the process ("terminate called without an active exception"). `close` lets the
    batch in progress finish, cancels what is queued and joins every thread. Control: before `close` the threads are
    alive, and a put after it is refused."""
    async def scenario():
        bulk = HeldEmbedder()
        queue = EmbedQueue(lambda texts: np.ones((len(texts), 1), dtype=np.float32), batch_size=2, bulk=bulk)
        in_progress = asyncio.ensure_future(queue._one(["a", "b"], Priority.BULK))
        await wait_for(bulk.first_running)
        queued = queue._one(["c", "d"], Priority.BULK)
        threads = [worker.thread for worker in queue._workers.values()]
        assert all(thread.is_alive() for thread in threads)  # the control
        closing = asyncio.ensure_future(asyncio.to_thread(queue.close, 30))
        await asyncio.sleep(0.05)
        bulk.release.set()
        await closing
        assert not any(thread.is_alive() for thread in threads)
        assert (await in_progress).shape == (2, 1)  # the batch in progress finished
        await asyncio.sleep(0)
        assert queued.cancelled() and bulk.calls == [["a", "b"]]  # the queued one never ran
        with pytest.raises(RuntimeError, match="closed"):
            queue._one(["e"], Priority.QUERY)

    asyncio.run(scenario())


def test_a_batch_whose_asker_s_loop_closed_does_not_end_the_worker():
    """A route refused mid-way (its prompt longer than the context) leaves its question's embedding running, and
    the loop that asked may close before it ends (a test's `asyncio.run`): settling it there raised RuntimeError in
    the worker thread, which died, and every later embedding hung (a 504 after 300 s). Control: the next request on
    a new loop is answered."""
    embedder = HeldEmbedder()
    queue = EmbedQueue(embedder, batch_size=2)

    async def ask_and_leave():
        asyncio.ensure_future(queue.embed_texts(["held"], Priority.QUERY))
        await wait_for(embedder.first_running)

    asyncio.run(ask_and_leave())  # its loop is closed now; the batch is still held
    embedder.release.set()

    async def next_request():
        return await asyncio.wait_for(queue.embed_texts(["next"], Priority.QUERY), 10)

    assert asyncio.run(next_request()).shape == (1, 1)
    queue.close()


def test_a_conversation_s_history_queries_wait_for_every_route_s_question():
    """A 256-turn history's 8 earlier user messages, queued ahead of another tenant's question, cost that question
    ~190 ms (issue 60, docs/RELIABILITY.md). While a batch runs, a history batch and then a question are queued:
    the question runs first. Mutation: Priority.HISTORY given Priority.QUERY's value → the history runs first."""
    async def scenario() -> list[list[str]]:
        embedder = HeldEmbedder()
        queue = EmbedQueue(embedder, batch_size=8)
        running = asyncio.ensure_future(queue.embed_texts(["a's question"], Priority.QUERY))
        await wait_for(embedder.first_running)
        history = asyncio.ensure_future(queue.embed_texts([f"a's turn {i}" for i in range(8)], Priority.HISTORY))
        await asyncio.sleep(0.01)
        question = asyncio.ensure_future(queue.embed_texts(["b's question"], Priority.QUERY))
        await asyncio.sleep(0.01)
        embedder.release.set()
        await asyncio.gather(running, history, question)
        queue.close()
        return embedder.calls

    calls = asyncio.run(scenario())
    assert calls == [["a's question"], ["b's question"], [f"a's turn {i}" for i in range(8)]]
