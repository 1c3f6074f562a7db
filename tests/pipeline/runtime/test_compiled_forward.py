"""The fused forward under torch.compile (pipeline/runtime/compiled.py, `engine.forward.compiled`) against
transformers' own forward of the same checkpoint over the same one-row slab: a conversation's turns (a short one,
one past `SDPA_MIN_NEW`, decode steps), logits and the KV written. Counted so that a graph that never ran fails;
controls: a position off by one and new keys written one column away from their values are caught (moving
keys and values together is no control: attention over the columns a token sees is order-free). Compiling takes
~1-2 minutes on 2 cores, once for the module (marked slow)."""

from __future__ import annotations

import pytest
import torch

from pipeline.runtime import fused as fused_module
from pipeline.runtime.compiled import CompiledForward
from pipeline.runtime.fused import FusedDecoder
from pipeline.runtime.model import VLM
from schemas.config import DType, ForwardSpec, ModelSpec
from serve.engine.qvpic.batch import Slab, forward
from tests.pipeline.runtime.test_fused_forward import (  # the suite's fp32 tolerance; the largest logit gap of two runs
    EXACT,
    gap,
)

pytestmark = pytest.mark.slow
CONTEXT = 37  # columns of random KV before the conversation (linked chunks' stand-in)
TURNS = [12, fused_module.SDPA_MIN_NEW + 9, 1, 1, 5]  # tokens per forward: turns and decode steps


@pytest.fixture(scope="module")
def vlm() -> VLM:
    return VLM(ModelSpec(path="tiny-qwen"))


@pytest.fixture(scope="module")
def compiled(vlm) -> CompiledForward:
    decoder = FusedDecoder(vlm.model, ForwardSpec())
    compiled = CompiledForward(decoder)
    compiled.warm_up(vlm.dtype, vlm.device)
    decoder.compiled = compiled
    return compiled


def one_row(vlm: VLM) -> Slab:
    shape = vlm.prefix.kv  # [layers, 2, kv_heads, tokens, head_dim]
    # no spare column after the last forward (a served prefill's slab is often exactly full), spare ones before
    slab = Slab.empty(shape.shape[0], 1, shape.shape[2], CONTEXT + sum(TURNS), shape.shape[4], vlm.dtype, vlm.device)
    generator = torch.Generator().manual_seed(0)
    slab.kv[:, :, 0, :, :CONTEXT] = torch.randn(shape.shape[0], 2, shape.shape[2], CONTEXT, shape.shape[4],
                                                generator=generator)
    slab.valid[0, :CONTEXT] = True
    slab.lengths[0], slab.next_positions[0] = CONTEXT, 3 * CONTEXT
    return slab.read_back()


@torch.inference_mode()  # as the engine runs it
def conversation(vlm: VLM, decoder: FusedDecoder | None, slab: Slab) -> list[torch.Tensor]:
    vlm.fused = decoder
    try:
        out = []
        for turn, new in enumerate(TURNS):
            ids = torch.arange(new)[None] % 50 + 7 * turn + 3
            out.append(forward(vlm, slab, ids, torch.ones_like(ids, dtype=torch.bool)))
        return out
    finally:
        vlm.fused = None


def counted(compiled: CompiledForward, monkeypatch) -> list[int]:
    """The graph's calls, by new tokens."""
    calls, graph = [], compiled.graph
    monkeypatch.setattr(compiled, "graph", lambda kv, ids, *rest: calls.append(ids.shape[1]) or graph(kv, ids, *rest))
    return calls


def test_the_compiled_forward_equals_transformers(vlm, compiled, monkeypatch):
    reference, ours = one_row(vlm), one_row(vlm)
    expected = conversation(vlm, None, reference)
    calls = counted(compiled, monkeypatch)
    got = conversation(vlm, compiled.decoder, ours)
    # every forward ran the graph but the last, whose slab is full (eager: `CompiledForward.run`); none compiled
    assert calls == TURNS[:-1] and compiled.refused == 0
    assert gap(expected, got) <= EXACT
    assert float((reference.kv - ours.kv).abs().max()) <= EXACT  # the KV written after the graph, every column
    assert torch.equal(reference.valid, ours.valid) and torch.equal(reference.lengths, ours.lengths)


