"""Chunked prefill (serve/engine/qvpic/pieces.py): a long linked prompt forwarded in pieces over several engine steps.

The reference for a prompt with text between its groups of chunks is the sequential path: each text forwarded on a
DynamicCache and each group re-anchored after it, one by one (`resume(defer_texts=False)`, then the tail alone) —
no slab, no explicit columns. Pieces of every size equal it and the one-forward prefill (≤1e-5, float32), and a
piece whose positions are off by one does not (the control). In the engine: the running rows decode between the
pieces, a short request that arrives meanwhile joins first, a step never forwards more than its budget, and a
prompt in pieces that is cancelled or fails ends alone.
"""

from __future__ import annotations

import queue
from types import SimpleNamespace

import pytest
import torch

from pipeline.runtime.conversation import PreparedSegment
from schemas.config import EngineConfig
from schemas.sampling import Sampling
from serve.engine.prepared import LinkedContext, LinkedPrompt
from serve.engine.qvpic import batch
from serve.engine.qvpic.batch import lay_out, prefill_alone, prefill_queries
from serve.engine.qvpic.engine import QvpicEngine
from serve.engine.qvpic.linked_prompt import resume
from serve.engine.qvpic.pieces import Pieces
from serve.engine.qvpic.scheduler import Scheduler, column_cost, prefill_cost
from serve.engine.sequence import End, Finished, Sequence, Status
from tests.serve.engine.test_engine import Recorder, alone, linked

TOLERANCE = 1e-5
HISTORY = "Earlier you said the invoice ships in March, the warranty covers two years, and the part is QZ-19. " * 3


@pytest.fixture(scope="module")
def chunks(vlm):
    return [vlm.compile_text("Invoice 4471 ships on 12 March."), vlm.compile_text("The warranty covers two years."),
            vlm.compile_text("Part QZ-19 ships on 3 April.")]


def two_groups(vlm, chunks) -> LinkedPrompt:
    """[template start][chunk 0][a long history][chunks 1, 2][the question]: the history is a hole between groups."""
    texts = [PreparedSegment(list(vlm.adapter.prefix_ids)), PreparedSegment(vlm.adapter.encode(HISTORY)),
             PreparedSegment(vlm.query_turn_ids("So when does the part ship, and what does the warranty cover?"))]
    return LinkedPrompt(texts, [[chunks[0]], [chunks[1], chunks[2]]], [[b"0"], [b"1", b"2"]])


@torch.inference_mode()
def sequential(vlm, prompt: LinkedPrompt) -> torch.Tensor:
    """The reference: every text forwarded and every group linked one by one, then the tail; `[vocab]`."""
    resumed = resume(vlm, None, b"", prompt, defer_texts=False)
    assert not resumed.holes
    _, logits = prefill_alone(vlm, resumed.base, resumed.chunks, resumed.tail, 0)
    return logits[0]


def laid_out(vlm, prompt: LinkedPrompt):
    resumed = resume(vlm, None, b"", prompt, defer_texts=True)
    assert max(h.text.num_tokens for h in resumed.holes) > 20  # the history is computed with the tail
    return resumed, lay_out(vlm, [resumed.base], [resumed.chunks], [resumed.tail.ids], [4], None, [resumed.holes])


