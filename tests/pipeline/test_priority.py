"""pipeline/priority.py: a step of BULK_NICE from Ray's default worker niceness (15) is clamped at 19, and says so.

Ray starts its workers at niceness 15 unless a node's raylet has `RAY_worker_niceness` set; from there client-sized
work can only reach 19 (CFS weights 15 against 36: ~2.4 times less CPU, not ~9), which is what the fairness benchmark
measured in the serve shape (docs/RELIABILITY.md). Each thread here is a fresh one, lowered and then gone: a thread may
raise its own niceness, never lower it back."""

from __future__ import annotations

import logging
import os
import threading

import pytest

import pipeline.priority as priority
from pipeline.priority import BULK_NICE, MAX_NICE, RAY_WORKER_NICENESS_ENV, lower_priority


def in_thread_at(start: int, nice: int) -> int:
    """A new thread set to niceness `start`, then lowered by `nice`; the niceness it ended at."""
    ended = []

    def run():
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), start)
        lower_priority(nice)
        ended.append(os.getpriority(os.PRIO_PROCESS, 0))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10)
    return ended[0]


@pytest.fixture
def fresh_warning(monkeypatch):
    monkeypatch.setattr(priority, "_warned", threading.Event())


@pytest.mark.skipif(os.getpriority(os.PRIO_PROCESS, 0) > 5, reason="needs a process below niceness 5")
def test_a_step_from_ray_s_default_niceness_is_clamped_and_logged(fresh_warning, caplog):
    with caplog.at_level(logging.WARNING, logger="pipeline.priority"):
        assert in_thread_at(15, BULK_NICE) == MAX_NICE  # 15 + 10 stops at 19
    (record,) = caplog.records
    assert RAY_WORKER_NICENESS_ENV in record.getMessage() and "niceness 15" in record.getMessage()


@pytest.mark.skipif(os.getpriority(os.PRIO_PROCESS, 0) > 5, reason="needs a process below niceness 5")
def test_a_full_step_says_nothing(fresh_warning, caplog):
    """The control: from niceness 0 (what jobs/cluster.py gives a local Ray's workers) the step is whole."""
    with caplog.at_level(logging.WARNING, logger="pipeline.priority"):
        assert in_thread_at(0, BULK_NICE) == BULK_NICE
    assert caplog.records == []