def test_controls_a_shifted_position_and_a_misplaced_write_are_caught(vlm, compiled, monkeypatch):
    expected = conversation(vlm, None, one_row(vlm))
    shifted = one_row(vlm)
    shifted.next_positions += 1  # RoPE Δ+1 on the new tokens only
    assert gap(expected, conversation(vlm, compiled.decoder, shifted)) > 100 * EXACT

    graph = compiled.graph

    def rolled(*args):  # the new keys handed back one column out of their values' place
        logits, written = graph(*args)  # written: [layers, 2, rows, kv_heads, new, head_dim]
        return logits, torch.stack((written[:, 0].roll(1, dims=3), written[:, 1]), dim=1)

    monkeypatch.setattr(compiled, "graph", rolled)
    assert gap(expected, conversation(vlm, compiled.decoder, one_row(vlm))) > 100 * EXACT


def test_a_decode_batch_runs_eagerly_and_equal(vlm, compiled, monkeypatch):
    """Two rows (a decode batch): the eager forward (the graph copies a row's columns each layer, which costs more
    than it saves over many rows), the same numbers."""
    calls = counted(compiled, monkeypatch)
    shape = vlm.prefix.kv
    slabs = [Slab.empty(shape.shape[0], 2, shape.shape[2], 64, shape.shape[4], vlm.dtype, vlm.device) for _ in "ab"]
    for slab in slabs:
        slab.kv[:, :, :, :, :20] = torch.randn(shape.shape[0], 2, 2, shape.shape[2], 20, shape.shape[4],
                                               generator=torch.Generator().manual_seed(1))
        slab.valid[:, :20], slab.lengths[:], slab.next_positions[:] = True, 20, 20
        slab.read_back()
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    with torch.inference_mode():
        vlm.fused = None
        expected = forward(vlm, slabs[0], ids, torch.ones_like(ids, dtype=torch.bool))
        vlm.fused = compiled.decoder
        got = forward(vlm, slabs[1], ids, torch.ones_like(ids, dtype=torch.bool))
        vlm.fused = None
    assert calls == [] and float((expected - got).abs().max()) <= EXACT


def test_new_tokens_around_unwritten_columns_equal_transformers(vlm, compiled, monkeypatch):
    """A linked prompt's text run, then columns left for chunks linked after it, then the question (`Slab.prepare`'s
    explicit columns, as a conversation's follow-up turn has them): the graph takes them, the same numbers."""
    columns = torch.tensor([[CONTEXT, CONTEXT + 1, CONTEXT + 5, CONTEXT + 6, CONTEXT + 7]])
    positions = torch.tensor([[200, 201, 260, 261, 262]])
    ids = torch.tensor([[11, 12, 13, 14, 15]])
    out, calls = [], counted(compiled, monkeypatch)
    for decoder in (None, compiled.decoder):
        slab = one_row(vlm)
        with torch.inference_mode():
            vlm.fused = decoder
            out.append((forward(vlm, slab, ids, torch.ones_like(ids, dtype=torch.bool), columns, positions), slab))
            vlm.fused = None
    (expected, reference), (got, ours) = out
    assert float((expected - got).abs().max()) <= EXACT
    assert float((reference.kv - ours.kv).abs().max()) <= EXACT
    assert calls == [5] and compiled.refused == 0  # the graph ran, and needed no compile


def test_the_spec_refuses_what_the_graph_cannot_run():
    with pytest.raises(ValueError, match="forward.compiled needs"):
        ForwardSpec(compiled=True, matmul_dtype=DType.BFLOAT16)
    with pytest.raises(ValueError, match="forward.compiled needs"):
        ForwardSpec(compiled=True, fused=False)
    glm = VLM(ModelSpec(path="tiny-glm"))  # its decoder is not the Qwen2 one the graph writes out
    with pytest.raises(ValueError, match="forward.compiled"):
        glm.use_forward(ForwardSpec(compiled=True))
