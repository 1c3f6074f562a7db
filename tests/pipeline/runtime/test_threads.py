"""Which threads run torch's parallel kernels (pipeline/runtime/threads.py): the generator loads its model on a
thread that ends, a Serve replica's event-loop thread runs its kernels on one thread, and the engine's thread keeps
the configured count. Thread counts and thread identities are asserted here; what they are worth in milliseconds
is docs/BENCHMARKS.md's (`python -m benchmarks.perf.threads`), since timed assertions do not belong in tests."""

from __future__ import annotations

import asyncio
import contextvars
import os
import threading

import pytest
import torch

import serve.engine.generator as generator_module
from pipeline.priority import BULK_NICE
from pipeline.runtime import in_passing_thread, off_loop, serial_here
from serve.config import GeneratorConfig
from tests.support.paths import REPO
from tests.support.store_factory import serving_store  # noqa: F401  (fixture)


@pytest.fixture
def two_threads():
    """torch at 2 intra-op threads in this test (the suite's count restored after)."""
    kept = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(kept)


def on_new_thread(fn):
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("value", fn()))
    thread.start()
    thread.join()
    return box["value"]


def test_serial_here_changes_its_own_thread_only(two_threads):
    def serial() -> tuple[bool, int]:
        return serial_here(), torch.get_num_threads()

    changed, count = on_new_thread(serial)
    assert changed, "this build has libgomp and MKL: the per-thread counts must be set"
    assert count == 1
    assert torch.get_num_threads() == 2  # the caller's thread
    assert on_new_thread(torch.get_num_threads) == 2  # the default a new thread takes is unchanged (the control)


def test_serial_here_holds_through_the_thread_s_first_kernel(two_threads):
    """torch sets a thread's count from the process default at its first parallel kernel; `serial_here` must
    outlast that, or the thread would go back to 2 at its first product."""
    def serial_then_product() -> int:
        serial_here()
        torch.randn(256, 256) @ torch.randn(256, 256)
        return torch.get_num_threads()

    assert on_new_thread(serial_then_product) == 1


def test_in_passing_thread_runs_on_a_thread_that_has_ended():
    ran_on: list[threading.Thread] = []

    def work(a, b=0):
        ran_on.append(threading.current_thread())
        return a + b

    assert in_passing_thread(work, 2, b=3) == 5
    assert ran_on[0] is not threading.current_thread()
    assert not ran_on[0].is_alive()


def test_in_passing_thread_raises_the_error_here():
    def fail():
        raise KeyError("no such entry")

    with pytest.raises(KeyError, match="no such entry"):
        in_passing_thread(fail)


def test_off_loop_runs_on_a_thread_that_ends_and_keeps_the_context():
    request = contextvars.ContextVar("request", default="none")
    ran_on: list[threading.Thread] = []

    def work(x):
        ran_on.append(threading.current_thread())
        return f"{request.get()}:{x}"

    async def main():
        request.set("r-1")
        value = await off_loop(work, 7)
        with pytest.raises(ValueError, match="bad page"):
            await off_loop(lambda: (_ for _ in ()).throw(ValueError("bad page")))
        return value

    assert asyncio.run(main()) == "r-1:7"
    ran_on[0].join(5)
    assert ran_on[0] is not threading.main_thread() and not ran_on[0].is_alive()


def niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_a_nicer_thread_is_lowered_and_the_caller_keeps_its_priority():
    """`nice` lowers the new thread's priority only: the caller's stays, and so does a thread without it."""
    base = niceness()
    expected = min(19, base + BULK_NICE)

    async def main():
        return await off_loop(niceness, nice=BULK_NICE), await off_loop(niceness)

    assert in_passing_thread(niceness, nice=BULK_NICE) == expected
    assert in_passing_thread(niceness) == base
    assert asyncio.run(main()) == (expected, base)
    assert niceness() == base


def test_a_replica_s_generator_loads_off_its_thread_and_keeps_that_thread_serial(serving_store, monkeypatch,
                                                                                   two_threads):
    """As in a Serve replica (a CPU reservation; the constructor called on the thread that will run the replica's
    event loop): the model is loaded on another thread, gone by the end; the constructing thread runs its kernels
    on one thread; the engine's thread keeps the reservation's 2."""
    loaded_on: list[threading.Thread] = []
    real_vlm = generator_module.VLM

    def recording_vlm(*args, **kwargs):
        loaded_on.append(threading.current_thread())
        return real_vlm(*args, **kwargs)

    monkeypatch.setattr(generator_module, "VLM", recording_vlm)
    monkeypatch.setattr(generator_module, "reserved_cpus", lambda: 2.0)

    def replica_thread():
        generator = generator_module.Generator(GeneratorConfig(store=serving_store.uri, model=serving_store.model))
        # asked on this thread, as Serve asks a replica: the engine's count, not this thread's
        return threading.current_thread(), torch.get_num_threads(), generator.stats().forward_threads

    constructing, count, engine_count = on_new_thread(replica_thread)
    assert loaded_on[0] is not constructing and not loaded_on[0].is_alive()
    assert count == 1
    assert engine_count == 2


def test_the_generator_sends_work_off_its_loop_on_threads_that_end():
    """asyncio's executor keeps its threads: one that ran a parallel kernel would keep a second pool beside the
    engine's for the replica's life. The generator's code (serve/engine, and serve/kv, which it runs in-replica)
    uses `off_loop` instead."""

    root = REPO
    for path in sorted([*root.glob("serve/engine/*.py"), *root.glob("serve/kv/*.py")]):
        text = path.read_text()
        assert "to_thread(" not in text and "run_in_executor(" not in text, path
