"""The store's write lease: one writing job (ingest, recompile) at a time, on any filesystem.

A job writes `leases/<job_id>.json` (holder, host, pid, heartbeat), then lists `leases/`. If any other
live lease is there it removes its own and refuses, naming the holder; so two jobs racing for a store
can both refuse (each then names the other) but never both write. A lease is live while its holder
heartbeats (every `ttl_s / 4`); one past `ttl_s`, or one from this host whose process is gone (a killed
driver), is stale and removed by the next job. S3 lists are strongly consistent since 2020, which is
what the protocol needs; it needs no conditional writes.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass

from pipeline.store.blobs import Blobs, StoreError

LEASES = "leases"


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
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name=f"lease-{job_id}", daemon=True)

    @property
    def rel(self) -> str:
        return f"{LEASES}/{self.job_id}.json"

    def _write(self) -> None:
        self.blobs.put(self.rel, json.dumps(asdict(self.info)).encode())

    def holders(self) -> list[LeaseInfo]:
        """Live leases other than this one; stale ones are removed on the way."""
        now, live = time.time(), []
        for entry in self.blobs.list(LEASES):
            rel = f"{LEASES}/{entry.base_name}"
            if rel == self.rel or not entry.base_name.endswith(".json"):
                continue
            try:
                info = LeaseInfo(**json.loads(self.blobs.get(rel)))
            except FileNotFoundError:
                continue  # released while we looked
            except (ValueError, TypeError):
                info = None  # torn or foreign: treat as stale once old enough
            if info is None or info.stale(now):
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
        self._thread.start()
        return self

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            self.info = LeaseInfo(**{**asdict(self.info), "heartbeat_at": time.time()})
            try:
                self._write()
            except OSError:
                pass  # a missed beat; the next one retries, and `ttl_s` allows for three

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.blobs.delete(self.rel)
