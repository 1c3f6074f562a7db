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
import threading
from collections.abc import Callable, Sequence

import numpy as np


class Priority(enum.IntEnum):
    QUERY = 0  # a route's question (or a batch of them): small, on a request's critical path
    BULK = 1  # /v1/embeddings: one batch of a client's inputs


class EmbedQueue:
    def __init__(self, embed: Callable[[list[str]], np.ndarray], batch_size: int = 64):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.embed, self.batch_size = embed, batch_size
        self._heap: list[tuple[int, int, list[str], asyncio.Future, asyncio.AbstractEventLoop]] = []
        self._order = itertools.count()  # FIFO within a priority
        self._work = threading.Condition()
        threading.Thread(target=self._run, name="qvpic-embedder", daemon=True).start()

    async def embed_texts(self, texts: Sequence[str], priority: Priority) -> np.ndarray:
        """float32 [len(texts), dim], as `embed` gives it; a bulk request one batch at a time."""
        texts = list(texts)
        if priority is Priority.QUERY or len(texts) <= self.batch_size:
            return await self._one(texts, priority)
        parts = [await self._one(texts[i:i + self.batch_size], priority)  # cancelled: the rest is never queued
                 for i in range(0, len(texts), self.batch_size)]
        return np.concatenate(parts)

    def _one(self, texts: list[str], priority: Priority) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._work:
            heapq.heappush(self._heap, (int(priority), next(self._order), texts, future, loop))
            self._work.notify()
        return future

    def _run(self) -> None:
        while True:
            with self._work:
                while not self._heap:
                    self._work.wait()
                _, _, texts, future, loop = heapq.heappop(self._heap)
            if future.cancelled():  # its request went away while it waited
                continue
            try:
                result, error = self.embed(texts), None
            except Exception as raised:  # noqa: BLE001  handed to the request that asked
                result, error = None, raised
            loop.call_soon_threadsafe(settle, future, result, error)


def settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
