"""The batching engine against the batch-1 runtime, both families in float32: every request's logits in a
batch equal the same request run alone (≤1e-5), tokens identical — with requests joining mid-flight,
leaving early, and of different modes in one batch. Plus the caps, cancellation and deadlines."""

from __future__ import annotations

import math
import time

import pytest
import torch
from PIL import Image, ImageDraw
from transformers import DynamicCache

from pipeline.runtime import VLM, reanchor
from pipeline.runtime import kv as kv_module
from pipeline.runtime.conversation import PreparedSegment
from pipeline.runtime.kv import RotationTable, rotation_nbytes
from schemas.config import EngineConfig, ModelFamily
from schemas.errors import BusyError, TooLargeError
from schemas.modes import CompilePrefix
from schemas.sampling import Sampling
from serve.engine.prepared import LinkedContext, OnlineContext
from serve.engine.qvpic import batch
from serve.engine.qvpic import prefill as prefill_module
from serve.engine.qvpic.engine import QvpicEngine, column_nbytes
from serve.engine.qvpic.linked_prompt import native_prompt
from serve.engine.qvpic.scheduler import column_cost, prefill_cost
from serve.engine.sequence import End, Finished, Sequence, Status
from tests.pipeline.runtime.test_reanchor import native

TOLERANCE = 1e-5


def page(text: str, size=(280, 112)) -> Image.Image:
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).text((6, 6), text, fill="black")
    return image


@pytest.fixture(scope="module")
def chunks(vlm):
    return [vlm.compile_images([page("Invoice 4471 ships on 12 March")]),
            vlm.compile_text("The warranty covers two years of normal use."),
            vlm.compile_images([page("Reset: hold ten seconds", (196, 196))]),
            vlm.compile_images([page("Bake at 220 degrees")], CompilePrefix.NONE),
            vlm.compile_text("Part QZ-19 ships on 3 April.")]


def linked(vlm, chunk_list, query: str, instruction: str = "", salt: bytes = b"") -> LinkedContext:
    context = LinkedContext(native_prompt(vlm, list(chunk_list), query, instruction), salt)
    context.instruction, context.query = instruction, query  # what the batch-1 reference builds the prompt from
    return context


def online(vlm, pieces, query: str) -> OnlineContext:
    context = OnlineContext([PreparedSegment(list(vlm.adapter.prefix_ids)), PreparedSegment(vlm.query_turn_ids(query))],
                            [list(pieces)])
    context.query = query
    return context


