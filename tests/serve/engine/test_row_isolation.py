"""Issue 60, item 3: one tenant's row that fails — an exception, or out of memory, in its prefill — fails that request
alone. A row decoding meanwhile, and a request prefilled in the same batched forward as the bad one, finish with
exactly the tokens they get alone (the batch-1 runtime's). Before, the engine failed every request in flight."""

from __future__ import annotations

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
    while rec.engine.scheduler.waiting or rec.engine.scheduler.running:
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