@pytest.mark.parametrize("piece", [1, 7, 64, 10_000])
def test_pieces_of_any_size_equal_the_sequential_prefill(vlm, chunks, piece):
    prompt = two_groups(vlm, chunks)
    reference = sequential(vlm, prompt)
    resumed, layout = laid_out(vlm, prompt)
    _, whole, _ = prefill_queries(vlm, [resumed.base], [resumed.chunks], [resumed.tail.ids], [4], None,
                                  [resumed.holes])
    pieces = Pieces(None, layout)
    total, forwards, logits = pieces.remaining, 0, None
    while logits is None:
        logits = pieces.forward(vlm, piece)
        forwards += 1
    assert forwards == -(-total // piece) and pieces.remaining == 0
    assert float((logits[0] - reference).abs().max()) <= TOLERANCE
    assert float((whole[0] - reference).abs().max()) <= TOLERANCE
    slab = layout.slab  # the row's bookkeeping ends where a one-forward prefill's does
    assert slab.host_lengths == [prompt.num_tokens] and slab.host_next_positions[0] > prompt.num_tokens - 1
    assert int(slab.valid[0].sum()) == prompt.num_tokens


def test_a_piece_at_the_wrong_positions_differs(vlm, chunks):
    """The control: the same pieces, the second half's positions one on (the slightest mistake a piece can make);
    its logits leave the tolerance tenfold."""
    prompt = two_groups(vlm, chunks)
    reference = sequential(vlm, prompt)
    _, layout = laid_out(vlm, prompt)
    half = layout.ids.shape[1] // 2
    with torch.inference_mode():
        layout.positions[:, half:] += 1
    pieces = Pieces(None, layout)
    pieces.forward(vlm, half)
    logits = pieces.forward(vlm, half + 1)
    assert float((logits[0] - reference).abs().max()) > 10 * TOLERANCE  # an off-by-one is seen: 1.8e-4 at least


def test_pieces_take_one_row_without_pad_slots(vlm, chunks):
    context = linked(vlm, chunks[:1], "When?")
    two = lay_out(vlm, [None, None], [[chunks[0]], [chunks[1]]], [context.query_ids, context.query_ids[:2]], [1, 1])
    with pytest.raises(ValueError, match="alone"):
        Pieces(None, two)


# ---- in the engine -------------------------------------------------------------------------------------------------
LONG_QUESTION = "Tell me everything the documents say about shipping dates, parts and the warranty. " * 8


def prefill_widths(monkeypatch) -> list[tuple[int, int]]:
    """Every prefill forward's new tokens and the columns its widest token reads (decode steps left out)."""
    widths: list[tuple[int, int]] = []
    real_forward = batch.forward

    def counting(vlm, slab, ids, real, columns=None, explicit=None, last=None):
        if columns is not None:
            widths.append((int(real.sum()), int(columns.max()) + 1))
        return real_forward(vlm, slab, ids, real, columns, explicit, last)

    monkeypatch.setattr(batch, "forward", counting)
    monkeypatch.setattr("serve.engine.qvpic.pieces.forward", counting)
    return widths


def test_a_long_prompt_is_prefilled_over_steps_while_the_rows_decode(vlm, chunks, monkeypatch):
    long_context = linked(vlm, chunks[:2], LONG_QUESTION)
    budget = 64
    assert long_context.num_query_tokens > 3 * budget
    rec = Recorder(vlm, EngineConfig(max_prefill_tokens=budget))
    running = rec.submit(linked(vlm, chunks[1:], "When?"), 40)
    rec.engine.step()
    widths = prefill_widths(monkeypatch)
    long = rec.submit(long_context, 6)
    rec.engine.step()
    assert rec.engine.pieces is not None and rec.engine.pieces.seq is long and long.status is Status.WAITING
    short = rec.submit(linked(vlm, chunks[2:], "Which part?"), 6)  # arrives while the long prompt is in pieces
    steps, decoded = 1, [len(running.token_ids)]
    while long.status is Status.WAITING and steps < 100:
        rec.engine.step()
        steps += 1
        decoded.append(len(running.token_ids))
        if steps == 2:
            assert short.status is Status.RUNNING  # joined whole at the next step, before the long one's end
    assert steps >= long_context.num_query_tokens // budget  # the budget cut it
    assert decoded == list(range(decoded[0], decoded[0] + steps))  # a token every step, pieces or not
    per_column = rec.engine.scheduler.per_column
    assert per_column > 0 and len(widths) >= steps
    # no forward took more than a step's budget, its attention counted (a step here has one prefill forward at most)
    assert max(prefill_cost(n, columns, per_column) for n, columns in widths) <= budget
    assert rec.engine.scheduler.prefilling is None and rec.engine.pieces is None
    rec.run()
    for seq in (running, long, short):  # each as the batch-1 runtime gives it alone
        tokens, logits = alone(vlm, seq.context, seq.sampling.max_new_tokens)
        assert seq.token_ids == tokens
        assert max(float((a - b).abs().max()) for a, b in zip(rec.logits[seq.id], logits)) <= TOLERANCE


def test_a_budget_it_fits_forwards_it_whole(vlm, chunks, monkeypatch):
    """The control for the above: with the default budget the same prompt is one forward."""
    long_context = linked(vlm, chunks[:2], LONG_QUESTION)
    rec = Recorder(vlm, EngineConfig())
    widths = prefill_widths(monkeypatch)
    long = rec.submit(long_context, 2)
    rec.engine.step()
    assert long.status is not Status.WAITING and rec.engine.pieces is None
    assert [n for n, _ in widths] == [long_context.num_query_tokens]  # every text: the prefix cache is empty


def test_a_prompt_cancelled_or_failing_in_pieces_ends_alone(vlm, chunks, monkeypatch):
    rec = Recorder(vlm, EngineConfig(max_prefill_tokens=48))
    running = rec.submit(linked(vlm, chunks[1:], "When?"), 30)
    rec.engine.step()
    cancelled = rec.submit(linked(vlm, chunks[:2], LONG_QUESTION), 4)
    rec.engine.step()
    assert rec.engine.pieces.seq is cancelled
    rec.engine.abort(cancelled)
    rec.engine.step()
    assert cancelled.end is End.CANCELLED and rec.engine.pieces is None and rec.engine.scheduler.prefilling is None
    failing = rec.submit(linked(vlm, chunks[:2], LONG_QUESTION), 4)
    rec.engine.step()
    calls, error = [], RuntimeError("a piece's own failure")

    def raising(self, vlm, tokens):
        calls.append(tokens)
        raise error

    monkeypatch.setattr(Pieces, "forward", raising)
    rec.engine.step()
    assert calls and failing.end is End.FAILED
    assert [e.error for e in rec.events[failing.id] if isinstance(e, Finished)] == [error]
    assert rec.engine.pieces is None and running.status is Status.RUNNING
    monkeypatch.undo()
    rec.run()
    tokens, _ = alone(vlm, running.context, running.sampling.max_new_tokens)
    assert running.token_ids == tokens and rec.engine.slab is None


def test_a_prompt_prefilled_in_pieces_is_kept_in_the_prefix_cache(vlm, chunks):
    """Its blocks are stored when it ends, like any row's: the same request again is resumed from them, whole (its
    last column's logits too), with no piece and the same tokens."""
    rec = Recorder(vlm, EngineConfig(max_prefill_tokens=64))
    first = rec.submit(linked(vlm, chunks[:2], LONG_QUESTION), 5)
    rec.engine.step()
    assert rec.engine.pieces is not None  # control: the first is cut
    rec.run()
    rec.engine.step()  # its blocks are kept at the step after it ends
    again = rec.submit(linked(vlm, chunks[:2], LONG_QUESTION), 5)
    rec.engine.step()
    assert rec.engine.pieces is None and again.status is not Status.WAITING
    assert again.prefix_cached_tokens == again.num_prompt_tokens
    rec.run()
    assert again.token_ids == first.token_ids and first.end in (End.STOP, End.LENGTH)


def test_the_engine_s_thread_steps_a_prompt_in_pieces_with_nothing_else_to_do(vlm, chunks):
    """The engine's loop sleeps only when nothing is left to step: a prompt in pieces is neither waiting nor running."""
    engine = QvpicEngine(vlm, EngineConfig(max_prefill_tokens=48))
    context = linked(vlm, chunks[:2], LONG_QUESTION)
    events: queue.Queue = queue.Queue()
    seq = Sequence(Sampling(max_new_tokens=3), context, context.num_prompt_tokens, context.num_query_tokens,
                   emit=events.put)
    engine.add(seq)
    received = []
    while not received or not isinstance(received[-1], Finished):
        received.append(events.get(timeout=60))  # queue.Empty: the loop slept with the prompt half prefilled
    tokens, _ = alone(vlm, context, 3)
    assert received[:-1] == tokens and engine.stats().steps > 3


# ---- the scheduler's share of a step -------------------------------------------------------------------------------
def fake(seq_id: int, tokens: int) -> SimpleNamespace:
    context = SimpleNamespace(online=False, after=SimpleNamespace(image_spans=[]))
    return SimpleNamespace(id=seq_id, context=context, num_prefill_tokens=tokens, num_query_tokens=tokens,
                           num_prompt_tokens=tokens + 8, members=[None], max_columns=tokens + 8)


def test_one_prompt_in_pieces_at_a_time_and_the_short_ones_go_past_the_next():
    scheduler = Scheduler(EngineConfig(max_prefill_tokens=100, max_kv_nbytes=1 << 40), column_nbytes=1)
    first, second, short = fake(1, 500), fake(2, 400), fake(3, 30)
    for seq in (first, second, short):
        scheduler.waiting.append(seq)
    assert scheduler.schedule() == [first, short]  # one long prompt a step; the short one behind the second joins
    assert scheduler.piece_budget() == 70
    scheduler.prefilling = first
    assert scheduler.schedule() == [] and list(scheduler.waiting) == [second]  # waits its turn
    scheduler.waiting.extend([fake(4, 60), fake(5, 20)])
    assert [s.id for s in scheduler.schedule()] == [4]  # whole joins take at most three quarters: 60, not 80
    assert scheduler.piece_budget() == 40 and scheduler.busy
    scheduler.prefilling = None
    assert [s.id for s in scheduler.schedule()] == [2, 5]


def test_attention_makes_a_long_prompt_s_tokens_dearer():
    """Tokens at no context (`per_column` 0) against tokens reading 1,000 columns at the tiny models' 0.0035."""
    scheduler = Scheduler(EngineConfig(max_prefill_tokens=1000, max_kv_nbytes=1 << 40), column_nbytes=1,
                          per_column=1 / 288)
    short, long = fake(1, 300), fake(2, 300)
    long.num_prompt_tokens = 1000  # 300 tokens reading 1,000 columns: 300 × (1 + 1000/288) > 1000
    assert not scheduler.in_pieces(short) and scheduler.in_pieces(long)
    assert Scheduler(EngineConfig(max_prefill_tokens=1000), column_nbytes=1).in_pieces(long) is False  # no attention


def test_a_piece_takes_what_its_budget_pays_for_at_its_widest_column(vlm, chunks):
    _, layout = laid_out(vlm, two_groups(vlm, chunks))
    pieces, per_column = Pieces(None, layout), 0.01
    n = pieces.size(40.0, per_column)
    widest = int(layout.columns[0, 39]) + 1  # the widest the piece could reach with 40 tokens
    assert n == int(40 / (1 + widest * per_column)) and prefill_cost(n, widest, per_column) <= 40
    assert pieces.size(40.0, 0.0) == 40 and pieces.size(0.5, per_column) == 1  # at least one: it always ends


def test_column_cost_is_attention_over_the_layer_s_weights(vlm):
    """The share of a token's work one more column costs: 2·H·hd multiply-adds against the decoder layer's weights,
    counted here from the model's own parameters (not from its config, which `column_cost` reads)."""
    config = vlm.model.config.get_text_config()
    weights = sum(p.numel() for name, p in vlm.model.named_parameters()
                  if "language_model.layers.0." in name and p.dim() == 2)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert column_cost(config) == pytest.approx(2 * config.num_attention_heads * head_dim / weights)


def test_an_online_prefill_is_never_cut():
    scheduler = Scheduler(EngineConfig(max_prefill_tokens=100, max_kv_nbytes=1 << 40), column_nbytes=1)
    online = fake(1, 500)
    online.context.online = True
    imaged = fake(2, 500)
    imaged.context.after.image_spans = [(0, 4, "digest")]
    assert not scheduler.in_pieces(online) and not scheduler.in_pieces(imaged) and scheduler.in_pieces(fake(3, 500))


def test_the_linked_context_counts_every_text_it_forwards(vlm, chunks):
    prompt = two_groups(vlm, chunks)
    context = LinkedContext(prompt)
    assert context.num_query_tokens == sum(t.num_tokens for t in prompt.texts) > len(prompt.after.ids) + 20
