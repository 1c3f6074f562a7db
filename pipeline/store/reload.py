"""Hot reload: a serving replica follows the store's current generation and leases what it may still read.

`LeaseKeeper` writes this replica's lease (serving/leases/{holder}.json): every generation the replica
serves now, or served within `retain_s` (a request planned against it may still be loading or
decoding), renewed by a heartbeat so a dead replica's claim lapses after `lease_ttl_s`.

`GenerationWatcher` polls serving/current.json; on a new generation it leases it first, re-reads the
pointer (see pipeline/store/generations.py for why that order makes collection safe), opens it off the
request path and hands it to `on_switch`, which swaps one reference: a request uses the snapshot it
started with from start to end, so none fails or mixes two generations.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from pipeline.store.generations import current_generation_number, drop_lease, write_lease
from pipeline.store.store import Store
from schemas.generation import Lease, ReloadSpec
from schemas.store import ManifestError

log = logging.getLogger(__name__)


class LeaseKeeper:
    """This replica's lease; thread-safe. `hold` pins a generation until `release` (+ `retain_s`);
    `touch` pins it for `retain_s` from now."""

    def __init__(self, store: Store, role: str, spec: ReloadSpec):
        self.store, self.spec = store, spec
        self.holder = f"{role}-{uuid.uuid4().hex[:16]}"
        self._until: dict[int, float] = {}  # generation -> monotonic deadline (inf while held)
        self._written: tuple[int, ...] = ()
        self.failing = False  # the last write of the lease failed
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name=f"lease-{self.holder}", daemon=True)
        self._thread.start()

    def hold(self, generation: int) -> None:
        self._set(generation, float("inf"))

    def release(self, generation: int) -> None:
        self._set(generation, time.monotonic() + self.spec.retain_s)

    def touch(self, generation: int) -> None:
        with self._lock:
            current = self._until.get(generation, 0.0)
        if current != float("inf"):
            self._set(generation, max(current, time.monotonic() + self.spec.retain_s))

    def generations(self) -> tuple[int, ...]:
        now = time.monotonic()
        with self._lock:
            return tuple(sorted(g for g, until in self._until.items() if until > now))

    def _set(self, generation: int, until: float) -> None:
        with self._lock:
            self._until[generation] = until
            new = generation not in self._written
        if new:
            self.renew()  # a generation this lease did not name yet is protected before it is read

    def renew(self) -> None:
        now = time.monotonic()
        with self._lock:
            self._until = {g: u for g, u in self._until.items() if u > now}
            generations = tuple(sorted(self._until))
            self._written = generations
        expires = datetime.now(timezone.utc) + timedelta(seconds=self.spec.lease_ttl_s)
        try:
            write_lease(self.store, Lease(holder=self.holder, generations=generations, expires_at=expires))
            self.failing = False
        except OSError as error:  # e.g. read-only credentials: serve on, unprotected, and say so once
            if not self.failing:
                log.warning("cannot write lease %s (%s): a job's garbage collection may remove generations this "
                            "replica still serves; give replicas write access to serving/leases/", self.holder, error)
            self.failing = True

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.spec.heartbeat_s):
            try:
                self.renew()
            except Exception:  # noqa: BLE001  a store hiccup must not kill the heartbeat; the next beat retries
                log.exception("renewing lease %s failed", self.holder)

    def close(self) -> None:
        """Stop renewing and drop the lease (a replica shutting down serves nothing more)."""
        self._stop.set()
        drop_lease(self.store, self.holder)


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
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="generation-watcher", daemon=True)
        if spec.enabled:
            self._thread.start()

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

    def _poll(self) -> None:
        while not self._stop.wait(self.spec.poll_s):
            try:
                self.check()
            except Exception:  # noqa: BLE001  a store hiccup: try again at the next poll
                log.exception("polling the store's current generation failed")

    def close(self) -> None:
        self._stop.set()
