"""Issue 60, item 3: one tenant's row that fails — an exception, or out of memory, in its prefill, or its own work in a
decode step (its controls, grammar, stop strings) — fails that request alone. A row decoding meanwhile, and a request
prefilled in the same batched forward as the bad one, finish with exactly the tokens they get alone (the batch-1
runtime's). Before, the engine failed every request in flight."""

from __future__ import annotations

import pytest
import torch

from serve.engine.sequence import End, Finished, Status
from tests.serve.engine.test_engine import Recorder, alone, chunks, linked  # noqa: F401  (a fixture)


def step(rec: Recorder) -> None:
    """One step as the engine's thread takes it (serve/engine/qvpic/engine.py `_loop`): a step that raises fails the
    requests in flight and the engine starts over."""
    try:
        rec.engine.step()
    except Exception as error:  # noqa: BLE001  as the loop does
        rec.engine._fail(error)


def run(rec: Recorder) -> None:
    while rec.engine.scheduler.busy:
        step(rec)


def test_a_request_whose_prefill_fails_fails_alone(vlm, chunks, monkeypatch):
    rec = Recorder(vlm)
    prefill = rec.engine._prefill_linked
    injected = torch.OutOfMemoryError("injected: out of memory in this request's prefill")

    def failing(seqs):
        if any(s.context.salt == b"bad" for s in seqs):
            raise injected
        return prefill(seqs)
    monkeypatch.setattr(rec.engine, "_prefill_linked", failing)
    decoding = rec.submit(linked(vlm, chunks[:2], "When does it ship?", salt=b"acme"), 12)
    step(rec)
    step(rec)
    assert decoding.status is Status.RUNNING and decoding.token_ids  # decoding when the others arrive
    bad = rec.submit(linked(vlm, [chunks[2]], "Reset how?", salt=b"bad"), 8)
    beside = rec.submit(linked(vlm, [chunks[4]], "Which part?", salt=b"globex"), 8)  # joins in the same step
    step(rec)
    assert bad.status is Status.FINISHED and rec.events[bad.id][-1] == Finished(End.FAILED, injected)
    assert decoding.status is Status.RUNNING and beside.status is Status.RUNNING  # the others go on
    run(rec)
    for seq in (decoding, beside):
        tokens, _ = alone(vlm, seq.context, seq.sampling.max_new_tokens)
        assert seq.end in (End.STOP, End.LENGTH) and seq.token_ids == tokens
    assert rec.engine.ended["failed"] == 1
    assert rec.engine.slab is None and not rec.engine.scheduler.running  # everyone left, memory freed


FAULT_AT = 2  # the faulty row's tokens before its own work raises (it has decoded some when the others join)


def faulty(rec: Recorder, monkeypatch, where: str, injected: Exception) -> None:
    """`where` (the sampler's `choose`: a row's controls and grammar mask; its `ending`: grammar advance and stop
    strings) raises for the request salted b"bad" once it has FAULT_AT tokens, in a decode step."""
    original = getattr(rec.engine.sampler, where)

    def failing(seq, *args):
        if seq.context.salt == b"bad" and len(seq.token_ids) >= FAULT_AT:
            raise injected
        return original(seq, *args)
    monkeypatch.setattr(rec.engine.sampler, where, failing)


@pytest.mark.parametrize("where", ["choose", "ending"])
def test_a_row_whose_decode_step_fails_fails_alone(vlm, chunks, monkeypatch, where):
    """A decode step in which one row's own work raises (its controls, its grammar, its stop strings) fails that row
    alone: the two rows decoding beside it (one sampled with a seed, one greedy) finish with exactly the tokens
    they get without it — the greedy one the batch-1 runtime's, the seeded one those of a run of the same engine
    with no faulty row — and the faulty one ends End.FAILED with its error after its tokens so far. The control
    (the old engine: the step raises, `_fail` ends every row in flight) fails every row."""
    injected = ValueError("injected: this row's logits processing raised")
    seeded = dict(temperature=0.9, seed=7)

    def beside(rec: Recorder) -> list:
        return [rec.submit(linked(vlm, chunks[:2], "When does it ship?", salt=b"acme"), 10),
                rec.submit(linked(vlm, [chunks[4]], "Which part?", salt=b"globex"), 10, **seeded)]

    clean = Recorder(vlm)
    expected = beside(clean)
    run(clean)
    rec = Recorder(vlm)
    faulty(rec, monkeypatch, where, injected)
    bad = rec.submit(linked(vlm, [chunks[2]], "Reset how?", salt=b"bad"), 10)
    others = beside(rec)
    run(rec)
    assert bad.end is End.FAILED and rec.events[bad.id][-1] == Finished(End.FAILED, injected)
    assert len(bad.token_ids) in (FAULT_AT, FAULT_AT + 1)  # `ending` raises after its token went out
    reference, _ = alone(vlm, bad.context, 10)
    assert bad.token_ids == reference[:len(bad.token_ids)]
    greedy, _ = alone(vlm, others[0].context, 10)
    assert others[0].end in (End.STOP, End.LENGTH) and others[0].token_ids == greedy
    assert others[1].end is expected[1].end and others[1].token_ids == expected[1].token_ids
    assert len(others[1].token_ids) > FAULT_AT + 1  # it went on past the faulty step
    assert rec.engine.ended["failed"] == 1
    assert rec.engine.slab is None and not rec.engine.scheduler.running


def test_a_step_out_of_device_memory_is_a_503_to_retry_and_the_engine_goes_on(vlm, chunks, monkeypatch):
    """A decode forward that runs the device out of memory is no one row's fault: every row of the step ends, each
    with a `BusyError` (503, Retry-After; the OOM its cause) rather than the OOM itself (a 500); the engine starts
    over and the next request gets exactly its tokens alone. Control: `step_failure` returning the error as it is
    hands the rows the OOM."""
    from schemas.errors import BusyError
    from serve.engine.qvpic import engine as engine_module

    real, calls = engine_module.decode_step, []
    oom = torch.OutOfMemoryError("injected: CUDA out of memory in a decode step")

    def once(*args):
        calls.append(len(args[2]))
        if len(calls) == 3:
            raise oom
        return real(*args)
    monkeypatch.setattr(engine_module, "decode_step", once)
    rec = Recorder(vlm)
    rows = [rec.submit(linked(vlm, chunks[:2], "When does it ship?", salt=b"acme"), 10),
            rec.submit(linked(vlm, [chunks[4]], "Which part?", salt=b"globex"), 10)]
    run(rec)
    for seq in rows:
        error = rec.events[seq.id][-1].error
        assert seq.end is End.FAILED and isinstance(error, BusyError) and error.__cause__ is oom
        assert error.status_code == 503 and error.headers() == {"Retry-After": "1"}
    assert calls[2] == 2  # both rows were in the step that failed
    after = rec.submit(linked(vlm, [chunks[3]], "Reset how?", salt=b"after"), 6)
    run(rec)
    tokens, _ = alone(vlm, after.context, 6)
    assert after.end in (End.STOP, End.LENGTH) and after.token_ids == tokens
