"""Stored `/v1/responses` answers (`store: true`), keyed by the tenant the server authenticated: a response id is
only ever looked up under its own tenant, so another tenant's GET, DELETE or `previous_response_id` finds nothing
(404), exactly as an id that never existed. Bounded per tenant in count and bytes, in tenants, and in time
(serve/config.py `ResponseStoreConfig`). Two stores behind one interface: `MemoryResponseStore`, one ingress
replica's memory (the default), and `RedisResponseStore` (response_store_redis.py), shared by every replica
through the governance's Redis (`responses.backend: redis`), so a `previous_response_id` or GET that lands on
another replica finds the response.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from serve.config import ResponseStoreConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stored:
    body: dict[str, Any]  # the response object, as GET returns it
    history: list[dict[str, Any]]  # the conversation it ends (chat messages, its answer included), instructions not


def stored_nbytes(body: dict[str, Any], history: list[dict[str, Any]]) -> int:
    """What a response counts against its tenant's byte bound: the response and its conversation, as JSON."""
    return len(json.dumps(body)) + len(json.dumps(history))


def too_large(config: ResponseStoreConfig, tenant: str, response_id: str, nbytes: int) -> bool:
    """A response alone over the tenant's byte bound is not kept (nothing is evicted for it); said in the log."""
    if nbytes <= config.max_bytes_per_tenant:
        return False
    log.warning("response %s of tenant %r not stored: %d bytes, over max_bytes_per_tenant", response_id, tenant,
                nbytes)
    return True


class ResponseStore(Protocol):
    """Async, so that a remote store's round trip never holds the event loop."""

    async def put(self, tenant: str, response_id: str, body: dict[str, Any], history: list[dict[str, Any]]) -> bool:
        """Keep a response; False (not kept, said in the log) when it alone is over the tenant's byte bound or the
        store could not be written: the answer is returned all the same."""

    async def get(self, tenant: str, response_id: str) -> Stored | None:
        """The tenant's response, None when it has none of that id (raises `StoreUnavailableError` when a remote
        store cannot say)."""

    async def delete(self, tenant: str, response_id: str) -> bool: ...


@dataclass
class StoredEntry:
    stored: Stored
    expires_at: float
    nbytes: int


@dataclass
class TenantResponses:
    entries: OrderedDict[str, StoredEntry] = field(default_factory=OrderedDict)  # oldest first
    nbytes: int = 0


class MemoryResponseStore:
    def __init__(self, config: ResponseStoreConfig, clock: Callable[[], float] = time.monotonic):
        self.config, self.clock = config, clock
        self.tenants: OrderedDict[str, TenantResponses] = OrderedDict()  # least recently used first

    async def put(self, tenant: str, response_id: str, body: dict[str, Any], history: list[dict[str, Any]]) -> bool:
        nbytes = stored_nbytes(body, history)
        if too_large(self.config, tenant, response_id, nbytes):
            return False
        mine = self._tenant(tenant, create=True)
        self._expire(mine)
        while mine.entries and (len(mine.entries) >= self.config.max_responses_per_tenant
                                or mine.nbytes + nbytes > self.config.max_bytes_per_tenant):
            self._drop(mine, next(iter(mine.entries)))
        mine.entries[response_id] = StoredEntry(Stored(body, history), self.clock() + self.config.ttl_s, nbytes)
        mine.nbytes += nbytes
        while len(self.tenants) > self.config.max_tenants:
            self.tenants.popitem(last=False)
        return True

    async def get(self, tenant: str, response_id: str) -> Stored | None:
        entry = self._live(tenant, response_id)
        return entry.stored if entry is not None else None

    async def delete(self, tenant: str, response_id: str) -> bool:
        if self._live(tenant, response_id) is None:
            return False
        self._drop(self.tenants[tenant], response_id)
        return True

    def _live(self, tenant: str, response_id: str) -> StoredEntry | None:
        mine = self._tenant(tenant)
        if mine is None:
            return None
        self._expire(mine)
        return mine.entries.get(response_id)

    def _tenant(self, tenant: str, create: bool = False) -> TenantResponses | None:
        mine = self.tenants.get(tenant)
        if mine is None and create:
            mine = self.tenants[tenant] = TenantResponses()
        if mine is not None:
            self.tenants.move_to_end(tenant)
        return mine

    def _expire(self, mine: TenantResponses) -> None:
        now = self.clock()
        for response_id in [i for i, s in mine.entries.items() if s.expires_at <= now]:
            self._drop(mine, response_id)

    @staticmethod
    def _drop(mine: TenantResponses, response_id: str) -> None:
        mine.nbytes -= mine.entries.pop(response_id).nbytes
