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


# Ray starts its workers at niceness 15 unless a node's raylet has this in its environment (jobs/cluster.py sets it
# to 0 for a local Ray; cluster.yaml and serve/rayservice.yaml for a cluster's nodes)
RAY_WORKER_NICENESS_ENV = "RAY_worker_niceness"
MAX_NICE = 19  # Linux's least favoured niceness: a step past it is lost
_warned = threading.Event()


def lower_priority(nice: int) -> None:
    """The calling thread's niceness raised by `nice` (Linux: a thread is a task of its own, and any user may lower
    its own priority; none may raise it back, so only threads that end are lowered). Elsewhere, or refused, it keeps
    its priority: logged, not fatal."""
    try:
        current = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), current + nice)
    except (AttributeError, OSError) as error:
        log.warning("a thread keeps its CPU priority: %s", error)
        return
    warn_if_clamped(current, nice)


def warn_if_clamped(current: int, nice: int) -> None:
    """Once per process: from niceness `current` a step of `nice` stops at MAX_NICE, so client-sized work is barely
    less favoured than interactive work (from Ray's default 15: CFS weights 15 against 36, not 110 against 1,024)."""
    if current + nice <= MAX_NICE or _warned.is_set():
        return
    _warned.set()
    log.warning("this process runs at niceness %d, so work whose size a client chooses (niceness +%d) stops at %d: "
                "another tenant's interactive work gets little precedence over it. Ray starts its workers at 15; "
                "start each node's Ray with %s=0 (cluster.yaml and serve/rayservice.yaml do)", current, nice,
                MAX_NICE, RAY_WORKER_NICENESS_ENV)


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
            current = os.getpriority(os.PRIO_PROCESS, task)
            os.setpriority(os.PRIO_PROCESS, task, current + nice)
        except OSError as error:  # ended meanwhile, or refused
            log.warning("thread %d keeps its CPU priority: %s", task, error)
            continue
        warn_if_clamped(current, nice)
