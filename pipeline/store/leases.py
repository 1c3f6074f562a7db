"""The store's two kinds of lease: one heartbeat mechanism and one way of reading lease records, two protocols.

They stay two because they mean opposite things. The **write lease** (`StoreLease`, `leases/<job_id>.json`)
is exclusive: one writing job (ingest, recompile, `verify --repair`) at a time, and a job that finds
another's live lease refuses to start. The **serving leases** (`LeaseKeeper`, `serving/leases/<holder>.json`,
the `Lease` record of schemas/generation.py) are shared: any number of replicas each pin the generations
they may still read, and garbage collection (pipeline/store/gc.py) only reads them. Their records differ
too (a job's lease says who holds it, so a refusal can name the holder and a dead driver's lease expires
at once; a replica's says until when and which generations), and both formats are part of the store.

Write lease: a job writes its lease, then lists `leases/`. If any other live lease is there it removes
its own and refuses, naming the holder; so two jobs racing for a store can both refuse (each then names
the other) but never both write. A lease is live while its holder heartbeats (every `ttl_s / 4`); one
past `ttl_s`, or one from this host whose process is gone (a killed driver), is stale and removed by
the next job. S3 lists are strongly consistent since 2020, which is what the protocol needs; it needs
no conditional writes.

Serving lease: every generation the replica serves now, or served within `retain_s` (a request planned
against it may still be loading or decoding), renewed every `heartbeat_s` so a dead replica's claim
lapses after `lease_ttl_s`.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timedelta, timezone
from typing import TypeVar

import pyarrow.fs as pafs

from pipeline.store.blobs import Blobs, StoreError
from pipeline.store.store import Store
from schemas.generation import LEASES_DIR, Lease, ReloadSpec

log = logging.getLogger(__name__)
LEASES = "leases"  # the write lease's dir
R = TypeVar("R")


class Heartbeat:
    """Calls `beat` every `interval_s` on a daemon thread named `name`, from `start` until `stop` (which
    waits for a beat in flight, so none lands after it). A beat that raises is logged; the next one
    retries. Both leases renew by one; the generation watcher (pipeline/store/reload.py) polls by one."""

    def __init__(self, name: str, interval_s: float, beat: Callable[[], object]) -> None:
        self.interval_s, self.beat = interval_s, beat
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
            except Exception as error:  # noqa: BLE001  a store hiccup must not kill the heartbeat
                # one line per failed beat (a store that went away fails every interval); the traceback at debug
                log.warning("%s failed: %s: %s", self._thread.name, type(error).__name__, error,
                            exc_info=log.isEnabledFor(logging.DEBUG))

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()


def lease_records(blobs: Blobs, directory: str, parse: Callable[[bytes], R]
                  ) -> Iterator[tuple[pafs.FileInfo, R | None]]:
    """Every `.json` lease in `directory` with its parsed record (None: torn or foreign); one released
    while this reads is skipped."""
    for info in blobs.list(directory):
        if not info.base_name.endswith(".json"):
            continue
        try:
            data = blobs.get(f"{directory}/{info.base_name}")
        except FileNotFoundError:
            continue
        try:
            yield info, parse(data)
        except (ValueError, TypeError):
            yield info, None


# ---- the write lease: one writing job ------------------------------------------------------------
class StoreBusyError(StoreError):
    """Another job holds the store's write lease."""


@dataclass(frozen=True)
class LeaseInfo:
    job_id: str
    host: str
    pid: int
    started_at: float
    heartbeat_at: float
    ttl_s: float

    def stale(self, now: float) -> bool:
        if now - self.heartbeat_at > self.ttl_s:
            return True
        if self.host == socket.gethostname():
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return True  # its driver died on this host: nothing will ever release it
            except PermissionError:
                pass  # someone else's live process
        return False

    def describe(self, now: float) -> str:
        return (f"job {self.job_id} (pid {self.pid} on {self.host}, started {now - self.started_at:.0f} s ago, "
                f"last heartbeat {now - self.heartbeat_at:.0f} s ago)")


