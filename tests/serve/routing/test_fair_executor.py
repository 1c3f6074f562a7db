"""Issue 60: the router's framing queue takes tenants in turn (serve/routing/fair_executor.py `FairExecutor`), so a
tenant with several large conversations queued does not hold another's behind all of them. Counted, not timed: the
order the calls ran in. The control is a first-come queue (concurrent.futures' ThreadPoolExecutor)."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import CancelledError, ThreadPoolExecutor

import pytest

from schemas.api import AnswerRequest
from schemas.conversation import Message
from serve.routing.fair_executor import FairExecutor
from tests.support.store_factory import roles, serving_store  # noqa: F401  (fixtures)


def run_order(submit) -> list[str]:
    """a1 holds the one worker; a2..a5 then b1 queue behind it; the order they ran in."""
    ran, started, gate = [], threading.Event(), threading.Event()

    def call(name: str) -> None:
        if name == "a1":
            started.set()
            gate.wait(10)
        ran.append(name)

    first = submit("a", call, "a1")
    assert started.wait(10)
    futures = [submit("a", call, f"a{i}") for i in range(2, 6)] + [submit("b", call, "b1")]
    gate.set()
    for future in [first, *futures]:
        future.result(10)
    return ran


def test_another_tenant_waits_for_the_running_call_not_for_the_queued_ones():
    executor = FairExecutor(1, "test")
    try:
        assert run_order(executor.submit) == ["a1", "b1", "a2", "a3", "a4", "a5"]
    finally:
        executor.shutdown()
    # control: served first come, first served, b's call waits for all of a's
    pool = ThreadPoolExecutor(1)
    try:
        assert run_order(lambda key, fn, *args: pool.submit(fn, *args)) == ["a1", "a2", "a3", "a4", "a5", "b1"]
    finally:
        pool.shutdown()


def test_results_errors_cancellation_and_shutdown():
    executor = FairExecutor(2, "test")
    gate, ran = threading.Event(), []
    try:
        assert executor.submit("a", lambda x: x * 2, 21).result(10) == 42
        with pytest.raises(KeyError, match="missing"):
            executor.submit("a", lambda: {}["missing"]).result(10)
        running = threading.Semaphore(0)

        def hold() -> bool:
            running.release()
            return gate.wait(10)

        held = [executor.submit(key, hold) for key in ("a", "b")]
        assert running.acquire(timeout=10) and running.acquire(timeout=10)  # both workers busy
        cancelled = executor.submit("c", ran.append, "cancelled")
        assert cancelled.cancel()
        queued = executor.submit("c", ran.append, "queued")
        executor.shutdown()  # the queued call is cancelled; the running ones finish
        gate.set()
        assert all(future.result(10) for future in held)
        with pytest.raises(CancelledError):
            queued.result(10)
        assert ran == []
        with pytest.raises(RuntimeError, match="shut down"):
            executor.submit("a", print)
    finally:
        gate.set()
        executor.shutdown()
    with pytest.raises(ValueError, match="workers"):
        FairExecutor(0, "test")


def test_the_router_queues_a_large_conversation_under_its_tenant(roles, monkeypatch):
    """Router.plan hands the framer the tenant's cache salt, the key it queues under."""
    router, keys = roles.router, []
    original = router.framer.frame

    async def frame(request, groups, tenant=b""):
        keys.append(tenant)
        return await original(request, groups, tenant)

    monkeypatch.setattr(router.framer, "frame", frame)

    messages = [Message(role="user" if i % 2 == 0 else "assistant", content=f"turn {i}") for i in range(71)]
    request = AnswerRequest(query="turn 70", messages=messages, top_k=2)
    assert router.framer.offloads(request.messages)
    asyncio.run(router.plan(request, cache_salt=b"tenant-b"))
    assert keys == [b"tenant-b"]
