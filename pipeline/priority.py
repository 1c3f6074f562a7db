"""CPU priority of work whose size a client chooses (issue 60): bulk embeddings, an upload's pixels, a large body's
validation, a large conversation's framing. Run at `BULK_NICE`, it leaves the cores to interactive work first: another
tenant's question, the event loops, `/healthz`. Niceness orders the tasks of one scheduling group (a Ray node's
workers, started by one raylet, are one; so are a container's processes). Only os calls here: the ingress imports it
(tests/project/test_layering.py)."""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

# Niceness of work whose size a client chooses (bulk embeddings, an upload's pixels): ~10% of a core beside one busy
# thread of niceness 0 (CFS weights), so a node's cores go to interactive work first (issue 60).
BULK_NICE = 10


def lower_priority(nice: int) -> None:
    """The calling thread's niceness raised by `nice` (Linux: a thread is a task of its own, and any user may lower
    its own priority; none may raise it back, so only threads that end are lowered). Elsewhere, or refused, it keeps
    its priority: logged, not fatal."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + nice)
    except (AttributeError, OSError) as error:
        log.warning("a thread keeps its CPU priority: %s", error)


def lower_process_priority(nice: int) -> None:
    """Every thread of this process `nice` steps less favoured (Linux lists them in /proc/self/task; threads started
    later inherit their starter's niceness). Elsewhere, only the calling thread."""
    try:
        tasks = [int(task) for task in os.listdir("/proc/self/task")]
    except OSError:
        lower_priority(nice)
        return
    for task in tasks:
        try:
            os.setpriority(os.PRIO_PROCESS, task, os.getpriority(os.PRIO_PROCESS, task) + nice)
        except OSError as error:  # ended meanwhile, or refused
            log.warning("thread %d keeps its CPU priority: %s", task, error)
