"""Each tenant's share of the generator's engine: rows and KV bytes (issue 60, "a fair generator").

The engine admits its queue in arrival order, so one tenant that sends a burst would hold every row of the batch and
all of its KV while the others wait behind it. The generator (serve/engine/generator.py) therefore holds a request
here before it hands it to the engine — whichever engine, qvpic's or vLLM's: this sits above the seam — and lets it
go when it ends. A request takes `n` rows (one per choice) and the KV its rows can ever fill (prompt and max_tokens,
as qvpic's slab lays them out: `rows × max_columns × column bytes`; vLLM's paged blocks round it up a little).

The cap is `EngineConfig.max_tenant_share` of the batch's rows (`max_batch_size`, at least one row) and of its KV
(`max_kv_nbytes` as the engine resolved it). It binds while another tenant holds rows here: a tenant alone may use
the whole batch (a single-tenant deployment loses nothing), and once others arrive its next requests wait here until
its share has room, while theirs go ahead. A request that could never fit a share alone is a 413 at once. Waiting
counts against the request's deadline. The tenant is the plan's `cache_salt`: the server's, derived from the
authenticated tenant (serve/http/exchange.py `tenant_salt`), never a client's word.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import Counter
from collections.abc import AsyncIterator

from schemas.errors import DeadlineExceededError, TooLargeError


class TenantShares:
    """Rows and KV bytes each tenant holds in one generator's engine, and the requests waiting for room."""

    def __init__(self, share: float | None, max_rows: int, max_kv_nbytes: int | None):
        self.max_rows = None if share is None else max(1, math.floor(share * max_rows))
        self.max_nbytes = None if share is None or max_kv_nbytes is None else int(share * max_kv_nbytes)
        self.rows: Counter[bytes] = Counter()  # tenant -> rows its requests hold in the engine now
        self.nbytes: Counter[bytes] = Counter()  # tenant -> KV bytes they can fill
        self._waiters: list[asyncio.Future] = []

    def _fits(self, tenant: bytes, rows: int, nbytes: int) -> bool:
        if self.max_rows is None or not any(t != tenant for t in self.rows):  # no cap, or alone: the whole batch
            return True
        return (self.rows[tenant] + rows <= self.max_rows
                and (self.max_nbytes is None or self.nbytes[tenant] + nbytes <= self.max_nbytes))

    @contextlib.asynccontextmanager
    async def hold(self, tenant: bytes, rows: int, nbytes: int, deadline: float | None) -> AsyncIterator[None]:
        """Wait until `tenant` has room for `rows` rows and `nbytes` of KV, hold them for the block, then let go."""
        if self.max_rows is not None and (rows > self.max_rows or
                                          (self.max_nbytes is not None and nbytes > self.max_nbytes)):
            raise TooLargeError(f"the request needs {rows} rows and {nbytes} bytes of KV; one tenant holds at most "
                                f"{self.max_rows} rows and {self.max_nbytes} bytes of this generator's batch "
                                "(engine.max_tenant_share)")
        while not self._fits(tenant, rows, nbytes):
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                await asyncio.wait_for(waiter, timeout)
            except TimeoutError:
                raise DeadlineExceededError("the request passed its deadline while its tenant's share of the "
                                            "generator was full") from None
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        self.rows[tenant] += rows
        self.nbytes[tenant] += nbytes
        try:
            yield
        finally:
            self.rows[tenant] -= rows
            self.nbytes[tenant] -= nbytes
            if self.rows[tenant] <= 0:
                del self.rows[tenant], self.nbytes[tenant]
            self._wake()

    def _wake(self) -> None:
        """Room was freed: every waiter checks again (each on its own event loop; they are few, bounded by Serve's
        `max_ongoing_requests` of the generator)."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.get_loop().call_soon_threadsafe(_release, waiter)


def _release(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)
