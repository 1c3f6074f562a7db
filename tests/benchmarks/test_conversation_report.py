"""The conversation benchmark's control table (benchmarks/peer/conversation_report.py `alone_report`): both engines
alone, per turn, the warm-up conversation left out, and (b)'s verdict over turns 2-4 only. Expected cells are
worked by hand from the records below."""

from __future__ import annotations

from benchmarks.peer.conversation_report import PHASES, alone_report


def records(ms_by_turn: list[list[float]], vllm_by_turn: list[list[float]]) -> list[dict]:
    """One record per (conversation, turn): conversation 0 a warm-up far slower than any other (it must not count),
    then one conversation per column of the lists; each phase 10 ms."""
    out = [{"conversation": 0, "turn": t, "ms": 9_000.0, "vllm_ms": 10.0, **dict.fromkeys(PHASES, 10.0)}
           for t in range(4)]
    for t, (ours, theirs) in enumerate(zip(ms_by_turn, vllm_by_turn)):
        out += [{"conversation": c + 1, "turn": t, "ms": q, "vllm_ms": v, **dict.fromkeys(PHASES, 10.0)}
                for c, (q, v) in enumerate(zip(ours, theirs))]
    return out


def line(report: str, turn: int) -> list[str]:
    row = next(r for r in report.splitlines() if r.startswith(f"| turn {turn} |"))
    return [cell.strip() for cell in row.strip("|").split("|")]


def test_the_control_table_takes_medians_per_turn_without_the_warm_up():
    report = alone_report(records(
        ms_by_turn=[[300, 100, 200], [100, 120, 140], [150, 130, 140], [140, 150, 145]],
        vllm_by_turn=[[400, 500, 600], [500, 400, 600], [500, 500, 500], [480, 520, 500]]))
    # turn 1: qvpic median 200 (max 300), vLLM 500 (max 600): 0.40x, above the target but not judged (turn 1)
    assert line(report, 1) == ["turn 1", "200 / 300", "500 / 600", "0.40×", "10 / 10 / 10 / 10 / 10 / 150"]
    assert line(report, 2) == ["turn 2", "120 / 140", "500 / 600", "0.24×", "10 / 10 / 10 / 10 / 10 / 70"]
    assert line(report, 3)[3] == "0.28×"  # 140 / 500
    assert line(report, 4)[3] == "0.29×"  # 145 / 500
    assert "3 other conversations" in report
    assert "**met** (worst turn 0.29×)" in report


def test_one_slow_follow_up_turn_misses_the_target():
    report = alone_report(records(
        ms_by_turn=[[100, 100, 100], [100, 100, 100], [160, 170, 150], [100, 100, 100]],
        vllm_by_turn=[[500, 500, 500]] * 4))
    assert line(report, 3)[3] == "0.32×"  # 160 / 500
    assert "**missed** (worst turn 0.32×)" in report
