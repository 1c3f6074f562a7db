"""An executor whose queue is served one key at a time, round robin (`FairExecutor`): the router's framing queue.

A ThreadPoolExecutor serves its queue first come, first served: a tenant that keeps several large conversations queued
for the framing process (up to its `max_in_flight`) would have another tenant's large conversation wait for all of
them. Here each key (the tenant) has its own queue, and a free worker takes the oldest call of the key served least
recently (a key never served, or forgotten, first): the other tenant waits for the calls running, not for every call
queued ahead of it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any

REMEMBERED_KEYS = 4_096  # keys whose last turn is kept; one forgotten is served as a new key


class FairExecutor:
    """`workers` threads, each running calls until `shutdown`; calls queued per key, the keys taken in turn."""

    def __init__(self, workers: int, name: str):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        # key -> its queued (future, fn, args), oldest first; keys in order of arrival
        self._queues: dict[Hashable, deque[tuple[Future, Callable[..., Any], tuple]]] = {}
        self._served: OrderedDict[Hashable, None] = OrderedDict()  # keys by their last turn, least recent first
        self._ready = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True) for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, key: Hashable, fn: Callable[..., Any], *args: Any) -> Future:
        """`fn(*args)` queued under `key`; its future. Cancelled while queued, it never runs."""
        future: Future = Future()
        with self._ready:
            if self._closed:
                raise RuntimeError("the executor is shut down")
            self._queues.setdefault(key, deque()).append((future, fn, args))
            self._ready.notify()
        return future

    def shutdown(self) -> None:
        """No more calls; every queued one cancelled. A call running finishes on its thread."""
        with self._ready:
            self._closed = True
            queued = [future for queue in self._queues.values() for future, _, _ in queue]
            self._queues.clear()
            self._ready.notify_all()
        for future in queued:
            future.cancel()

    def _next(self) -> tuple[Future, Callable[..., Any], tuple] | None:
        with self._ready:
            while not self._queues and not self._closed:
                self._ready.wait()
            if self._closed:
                return None
            key = next((k for k in self._queues if k not in self._served), None)  # a new key's first call
            if key is None:
                key = next(k for k in self._served if k in self._queues)  # else the least recently served
            queue = self._queues[key]
            call = queue.popleft()
            if not queue:
                del self._queues[key]
            self._served[key] = None
            self._served.move_to_end(key)
            if len(self._served) > REMEMBERED_KEYS:
                self._served.popitem(last=False)
            return call

    def _work(self) -> None:
        while (call := self._next()) is not None:
            future, fn, args = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as error:  # noqa: BLE001 — the caller's, through the future
                future.set_exception(error)
