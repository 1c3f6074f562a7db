"""Which threads of a serving process may run torch's parallel kernels: the engine's alone.

Why. torch's CPU kernels run on OpenMP (GNU libgomp). libgomp gives every thread that starts a parallel
region its own pool of worker threads, kept for as long as that thread lives; and while more of its threads
exist than the process has CPUs, a worker spins for only ~1,000 iterations after a region before it sleeps
on a futex. So once a second long-lived thread has run one parallel kernel (a model loaded on the replica's
own thread, an image processed on asyncio's executor), every kernel the engine's thread runs afterwards
wakes its worker from a futex instead of finding it spinning. Measured on a 2-core Xeon (AVX-512, AMX),
torch 2.13: one bf16 token of bench-qwen over 600 columns takes 9.7 ms on the thread that loaded the model
and 15.6 ms on any other; a 7-token SDPA 19 → 38-80 µs, a 896 x 4,864 bf16 product 285 → 360 µs. Neither
`GOMP_SPINCOUNT` nor `OMP_WAIT_POLICY=ACTIVE` helps: libgomp caps the spin of an oversubscribed pool.

What this module gives. A pool dies with its thread. So the generator does its one-off parallel work (the
model's load, the serving prefix, a compiled forward's warm-up) on a thread that ends (`in_passing_thread`),
and what it sends off the event loop during requests (a conversation's images through the processor, a page
rendered, an entry rebuilt) goes to a thread of its own that ends with the call (`off_loop`). The thread that
runs the replica's event loop lives as long as the process, and its own tensor work (a loaded entry copied
into the hot tier) would start a pool too: `serial_here` keeps that thread's kernels on one thread. Then the
engine's thread (serve/engine/qvpic/engine.py) holds the process's only pool. Starting a thread costs ~0.1 ms; these
calls are a few per request at most.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ctypes
import functools
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from pipeline.priority import lower_priority

T = TypeVar("T")


def serial_here() -> bool:
    """Run this thread's torch kernels on one thread from now on, leaving every other thread's count (and the
    default new threads take) as it is. torch's `set_num_threads` would change the process's default too, so
    this sets the two per-thread counts the kernels read: OpenMP's (libgomp `omp_set_num_threads`) and MKL's
    (`MKL_Set_Num_Threads_Local`). False where torch runs on another OpenMP runtime, or without MKL: nothing
    was changed (a speed matter only)."""
    torch.get_num_threads()  # torch's per-thread first-use init, done now: it would reset what follows
    libraries = _runtime_libraries()
    if libraries is None:
        return False
    gomp, torch_cpu = libraries
    gomp.omp_set_num_threads(1)
    torch_cpu.MKL_Set_Num_Threads_Local(1)  # the C entry (the lower-case names take a pointer)
    return True


@functools.cache
def _runtime_libraries() -> tuple[ctypes.CDLL, ctypes.CDLL] | None:
    """The libgomp and libtorch_cpu this process loaded (their paths from /proc/self/maps; `CDLL` of a loaded
    path is that same library), or None."""
    try:
        mapped = {Path(line.split()[-1]) for line in Path("/proc/self/maps").read_text().splitlines()
                  if line.rstrip().endswith((".so", ".so.1"))}
    except OSError:
        return None
    gomp = next((p for p in mapped if p.name.startswith("libgomp")), None)
    torch_cpu = next((p for p in mapped if p.name == "libtorch_cpu.so"), None)
    if gomp is None or torch_cpu is None:
        return None
    libraries = ctypes.CDLL(str(gomp)), ctypes.CDLL(str(torch_cpu))
    return libraries if hasattr(libraries[1], "MKL_Set_Num_Threads_Local") else None


def in_passing_thread(fn: Callable[..., T], *args: Any, name: str = "qvpic-passing", nice: int = 0,
                      **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` on a new thread that ends when it returns (its OpenMP pool with it), `nice` steps less
    favoured by the CPU scheduler than this process; its result, or its exception raised here."""
    outcome: list[Any] = []

    def run() -> None:
        if nice:
            lower_priority(nice)
        try:
            outcome.append((True, fn(*args, **kwargs)))
        except BaseException as error:  # noqa: BLE001 — re-raised in the caller's thread
            outcome.append((False, error))

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


async def off_loop(fn: Callable[..., T], *args: Any, name: str = "qvpic-off-loop", nice: int = 0) -> T:
    """`asyncio.to_thread`, but on a thread of its own that ends with the call: asyncio's default executor keeps
    its threads, and a kept thread that ran a parallel kernel slows the engine's for good (module docstring).
    `nice`: the thread's niceness above this process's (`lower_priority`)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()
    context = contextvars.copy_context()  # as asyncio.to_thread: the caller's context variables

    def settle(ok: bool, value: Any) -> None:
        if not done.done():  # the caller may have been cancelled meanwhile
            (done.set_result if ok else done.set_exception)(value)

    def run() -> None:
        if nice:
            lower_priority(nice)
        try:
            result, ok = context.run(fn, *args), True
        except BaseException as error:  # noqa: BLE001 — raised in the awaiting task
            result, ok = error, False
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody awaits it
            loop.call_soon_threadsafe(settle, ok, result)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await done
