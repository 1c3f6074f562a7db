"""Host syncs per engine step (tests/support/sync_counter.py): what would drain a GPU's stream each step.

A decode step reads one thing back — the batch's chosen token ids, in one transfer — for greedy rows and for rows
under temperature, top-p, top-k, min-p, a seed, penalties (vLLM's repetition penalty too), min_tokens or a logit bias
alike: widths, positions and lengths come from the
slab's own host bookkeeping (checked against the device's at every step), never from a read of the device. Rows
leaving read nothing. A prefill (rows joining) reads a stated number, counted here for both kinds of context
(linked: qvpic's modes; online: full_text, full_image) and listed with its sites in docs/BENCHMARKS.md `syncs`.
"""

from __future__ import annotations

import pytest

from serve.engine.sequence import Status
from tests.serve.engine.test_engine import Recorder, chunks, linked, online  # noqa: F401  (chunks: a fixture)
from tests.support.sync_counter import COPY, SCALAR, SYNC, counting_syncs

SAMPLED = {"greedy": {}, "temperature": dict(temperature=0.9, top_p=0.8, seed=3, top_k=20, min_p=0.02),
           "penalties": dict(presence_penalty=0.5, frequency_penalty=0.3, logit_bias=((3, 2.0),),
                             repetition_penalty=1.3, min_tokens=3, stop_token_ids=(7,)),
           "unseeded": dict(temperature=1.2)}
ONE_READ = {SCALAR: 0, COPY: 1, SYNC: 0}  # the chosen ids, one `.tolist()` for the batch
NONE = {SCALAR: 0, COPY: 0, SYNC: 0}


def phases(rec: Recorder, monkeypatch, syncs) -> list[dict]:
    """Run `rec` to the end, one dict per step: each phase's counts by kind ("decode") and by site ("decode at")."""
    engine, steps = rec.engine, []
    for phase in ("_retire", "_admit", "_decode"):
        real = getattr(engine, phase)

        def counted(real=real, phase=phase):
            syncs.take()
            real()
            taken = syncs.take()
            steps[-1][phase.strip("_")], steps[-1][phase.strip("_") + " at"] = taken.by_kind(), taken.where()
        monkeypatch.setattr(engine, phase, counted)
    while engine.scheduler.busy:
        steps.append({})
        engine.step()
        slab = engine.slab
        if slab is not None:  # the host's bookkeeping is the device's (read here, between the counted phases)
            assert slab.host_lengths == slab.lengths.tolist()
            assert slab.host_next_positions == slab.next_positions.tolist()
            for row, (start, stop) in enumerate(slab.host_pads):
                unwritten = [c for c in range(slab.host_lengths[row]) if not slab.valid[row, c]]
                assert unwritten == list(range(start, stop))
    return steps


def run(vlm, monkeypatch, contexts, max_new_tokens: int = 6) -> list[dict]:
    rec = Recorder(vlm)
    seqs = [rec.submit(context, max_new_tokens, **SAMPLED[name]) for name, context in contexts]
    with counting_syncs(monkeypatch) as syncs:
        steps = phases(rec, monkeypatch, syncs)
    assert all(s.status is Status.FINISHED for s in seqs)
    return steps


def test_a_decode_step_reads_back_only_the_chosen_ids(vlm, chunks, monkeypatch):
    contexts = [("greedy", linked(vlm, chunks[:2], "When does it ship?")),
                ("temperature", linked(vlm, [chunks[4]], "Which part?")),
                ("penalties", linked(vlm, [chunks[1]], "How long?", "Be brief.")),
                ("unseeded", online(vlm, ["Part QZ-19 ships on 3 April."], "Which part ships?"))]
    steps = run(vlm, monkeypatch, contexts)
    decodes = [(s["decode"], s["decode at"]) for s in steps if "decode" in s]
    assert len(decodes) >= 4
    assert all(counts == ONE_READ for counts, _ in decodes), decodes  # was 5 scalar reads, 1 copy, 1 synchronize
    assert all(s["retire"] == NONE for s in steps), [s["retire at"] for s in steps]  # was 14 where 4 rows left


# Stated, not bounded to one. Linked (two rows prefilled together): their tokens read once, and a synchronize to time
# the prefix-cache lookup and one to time each row's assembly (its reanchor_ms). Online (one full prefill a step):
# its token, and transformers' own mask check (`padding_mask.all()`, masking_utils.py) in the model's forward.
# A shift the model's rotation table has not seen costs one scalar read more, once a process (`_halves_factors`).
# Was: linked 5 scalar reads, 8 copies (rotation shifts, text positions, lengths, tokens), 4 synchronizes; online
# 2, 3, 1 (5, 3, 1 when it joined a running row).
PREFILLS = {"linked": ({SCALAR: 0, COPY: 1, SYNC: 3}, 1), "online": ({SCALAR: 1, COPY: 1, SYNC: 0}, 2)}


@pytest.mark.parametrize("mode", PREFILLS)
def test_a_prefill_reads_a_stated_number(vlm, chunks, monkeypatch, mode):
    if mode == "linked":
        contexts = [("greedy", linked(vlm, chunks[:2], "When does it ship?")),
                    ("temperature", linked(vlm, [chunks[4]], "Which part?"))]
    else:
        contexts = [("greedy", online(vlm, ["Invoice 4471 ships on 12 March."], "When?")),
                    ("temperature", online(vlm, ["Part QZ-19 ships on 3 April."], "Which part ships?"))]
    run(vlm, monkeypatch, contexts, max_new_tokens=3)  # the model's rotation table warm (a new engine, cold cache)
    steps = run(vlm, monkeypatch, contexts, max_new_tokens=3)
    counts, prefills = PREFILLS[mode]
    admits = [(s["admit"], s["admit at"]) for s in steps if s["admit"] != NONE]
    assert len(admits) == prefills and all(c == counts for c, _ in admits), admits