@torch.inference_mode()
def alone(vlm: VLM, context, max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the logits each was picked from, by the batch-1 runtime (the reference)."""
    if not context.online:  # VLM.prefill_query on the query's token ids
        assembled = vlm.assemble(context.chunks, context.instruction)
        cache = DynamicCache(ddp_cache_data=[(k, v) for k, v in assembled.layers])
        state = vlm._forward(torch.tensor([context.query_ids]), cache, assembled.next_position)
    else:
        state = vlm.prefill_full([p for g in context.groups for p in g], context.query)  # independent of the engine
    logits, cache, position, tokens, seen = state.logits[0, -1], state.cache, state.next_position, [], []
    for step in range(max_new_tokens):
        seen.append(logits)
        token = int(logits.argmax())
        if token in vlm.adapter.end_of_turn_ids:
            break
        tokens.append(token)
        if step + 1 == max_new_tokens:
            break
        out = vlm._forward(torch.tensor([[token]]), cache, position)
        logits, position = out.logits[0, -1], out.next_position
    return tokens, seen


class Recorder:
    """Drives an engine step by step in this thread and keeps what each sequence saw."""

    def __init__(self, vlm: VLM, spec: EngineConfig = EngineConfig()):
        self.logits: dict[int, list[torch.Tensor]] = {}
        self.events: dict[int, list] = {}
        self.engine = QvpicEngine(vlm, spec, start=False,
                                  on_logits=lambda s, row: self.logits[s.id].append(row.clone()))
        self.vlm = vlm

    def submit(self, context, max_new_tokens: int, **fields) -> Sequence:
        # an online context's pages are counted by its prefill: reserve a generous guess here
        num_prompt = self.vlm.prefix.num_tokens + 64 if context.online else context.num_prompt_tokens
        seq = Sequence(Sampling(max_new_tokens=max_new_tokens, **fields), context, num_prompt,
                       context.num_query_tokens, emit=lambda e: None)
        seq.emit = self.events.setdefault(seq.id, []).append
        self.logits[seq.id] = []
        self.engine.add(seq)
        return seq

    def run(self, steps: int | None = None) -> None:
        while self.engine.scheduler.busy:
            self.engine.step()
            if steps is not None:
                steps -= 1
                if steps == 0:
                    return


def test_batched_requests_equal_each_request_alone(vlm, chunks):
    """Different contexts, instructions, lengths and modes in one batch; two requests join mid-flight, one
    is short. Rows whose serving prefixes differ (an instruction, or none) share each forward."""
    rec = Recorder(vlm)
    first = [rec.submit(linked(vlm, chunks[:2], "When does it ship?", "Answer from the documents below."), 8),
             rec.submit(linked(vlm, [chunks[2]], "Hi"), 3),  # leaves early: the others go on without it
             rec.submit(online(vlm, ["Invoice 4471 ships on 12 March.", [page("warranty")]], "When?"), 8),
             rec.submit(linked(vlm, [chunks[3], chunks[0], chunks[4]], "What do the pages say, in full detail?"), 8)]
    rec.run(steps=2)
    assert [s.status for s in first].count(Status.RUNNING) >= 3  # under way when the others join
    later = [rec.submit(linked(vlm, [chunks[4], chunks[1]], "Which part?", "Be brief."), 6),
             rec.submit(online(vlm, ["Be brief.", "Part QZ-19 ships on 3 April."], "Which part ships?"), 5)]
    rec.run()
    worst = 0.0
    for seq in first + later:
        tokens, logits = alone(vlm, seq.context, seq.sampling.max_new_tokens)
        assert seq.token_ids == tokens and [e for e in rec.events[seq.id] if isinstance(e, int)] == tokens
        assert len(rec.logits[seq.id]) == len(logits)
        worst = max([worst] + [float((a - b).abs().max()) for a, b in zip(rec.logits[seq.id], logits)])
        assert rec.events[seq.id][-1] == Finished(seq.end) and seq.end in (End.STOP, End.LENGTH)
    assert worst <= TOLERANCE, worst
    assert rec.engine.slab is None and not rec.engine.scheduler.running  # everyone left, memory freed


def test_logprobs_are_a_full_forwards_log_softmax(vlm, chunks):
    """Each emitted token's log-probability and its top alternatives equal the batch-1 runtime's log-softmax
    (`alone`: a full forward for the online row, the assembled context for the linked ones), batched with others."""
    rec = Recorder(vlm)
    seqs = [rec.submit(linked(vlm, chunks[:2], "When does it ship?"), 6, logprobs=3),
            rec.submit(online(vlm, ["Invoice 4471 ships on 12 March."], "When?"), 5, logprobs=0),
            rec.submit(linked(vlm, [chunks[2]], "Hi"), 4)]  # asks none: gets none
    rec.run()
    for seq in seqs[:2]:
        tokens, logits = alone(vlm, seq.context, seq.sampling.max_new_tokens)
        assert seq.token_ids == tokens and len(seq.token_logprobs) == len(tokens)
        for token, (logprob, top), reference in zip(tokens, seq.token_logprobs, logits):
            expected = torch.log_softmax(reference.float(), -1)
            assert abs(logprob - float(expected[token])) <= TOLERANCE
            best = torch.topk(expected, seq.sampling.logprobs)
            assert [t for t, _ in top] == best.indices.tolist()
            assert [lp for _, lp in top] == pytest.approx(best.values.tolist(), abs=TOLERANCE)
            if top:  # greedy: the emitted token is the best one
                assert top[0][0] == token
    assert seqs[2].token_logprobs == []


def test_a_mask_that_lets_padding_through_breaks_the_equality(vlm, chunks, monkeypatch):
    """Negative control: the same batch with padded columns left visible no longer matches."""
    original = batch.Slab.prepare

    def leaky(self, real, dtype, *explicit):
        positions, mask = original(self, real, dtype, *explicit)
        return positions, torch.zeros_like(mask)  # attend to everything, pads included

    monkeypatch.setattr(batch.Slab, "prepare", leaky)
    rec = Recorder(vlm)
    short = rec.submit(linked(vlm, [chunks[2]], "Hi"), 2)
    rec.submit(linked(vlm, chunks[:3], "When does it ship?"), 2)
    rec.run()
    _, logits = alone(vlm, short.context, 2)
    assert float((rec.logits[short.id][0] - logits[0]).abs().max()) > 1e-3


def test_seeded_sampling_in_a_batch_matches_alone(vlm, chunks):
    sampling = dict(temperature=1.3, top_p=0.9, seed=11)
    rec = Recorder(vlm)
    together = rec.submit(linked(vlm, chunks[:2], "When?"), 6, **sampling)
    rec.submit(linked(vlm, [chunks[4]], "Which part?"), 6)
    rec.run()
    solo = Recorder(vlm)
    by_itself = solo.submit(linked(vlm, chunks[:2], "When?"), 6, **sampling)
    solo.run()
    assert together.token_ids == by_itself.token_ids


def test_cancelled_and_expired_rows_leave_at_the_next_step_and_free_their_kv(vlm, chunks):
    rec = Recorder(vlm)
    keeps = rec.submit(linked(vlm, [chunks[0]], "When?"), 40)
    leaves = rec.submit(linked(vlm, chunks[:3], "When does it ship?"), 40)
    expires = rec.submit(linked(vlm, chunks[1:3], "Why?"), 40)
    rec.run(steps=2)
    full = rec.engine.slab.nbytes
    rec.engine.abort(leaves)
    expires.deadline = time.monotonic()
    rec.run(steps=1)
    assert (leaves.end, expires.end, keeps.status) == (End.CANCELLED, End.DEADLINE, Status.RUNNING)
    assert rec.engine.scheduler.running == [keeps] and rec.engine.slab.num_rows == 1
    assert rec.engine.slab.nbytes < full / 2
    decoded = len(leaves.token_ids)
    rec.run()
    assert len(leaves.token_ids) == decoded and keeps.end is End.LENGTH


def test_caps_hold_and_refusals_are_clear(vlm, chunks):
    per_token = column_nbytes(vlm)
    context = linked(vlm, chunks[:2], "When?")
    columns = vlm.prefix.num_tokens + sum(c.num_tokens for c in chunks[:2]) + len(context.query_ids) + 10 - 1
    spec = EngineConfig(max_batch_size=3, max_kv_nbytes=2 * columns * per_token + per_token, max_waiting=2)
    rec = Recorder(vlm, spec)
    with pytest.raises(TooLargeError, match="max_kv_nbytes"):
        rec.submit(linked(vlm, chunks, "When?"), 2000)
    seqs = [rec.submit(context, 10) for _ in range(2)]
    rec.run(steps=1)
    seqs += [rec.submit(context, 10) for _ in range(2)]  # wait: the KV cap holds two such rows
    with pytest.raises(BusyError) as busy:
        rec.submit(context, 10)
    assert busy.value.headers()["Retry-After"].isdigit()
    widest = 0
    while rec.engine.scheduler.busy:
        rec.engine.step()
        assert len(rec.engine.scheduler.running) <= 2
        widest = max(widest, rec.engine.slab.nbytes if rec.engine.slab is not None else 0)
    assert widest <= spec.max_kv_nbytes and all(s.end in (End.LENGTH, End.STOP) for s in seqs)


def test_the_rotation_table_returns_the_models_matrices_and_computes_each_shift_once(vlm):
    calls = []

    def compute(deltas, head_dim):
        calls.append(deltas.tolist())
        return vlm.adapter.rotation_matrices(deltas, head_dim)

    head_dim = vlm.prefix.kv.shape[-1]
    table = RotationTable(compute, max_nbytes=4 * rotation_nbytes(torch.empty(head_dim, head_dim)))  # 4 entries
    first = table(torch.tensor([5, 900, 5]), head_dim)
    assert torch.equal(first, vlm.adapter.rotation_matrices(torch.tensor([5, 900, 5]), head_dim))
    assert torch.equal(table(torch.tensor([900, 7]), head_dim)[0], first[1])
    assert calls == [[5, 900], [7]]
    table(torch.tensor([1, 2, 3]), head_dim)  # past its bytes: the least recently used (5) goes
    table(torch.tensor([5]), head_dim)
    assert calls[-1] == [5]


@pytest.mark.parametrize("path", ["native kernel", "torch ops"])
def test_rotating_halves_equals_the_matrix_product_for_qwen_and_glm_keeps_the_product(vlm, path):
    """Re-anchoring by per-channel factors (`RotationTable.halves`) is the model's rotation matrix applied, by
    the native kernel and by the torch ops that stand in without a compiler: keys written into a slab's strided
    row equal the matrix product's at shifts from 1 to 12,345 (M-RoPE's sections included: the factors are read
    off the model's matrices); GLM's interleaved pairs have no such factors (they keep the product). Controls:
    the factors swapped, and the factors of Δ against the product of Δ + 1, are both caught."""
    head_dim = vlm.prefix.kv.shape[-1]
    deltas = torch.tensor([1, 2, 37, 1_000, 12_345])
    table = RotationTable(vlm.adapter.rotation_matrices)
    if vlm.family is ModelFamily.GLM4V:  # interleaved pairs: no halves factors, the product stays
        assert table.halves(deltas, head_dim) is None
        return
    rotate = native() if path == "native kernel" else reanchor.rotate_halves_torch
    diag, cross = table.halves(deltas, head_dim)
    keys = torch.randn(2, 3, 50, head_dim)
    slab = torch.full((2, 3, 64, head_dim), float("nan"))  # a wider row: the output is a strided view
    out = slab[:, :, 7:57]
    if path == "native kernel":
        assert rotate.accepts(keys, diag[0], cross[0], out)
    matrices = vlm.adapter.rotation_matrices(torch.cat([deltas, deltas + 1]), head_dim)
    for i in range(len(deltas)):
        rotate(keys, diag[i], cross[i], out)
        expected = keys @ matrices[i]
        assert float((out - expected).abs().max()) <= TOLERANCE
        assert slab[:, :, :7].isnan().all() and slab[:, :, 57:].isnan().all()  # nothing outside the row written
        assert float((out - keys @ matrices[len(deltas) + i]).abs().max()) > 1e-2  # control: Δ + 1
        rotate(keys, cross[i], diag[i], out)  # control: the factors swapped
        assert float((out - expected).abs().max()) > 1e-2


def test_assembly_reanchors_with_the_native_kernel_as_the_matrix_product_does(vlm, chunks):
    """The served assembly (factors, the native kernel where it runs, into a slab row) equals the same assembly
    by the model's matrices, with shifts of either sign up to 12,345; with torch ops only, the same. Control: one
    chunk's Δ off by one."""
    native()
    compiled_at = [chunks[0].compile_start, 0, 12_345, 5_000, 1]  # placed after the prefix: Δ = s_i − these
    moved = [kv_module.ChunkKV(c.kv, c.position_span, at, c.kind) for c, at in zip(chunks, compiled_at)]
    width = vlm.prefix.num_tokens + sum(c.num_tokens for c in moved)
    shape = vlm.prefix.kv.shape

    def assembled(rotations, chunk_list=moved) -> torch.Tensor:
        out = torch.full((shape[0], 2, shape[2], width + 3, shape[4]), float("nan"))
        kv_module.assemble(vlm.prefix, chunk_list, rotations, out)
        return out[:, :, :, :width]

    product = assembled(lambda d, h: vlm.rotations(d, h))  # not a RotationTable: the matrix product
    served = assembled(vlm.rotations)
    with reanchor.torch_ops_only():
        fallback = assembled(vlm.rotations)
    assert not product.isnan().any()
    assert float((served - product).abs().max()) <= TOLERANCE
    assert float((fallback - product).abs().max()) <= TOLERANCE
    off = [kv_module.ChunkKV(c.kv, c.position_span, c.compile_start + (i == 2), c.kind) for i, c in enumerate(moved)]
    assert float((assembled(vlm.rotations, off) - product).abs().max()) > 1e-3  # control: chunk 2's Δ − 1


def test_a_linked_burst_counts_its_texts_not_its_chunks(vlm, chunks):
    context = linked(vlm, chunks[:2], "When?")
    texts = sum(t.num_tokens for t in context.prompt.texts)  # what a join forwards: its chunks' KV is copied
    per_column = column_cost(vlm.model.config.get_text_config())
    budget = math.ceil(5 * prefill_cost(texts, context.num_prompt_tokens, per_column))
    assert context.num_query_tokens == texts  # chunks counted, one a step would be over:
    assert budget < 2 * prefill_cost(context.num_prompt_tokens, context.num_prompt_tokens, per_column)
    rec = Recorder(vlm, EngineConfig(max_prefill_tokens=budget))
    seqs = [rec.submit(context, 4) for _ in range(5)]
    rec.engine.step()
    assert not rec.engine.scheduler.waiting and all(s.status is not Status.WAITING for s in seqs)


def test_a_burst_joins_over_several_steps_within_the_prefill_budget(vlm, chunks):
    context = linked(vlm, chunks[:2], "When?")
    each = prefill_cost(context.num_query_tokens, context.num_prompt_tokens,
                        column_cost(vlm.model.config.get_text_config()))
    rec = Recorder(vlm, EngineConfig(max_prefill_tokens=math.ceil(2 * each)))
    assert 3 * each > rec.engine.config.max_prefill_tokens
    seqs = [rec.submit(context, 4) for _ in range(5)]
    joined = []
    while rec.engine.scheduler.waiting:
        rec.engine.step()
        joined.append(sum(s.status is not Status.WAITING for s in seqs))
    assert joined[:3] == [2, 4, 5]
    rec.run()
    assert len({tuple(s.token_ids) for s in seqs}) == 1  # the same request, joined at different steps


def forked(rec: Recorder, context, max_new_tokens: int, n: int, **fields) -> list[Sequence]:
    """A request of `n` choices as the generator submits it: the leader queued, its forks riding with it."""
    sampling = Sampling(max_new_tokens=max_new_tokens, n=n, **fields)
    members = []
    for i in range(n):
        seq = Sequence(sampling.choice(i), context, context.prompt.num_tokens, len(context.query_ids), emit=None)
        seq.emit = rec.events.setdefault(seq.id, []).append
        rec.logits[seq.id] = []
        members.append(seq)
    members[0].forks = members[1:]
    rec.engine.add(members[0])
    return members


@pytest.mark.parametrize("online_neighbour", [False, True])
def test_n_choices_are_one_prefill_and_each_decodes_as_its_own_request(vlm, chunks, monkeypatch, online_neighbour):
    """n = 3 sampled choices: the prompt's query turn is prefilled once (one row of the batched prefill), and
    choice i's tokens are those of the same request asked alone with n = 1 and seed + i — beside an unrelated row
    (linked, or an online one prefilled alone in the same step), which is unchanged too."""
    rows = []
    real = prefill_module.prefill_queries
    monkeypatch.setattr(prefill_module, "prefill_queries",
                        lambda vlm, bases, *rest: rows.append(len(bases)) or real(vlm, bases, *rest))
    sampling = dict(temperature=1.2, top_p=0.95, seed=40)
    context = linked(vlm, chunks[:2], "When does it ship?")
    rec = Recorder(vlm)
    neighbour = (rec.submit(online(vlm, ["Part QZ-19 ships on 3 April."], "Which?"), 5) if online_neighbour
                 else rec.submit(linked(vlm, [chunks[4]], "Which part?"), 5))
    members = forked(rec, context, 7, 3, **sampling)
    rec.run()
    assert rows == ([1] if online_neighbour else [2])  # the three choices took one prefill row
    for i, seq in enumerate(members):
        solo = Recorder(vlm)
        by_itself = solo.submit(context, 7, **{**sampling, "seed": 40 + i})
        solo.run()
        assert seq.token_ids == by_itself.token_ids, i
        assert seq.end in (End.STOP, End.LENGTH) and rec.events[seq.id][-1] == Finished(seq.end)
    assert len({tuple(s.token_ids) for s in members}) > 1  # seeds differ: so do the choices (a control)
    tokens, _ = alone(vlm, neighbour.context, 5)
    assert neighbour.token_ids == tokens
    assert rec.engine.slab is None and not rec.engine.scheduler.running


def test_n_choices_count_as_n_rows_and_leave_together_when_cancelled(vlm, chunks):
    context = linked(vlm, chunks[:2], "When?")
    per_row = (context.prompt.num_tokens + 10 - 1) * column_nbytes(vlm)
    rec = Recorder(vlm, EngineConfig(max_batch_size=4, max_kv_nbytes=3 * per_row))
    with pytest.raises(TooLargeError, match="max_kv_nbytes"):
        forked(rec, context, 10, 4)  # four rows of its reservation do not fit where three do
    with pytest.raises(TooLargeError, match="max_batch_size"):
        forked(Recorder(vlm, EngineConfig(max_batch_size=2)), context, 10, 3)
    waiting = forked(rec, context, 10, 3)
    rec.engine.abort(waiting[0])  # cancelled before it joined: its forks end with it
    rec.run()
    assert [s.end for s in waiting] == [End.CANCELLED] * 3
    running = forked(rec, context, 10, 3)
    rec.run(steps=2)
    assert len(rec.engine.scheduler.running) == 3
    for seq in running:
        rec.engine.abort(seq)
    rec.run()
    assert all(s.end is End.CANCELLED for s in running) and rec.engine.slab is None


def test_a_request_being_prefilled_counts_as_running(vlm, chunks, monkeypatch):
    """Between the queue and the batch (its prefill), a request is still in flight: `stats` must say so, or a
    caller that waits for the engine to go idle reads its counters before the request has ended (the lifetime
    tests' disconnect race)."""
    rec = Recorder(vlm)
    seen: list[tuple[int, int]] = []
    prefill = QvpicEngine._prefill_linked

    def watched(self, seqs):
        stats = self.stats()
        seen.append((stats.running, stats.waiting))
        return prefill(self, seqs)

    monkeypatch.setattr(QvpicEngine, "_prefill_linked", watched)
    rec.submit(linked(vlm, chunks[:2], "When does it ship?"), 2)
    rec.engine.step()
    assert seen == [(1, 0)]


def test_a_join_where_one_row_ends_at_its_prefill_beside_one_that_goes_on_keeps_every_row(vlm, chunks):
    """Under a mixed load (issue 57): one step admits a request that ends at its prefill (one token) beside one
    that goes on, while another decodes. Each ends well with the tokens it has alone; the one that ended at once
    leaves the slab, the other two keep their rows (a step that raised would fail all three)."""
    rec = Recorder(vlm)
    decoding = rec.submit(linked(vlm, [chunks[0]], "When?"), 6)
    rec.run(steps=1)
    assert decoding.status is Status.RUNNING
    at_once = rec.submit(linked(vlm, [chunks[4]], "Which part?"), 1)
    goes_on = rec.submit(linked(vlm, chunks[:2], "When does it ship?"), 5)
    rec.engine.step()  # both join in this one step
    assert at_once.status is Status.FINISHED and at_once.end is End.LENGTH
    assert goes_on.status is Status.RUNNING and decoding.status is Status.RUNNING
    assert rec.engine.scheduler.running == [decoding, goes_on] and rec.engine.slab.num_rows == 2
    rec.run()
    for seq in (decoding, at_once, goes_on):
        tokens, _ = alone(vlm, seq.context, seq.sampling.max_new_tokens)
        assert seq.token_ids == tokens and seq.end in (End.STOP, End.LENGTH), seq.end
        assert rec.events[seq.id][-1] == Finished(seq.end)
    assert rec.engine.slab is None and not rec.engine.scheduler.running


def test_one_full_prefill_joins_per_step(vlm, chunks):
    """Online requests prefill their whole prompt: one joins a step, so running rows keep decoding between them
    (serve/engine/qvpic/scheduler.py). Three arrive together: one joins at each of three steps."""
    rec = Recorder(vlm)
    seqs = [rec.submit(online(vlm, [f"Part QZ-{i} ships on {i} April."], "Which?"), 4) for i in range(3)]
    joined = []
    for _ in range(3):
        rec.engine.step()
        joined.append(sum(s.status is not Status.WAITING for s in seqs))
    assert joined == [1, 2, 3]
    rec.run()
    assert all(s.end in (End.STOP, End.LENGTH) for s in seqs)


def test_the_kv_cap_counts_the_columns_a_short_query_is_padded_by(vlm, chunks):
    """Linked queries prefilled together are left-padded to the longest: a row with a long context and a short
    query then takes its context, the longest query and its answer. A cap that holds two such rows without the pad
    but not with it admits one at a time, and no slab ever exceeds it."""
    wide = linked(vlm, chunks[:3], "Hi")  # long context, short query
    narrow = linked(vlm, [chunks[1]], "When does the part ship, and to which address, in full?")
    pad = narrow.num_query_tokens - wide.num_query_tokens
    assert pad > 0 and wide.num_prompt_tokens - wide.num_query_tokens > narrow.num_prompt_tokens
    per_token, new_tokens = column_nbytes(vlm), 4
    unpadded = wide.num_prompt_tokens + new_tokens - 1
    cap = 2 * (unpadded + pad // 2) * per_token  # two rows fit unpadded, not padded
    rec = Recorder(vlm, EngineConfig(max_kv_nbytes=cap))
    first, second = rec.submit(wide, new_tokens), rec.submit(narrow, new_tokens)
    rec.engine.step()
    assert (first.status, second.status) == (Status.RUNNING, Status.WAITING)
    while rec.engine.scheduler.busy:
        rec.engine.step()
        assert rec.engine.slab is None or rec.engine.slab.nbytes <= cap
    assert first.end in (End.STOP, End.LENGTH) and second.end in (End.STOP, End.LENGTH)


def test_every_choice_of_a_structured_answer_is_constrained(vlm, chunks):
    """n = 3 sampled choices of a JSON-object answer: each fork gets its own grammar, not only the one queued (the
    random weights would otherwise start almost any token: "{" is 1 of the vocabulary) — compiled once for the
    request and copied to each fork (a schema's compile is the costly part: issue 60), not once per choice."""
    from schemas.api import AnswerRequest

    grammar = AnswerRequest(query="q", top_k=1, response_format={"type": "json_object"}).grammar_text
    rec = Recorder(vlm)
    grammars = rec.engine.sampler.grammars
    compiled, compile_ = [], grammars.matcher
    grammars.matcher = lambda lark, param: compiled.append(lark) or compile_(lark, param)
    members = forked(rec, linked(vlm, chunks[:2], "When?"), 6, 3, temperature=1.3, seed=5, grammar=grammar)
    rec.run()
    assert compiled == [grammar]
    assert len({id(s.grammar) for s in members}) == 3  # each choice its own matcher's state
    texts = [vlm.tokenizer.decode(s.token_ids) for s in members]
    assert len(set(texts)) > 1 and all(t.lstrip().startswith("{") for t in texts), texts
