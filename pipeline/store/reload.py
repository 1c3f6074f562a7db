"""Hot reload: a serving replica follows the store's current generation, under its serving lease
(`LeaseKeeper`, pipeline/store/leases.py).

`GenerationWatcher` polls serving/current.json; on a new generation it leases it first, re-reads the
pointer (see pipeline/store/gc.py for why that order makes collection safe), opens it off the
request path and hands it to `on_switch`, which swaps one reference: a request uses the snapshot it
started with from start to end, so none fails or mixes two generations.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from pipeline.store.generations import current_generation_number
from pipeline.store.leases import Heartbeat, LeaseKeeper
from pipeline.store.store import Store
from schemas.generation import ReloadSpec
from schemas.store import ManifestError

log = logging.getLogger(__name__)


def acquire_current(store: Store, keeper: LeaseKeeper) -> int:
    """The store's current generation, leased by `keeper` before the caller reads any of it."""
    while True:
        number = current_generation_number(store)
        if number is None:
            raise FileNotFoundError(f"store {store.uri} has no published serving generation")
        keeper.hold(number)
        if current_generation_number(store) == number:
            return number
        keeper.release(number)  # published over meanwhile: lease the newer one


class GenerationWatcher:
    """Polls the store's current generation; `open_generation(n)` builds what serving needs (off the
    request path), `on_switch(n, opened)` installs it. The current one is held by `keeper`."""

    def __init__(self, store: Store, keeper: LeaseKeeper, spec: ReloadSpec, current: int,
                 open_generation: Callable[[int], Any], on_switch: Callable[[int, Any], None]):
        self.store, self.keeper, self.spec = store, keeper, spec
        self.current = current
        self.open_generation, self.on_switch = open_generation, on_switch
        self.refused: dict[int, str] = {}  # generations this replica cannot serve, and why
        self.last_switch_s: float | None = None  # publish -> serving, of the last switch
        self._lock = threading.Lock()
        self.poller = Heartbeat("polling the store's current generation", spec.poll_s, self.check)
        if spec.enabled:
            self.poller.start()

    def check(self) -> bool:
        """Switch now if the store has a newer servable generation; True when a switch happened."""
        with self._lock:  # one switch at a time (the poller and an explicit call may race)
            number = current_generation_number(self.store)
            if number is None or number == self.current or number in self.refused:
                return False
            self.keeper.hold(number)
            if current_generation_number(self.store) != number:  # moved on meanwhile: take the newer one next
                self.keeper.release(number)
                return False
            try:
                opened = self.open_generation(number)
            except ManifestError as error:  # another model or embedder: keep serving what works; say why, once
                self.keeper.release(number)
                self.refused[number] = str(error)
                log.error("not switching to generation %d: %s", number, error)
                return False
            except Exception:  # a store hiccup mid-open: the next poll tries again
                self.keeper.release(number)
                raise
            previous, self.current = self.current, number
            self.on_switch(number, opened)
            self.keeper.release(previous)
            published = getattr(opened, "published_at", None)
            if published is not None:
                self.last_switch_s = (datetime.now(timezone.utc) - published).total_seconds()
            log.info("switched from generation %d to %d", previous, number)
            return True

    def close(self) -> None:
        self.poller.stop()
