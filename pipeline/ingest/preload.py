"""Loading a stage's model while the job's first phases run, instead of on the stage's first batch.

Ray Data starts every actor pool when the job starts, but a unit reaches the embed and compile actors only
after the read, the chunking and two shuffles. A model loaded lazily on the first batch put its load
(MiniLM ~10 s, the VLM ~5 s on a 2-core box) after all of that, on the critical path of every ingest;
loaded on a thread from the actor's constructor it overlaps them. A failed load is raised by `get`, on the
first batch that needs the model, as a lazy load would have raised it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Preload(Generic[T]):
    """`factory()` run once on a daemon thread named `name`, from construction; `get()` waits for it."""

    def __init__(self, name: str, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._value: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._value = self._factory()
        except BaseException as error:  # noqa: BLE001  re-raised by get(), in the caller's thread
            self._error = error

    def get(self) -> T:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value
