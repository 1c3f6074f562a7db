"""The router's embedder behind one queue: a route's query goes before the batches of a bulk request.

`/v1/embeddings` may send 2,048 inputs (about 30 s of a 2-core replica's time), and every chat request's route
embeds its question on the same replica. Run side by side on their own threads they share the cores (and torch's
thread pools thrash), so one tenant's bulk request stalled another tenant's route for up to 21 s
(docs/RELIABILITY.md `fairness`). Here one worker thread runs the embedder: queries first, in arrival order; a bulk
request is cut into batches of `batch_size` texts, each queued only when the one before it is done, so a query
waits for at most one batch, and two bulk requests take turns a batch at a time.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import itertools
import logging
import threading
from collections.abc import Callable, Sequence

import numpy as np

from pipeline.priority import BULK_NICE, lower_priority

log = logging.getLogger(__name__)


class Priority(enum.IntEnum):
    QUERY = 0  # a route's question (or a batch of them): small, on a request's critical path
    HISTORY = 1  # a conversation's earlier user messages: after every route's question (issue 60: a 256-turn
    # history's 8 queries, ahead of another tenant's question on the query thread, cost that question ~190 ms)
    BULK = 2  # /v1/embeddings: one batch of a client's inputs


class EmbedQueue:
    """`embed` runs the queries on one thread. With `bulk` (an embedder whose forward runs on its calling thread:
    `Embedder.on_one_thread`), bulk batches run on a thread of their own, of lower CPU priority (`BULK_NICE`): a
    query no longer waits for the bulk batch in progress (a 64-text batch took ~1.2 s here: b's TTFT p99 beside a
    2,048-input request was 1,210 ms against 28 alone, issue 60), and the kernel gives the cores to interactive work
    first — the query's forward, and the generator's in this process or another of the node (Ray's workers share
    their raylet's session, hence its autogroup, where niceness applies). Without `bulk`, both share one thread,
    queries first."""

    def __init__(self, embed: Callable[[list[str]], np.ndarray], batch_size: int = 64,
                 bulk: Callable[[list[str]], np.ndarray] | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.embed, self.batch_size = embed, batch_size
        query = _Worker(embed, "qvpic-embed-query")
        self._workers = {Priority.QUERY: query, Priority.HISTORY: query,
                         Priority.BULK: query if bulk is None else _Worker(bulk, "qvpic-embed-bulk", BULK_NICE)}

    async def embed_texts(self, texts: Sequence[str], priority: Priority) -> np.ndarray:
        """float32 [len(texts), dim], as `embed` gives it; a bulk request one batch at a time."""
        texts = list(texts)
        if priority is not Priority.BULK or len(texts) <= self.batch_size:
            return await self._one(texts, priority)
        parts = [await self._one(texts[i:i + self.batch_size], priority)  # cancelled: the rest is never queued
                 for i in range(0, len(texts), self.batch_size)]
        return np.concatenate(parts)

    def _one(self, texts: list[str], priority: Priority) -> asyncio.Future:
        return self._workers[priority].put(texts, priority)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the worker threads: queued batches are cancelled, a batch in progress finishes, and each thread is
        joined. A thread left inside the ONNX runtime when the interpreter exits aborts the process ("terminate
        called without an active exception": a 2,048-input request still embedding when its server stops)."""
        for worker in set(self._workers.values()):
            worker.close(timeout_s)


class _Worker:
    """One thread running `embed` over its queue: the lowest `Priority` first, FIFO within one."""

    def __init__(self, embed: Callable[[list[str]], np.ndarray], name: str, nice: int = 0):
        self.embed, self.nice = embed, nice
        self._heap: list[tuple[int, int, list[str], asyncio.Future, asyncio.AbstractEventLoop]] = []
        self._order = itertools.count()  # FIFO within a priority
        self._work = threading.Condition()
        self._closed = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def put(self, texts: list[str], priority: Priority) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._work:
            if self._closed:
                raise RuntimeError("the embedder's queue is closed")
            heapq.heappush(self._heap, (int(priority), next(self._order), texts, future, loop))
            self._work.notify()
        return future

    def _run(self) -> None:
        if self.nice:
            lower_priority(self.nice)
        while True:
            with self._work:
                while not self._heap and not self._closed:
                    self._work.wait()
                if self._closed:
                    return
                _, _, texts, future, loop = heapq.heappop(self._heap)
            if future.cancelled():  # its request went away while it waited
                continue
            try:
                result, error = self.embed(texts), None
            except Exception as raised:  # noqa: BLE001  handed to the request that asked
                result, error = None, raised
            try:
                loop.call_soon_threadsafe(settle, future, result, error)
            except RuntimeError:  # its loop closed meanwhile (the request gone with it): nobody awaits this, and the
                pass  # thread must live on for the next one (it died here, and every later embedding hung)


    def close(self, timeout_s: float) -> None:
        with self._work:
            self._closed, queued, self._heap = True, self._heap, []
            self._work.notify()
        for _, _, _, future, loop in queued:
            if not loop.is_closed():
                loop.call_soon_threadsafe(future.cancel)
        self.thread.join(timeout_s)


def settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