class StoreLease:
    """`with StoreLease(blobs, job_id):` — held for the block, released at its end (even on error)."""

    def __init__(self, blobs: Blobs, job_id: str, ttl_s: float = 120.0) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.blobs, self.job_id, self.ttl_s = blobs, job_id, ttl_s
        now = time.time()
        self.info = LeaseInfo(job_id, socket.gethostname(), os.getpid(), now, now, ttl_s)
        self.heartbeat = Heartbeat(f"renewing lease {job_id}", ttl_s / 4, self._beat)

    @property
    def rel(self) -> str:
        return f"{LEASES}/{self.job_id}.json"

    def _write(self) -> None:
        self.blobs.put_json(self.rel, asdict(self.info))

    def holders(self) -> list[LeaseInfo]:
        """Live leases other than this one; stale ones are removed on the way."""
        now, live = time.time(), []
        for entry, info in lease_records(self.blobs, LEASES, lambda data: LeaseInfo(**json.loads(data))):
            rel = f"{LEASES}/{entry.base_name}"
            if rel == self.rel:
                continue
            if info is None or info.stale(now):  # a torn or foreign one: stale once old enough
                if info is not None or now - (entry.mtime.timestamp() if entry.mtime else 0) > self.ttl_s:
                    self.blobs.delete(rel)
                continue
            live.append(info)
        return live

    def __enter__(self) -> "StoreLease":
        self._write()
        others = self.holders()
        if others:
            self.blobs.delete(self.rel)
            now = time.time()
            raise StoreBusyError(f"store {self.blobs.uri} is being written by "
                                 + "; ".join(o.describe(now) for o in others)
                                 + f". Job {self.job_id} did not start: rerun it once that job has finished "
                                 "(a rerun skips everything already in the store).")
        self.heartbeat.start()
        return self

    def _beat(self) -> None:
        self.info = replace(self.info, heartbeat_at=time.time())
        try:
            self._write()
        except OSError:
            pass  # a missed beat; the next one retries, and `ttl_s` allows for three

    def __exit__(self, *exc: object) -> None:
        self.heartbeat.stop()
        self.blobs.delete(self.rel)


# ---- serving leases: the generations each replica may still read ---------------------------------
def write_lease(store: Store, lease: Lease) -> None:
    store.blobs.put(f"{LEASES_DIR}/{lease.holder}.json", lease.model_dump_json().encode())


def read_leases(store: Store) -> list[Lease]:
    """Every readable serving lease, expired ones included (a torn one is no claim)."""
    return [lease for _, lease in lease_records(store.blobs, LEASES_DIR, Lease.model_validate_json)
            if lease is not None]


def drop_expired_leases(store: Store, now: datetime | None = None) -> None:
    now = now or datetime.now(timezone.utc)
    for info, lease in lease_records(store.blobs, LEASES_DIR, Lease.model_validate_json):
        if lease is not None and not lease.live(now):
            store.blobs.delete(f"{LEASES_DIR}/{info.base_name}")


class LeaseKeeper:
    """This replica's serving lease; thread-safe. `hold` pins a generation until `release` (+ `retain_s`);
    `touch` pins it for `retain_s` from now."""

    def __init__(self, store: Store, role: str, spec: ReloadSpec):
        self.store, self.spec = store, spec
        self.holder = f"{role}-{uuid.uuid4().hex[:16]}"
        self._until: dict[int, float] = {}  # generation -> monotonic deadline (inf while held)
        self._written: tuple[int, ...] = ()
        self.failing = False  # the last write of the lease failed
        self._closed = False
        self._lock = threading.Lock()
        self.heartbeat = Heartbeat(f"renewing lease {self.holder}", spec.heartbeat_s, self.renew)
        self.heartbeat.start()

    def hold(self, generation: int) -> None:
        self._set(generation, float("inf"))

    def release(self, generation: int) -> None:
        self._set(generation, time.monotonic() + self.spec.retain_s)

    def touch(self, generation: int) -> None:
        with self._lock:
            current = self._until.get(generation, 0.0)
        if current != float("inf"):
            self._set(generation, max(current, time.monotonic() + self.spec.retain_s))

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

    def close(self) -> None:
        """Stop renewing and drop the lease (a replica shutting down serves nothing more). Once: an owner's
        explicit close and its `__del__` both call it. A store that cannot be reached then leaves the lease to
        lapse after `lease_ttl_s`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.heartbeat.stop()
        try:
            self.store.blobs.delete(f"{LEASES_DIR}/{self.holder}.json")
        except OSError as error:
            log.warning("could not drop lease %s (%s): it lapses after %g s", self.holder, error,
                        self.spec.lease_ttl_s)
