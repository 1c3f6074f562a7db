"""Selective recompute across linked chunks (pipeline/runtime/selective_recompute.py) and its serving path.

The exactness anchor: recomputing every chunk token (leading k ≥ every chunk, or deviation r = 1) on the
assembled context is the full prefill of the same pieces — logits within the exactness suite's tolerance,
greedy tokens identical — on every family. Negative controls: no recompute, and partial recompute,
stay far from it; tokens outside the selection (and the serving prefix) are never touched.
"""

from __future__ import annotations

import asyncio
import math
import random

import pytest
import torch
from pydantic import ValidationError

from jobs import run_server
from pipeline.runtime import chunk_inputs, input_embeddings, recompute
from schemas.api import AnswerRequest
from schemas.config import RecomputeKind, RecomputeSpec
from schemas.errors import UnservableError
from schemas.modes import Mode
from schemas.sampling import Sampling
from serve.config import AppConfig, GeneratorConfig, RouterConfig
from serve.engine import Generator
from serve.kv import LocalLoader
from serve.routing import Router
from tests.pipeline.runtime.test_runtime_exactness import QUERY, TOLERANCE, page, random_text
from tests.support.store_factory import MAX_CHUNKS, MAX_CONTEXT_TOKENS, loader_of, serving_store  # noqa: F401  (fixture)

EVERY_TOKEN = {RecomputeKind.LEADING: RecomputeSpec(kind=RecomputeKind.LEADING, leading_num_tokens=1 << 20),
               RecomputeKind.DEVIATION: RecomputeSpec(kind=RecomputeKind.DEVIATION, deviation_fraction=1.0)}


def pieces_of(seed: int) -> list:
    """Pages (one or two per chunk) and texts, in a random order."""
    rng = random.Random(seed)
    pieces = [[page(rng, rng.randrange(40, 96), rng.randrange(40, 96)) for _ in range(rng.randrange(1, 3))],
              random_text(rng, rng.randrange(4, 12)), [page(rng, 64, 72)]]
    rng.shuffle(pieces)
    return pieces


def linked(vlm, pieces, spec: RecomputeSpec):
    """(prefill state after the query, the assembled context, the report) with `spec`'s recompute."""
    chunks = [vlm.compile_text(p) if isinstance(p, str) else vlm.compile_images(p) for p in pieces]
    context = vlm.assemble(chunks)
    report = recompute(vlm, context, chunks, [chunk_inputs(vlm, p) for p in pieces], spec)
    return vlm.prefill_query(context, QUERY, all_logits=True), context, report, chunks


def max_logit_gap(state, full) -> float:
    num_query = state.logits.shape[1]
    return float((state.logits[0] - full.logits[0, -num_query:]).abs().max())


@pytest.mark.parametrize("kind", list(EVERY_TOKEN))
def test_recomputing_every_token_is_full_prefill(vlm, kind):
    pieces = pieces_of(1)
    full = vlm.prefill_full(pieces, QUERY, all_logits=True)
    state, _, report, chunks = linked(vlm, pieces, EVERY_TOKEN[kind])
    assert report.num_tokens == sum(c.num_tokens for c in chunks)
    assert max_logit_gap(state, full) <= TOLERANCE
    sampling = Sampling(max_new_tokens=8)
    assert vlm.generate(state, sampling) == vlm.generate(vlm.prefill_full(pieces, QUERY), sampling)


def test_no_or_partial_recompute_is_not_full_prefill(vlm):
    """Negative controls: the anchor above can fail, and only full recompute passes it."""
    pieces = pieces_of(1)
    full = vlm.prefill_full(pieces, QUERY, all_logits=True)
    for spec in (RecomputeSpec(), RecomputeSpec(kind=RecomputeKind.LEADING, leading_num_tokens=4),
                 RecomputeSpec(kind=RecomputeKind.DEVIATION, deviation_fraction=0.3)):
        state, *_ = linked(vlm, pieces, spec)
        assert max_logit_gap(state, full) > 100 * TOLERANCE, spec


def test_bf16_full_recompute_lands_within_bf16_noise_of_full_prefill(vlm_bf16):
    """The serving dtype: writes, mask and embeddings in bfloat16. E.g. last-token logits of tiny-qwen / tiny-glm:
    2e-3 / 4e-3 from bf16 full prefill with every token recomputed, 3e-2 / 1.1e-1 without."""
    pieces = pieces_of(1)
    full = vlm_bf16.prefill_full(pieces, QUERY, all_logits=True)
    gaps = {kind: max_logit_gap(linked(vlm_bf16, pieces, spec)[0], full) for kind, spec in
            [(RecomputeKind.NONE, RecomputeSpec()), (RecomputeKind.DEVIATION, EVERY_TOKEN[RecomputeKind.DEVIATION])]}
    assert gaps[RecomputeKind.DEVIATION] < gaps[RecomputeKind.NONE] / 4, gaps


@pytest.mark.parametrize("kind", [RecomputeKind.LEADING, RecomputeKind.DEVIATION])
def test_only_the_selected_tokens_change(vlm, kind):
    """LEADING rewrites (at most) the first k columns of each chunk, DEVIATION ⌈r·n⌉ of each chunk's; the serving
    prefix and every other column keep their cached KV bit for bit, in every layer."""
    pieces = pieces_of(2)
    spec = RecomputeSpec(kind=kind, leading_num_tokens=3, deviation_fraction=0.25)
    chunks = [vlm.compile_text(p) if isinstance(p, str) else vlm.compile_images(p) for p in pieces]
    before = torch.stack([torch.stack([k, v]) for k, v in vlm.assemble(chunks).layers])
    context = vlm.assemble(chunks)
    report = recompute(vlm, context, chunks, [chunk_inputs(vlm, p) for p in pieces], spec)
    after = torch.stack([torch.stack([k, v]) for k, v in context.layers])  # [layers, 2, 1, heads, tokens, dim]
    changed = (after != before).flatten(0, 3).any(0).any(-1)  # [tokens]: any layer, head, channel
    counts = [min(3, c.num_tokens) if kind is RecomputeKind.LEADING else math.ceil(0.25 * c.num_tokens)
              for c in chunks]
    assert report.num_tokens == sum(counts)
    column = context.num_tokens - sum(c.num_tokens for c in chunks)
    assert not changed[:column].any()  # the serving prefix
    for i, (chunk, count) in enumerate(zip(chunks, counts)):
        span = changed[column:column + chunk.num_tokens]
        # The first chunk was compiled after the very prefix it follows here: recomputing it may change no bit.
        assert int(span.sum()) <= count and (i == 0 or span.any())
        if kind is RecomputeKind.LEADING:
            assert not span[count:].any()
        column += chunk.num_tokens


def test_leading_embeddings_encode_only_the_pages_they_need(vlm):
    """The first tokens' embeddings from the first page alone equal those of the whole chunk's forward."""
    rng = random.Random(3)
    inputs = chunk_inputs(vlm, [page(rng, 64, 64), page(rng, 80, 48)])
    everything = input_embeddings(vlm, inputs)
    assert everything.shape[0] == len(inputs.ids)
    for n in (1, 5, len(inputs.ids) - 1):
        assert torch.allclose(input_embeddings(vlm, inputs, n), everything[:n], atol=1e-6)


def test_recompute_refuses_mismatched_sources(vlm):
    chunks = [vlm.compile_text("invoice part ships"), vlm.compile_text("the total is")]
    context = vlm.assemble(chunks)
    spec = EVERY_TOKEN[RecomputeKind.LEADING]
    with pytest.raises(ValueError, match="chunk inputs for 2 chunks"):
        recompute(vlm, context, chunks, [chunk_inputs(vlm, "invoice part ships")], spec)
    with pytest.raises(ValueError, match="its KV entry holds"):
        recompute(vlm, context, chunks, [chunk_inputs(vlm, "invoice"), chunk_inputs(vlm, "the total is")], spec)


def test_spec_is_typed_and_off_by_default():
    assert not RecomputeSpec().enabled and RecomputeSpec(kind="deviation").kind is RecomputeKind.DEVIATION
    for bad in ({"deviation_fraction": 0.0}, {"deviation_fraction": 1.5}, {"leading_num_tokens": 0},
                {"kind": "everything"}, {"fraction": 0.1}):
        with pytest.raises(ValidationError):
            RecomputeSpec(**bad)
    ns = run_server.parser().parse_args(["--store", "/s", "--recompute", "deviation", "--recompute-fraction", "0.3"])
    args = run_server.app_args(ns)
    assert args.generator.recompute == RecomputeSpec(kind=RecomputeKind.DEVIATION, deviation_fraction=0.3)
    assert args.router.carry_sources
    assert not AppConfig(store={"uri": "/s"}).router.carry_sources


def test_serving_with_full_recompute_equals_full_image(serving_store):
    """Through router → loader → generator → engine: qvpic over several chunks with every token recomputed
    gives full_image's logits (first token and every decoded one); without recompute it does not."""
    uri, model = serving_store.uri, serving_store.model
    router = Router(RouterConfig(store=uri, model=model, max_chunks=MAX_CHUNKS, max_context_tokens=MAX_CONTEXT_TOKENS,
                                 carry_sources=True))
    loader = loader_of(uri)
    every = Generator(GeneratorConfig(store=uri, model=model, recompute=EVERY_TOKEN[RecomputeKind.DEVIATION]))
    plain = Generator(GeneratorConfig(store=uri, model=model))

    def logits(generator: Generator, mode: Mode) -> torch.Tensor:
        rows = []
        generator.engine.on_logits = lambda _seq, row: rows.append(row.clone())
        request = AnswerRequest(query=QUERY, doc_ids=["invoices", "manual"], mode=mode, tau=0.6, max_high_res=1,
                                max_new_tokens=6)
        planned = asyncio.run(router.plan(request))
        assert len(planned.chunks) > 1 and all(c.text for c in planned.chunks)
        report = generator.generate_blocking(planned, Sampling(max_new_tokens=6), source=LocalLoader(loader)).report
        assert (report.timings.render_ms > 0) == (mode is Mode.FULL_IMAGE or generator is every)  # pages rendered again
        return torch.stack(rows)

    reference = logits(every, Mode.FULL_IMAGE)
    recomputed = logits(every, Mode.QVPIC)
    assert recomputed.shape == reference.shape and float((recomputed - reference).abs().max()) <= TOLERANCE
    assert float((logits(plain, Mode.QVPIC)[0] - reference[0]).abs().max()) > 100 * TOLERANCE
    # A row with recomputed chunk tokens keeps no final logits (its keys name the stored chunk KV, not the recomputed
    # one); the plain generator's qvpic request does (the control).
    def logits_entries(generator: Generator) -> int:
        assert generator.engine.settle()  # blocks are kept at the engine's next step, after the answer came back
        return sum(len(b.next_positions) == 0 for b in generator.engine.prefix_cache._device.values())
    assert logits_entries(every) == 0 and logits_entries(plain) == 1


def test_recompute_without_carried_sources_is_a_clear_error(serving_store):
    """A generator set to recompute behind a router that does not carry the chunks' text refuses (503)."""
    uri, model = serving_store.uri, serving_store.model
    router = Router(RouterConfig(store=uri, model=model, max_chunks=MAX_CHUNKS, max_context_tokens=MAX_CONTEXT_TOKENS))
    generator = Generator(GeneratorConfig(store=uri, model=model, recompute=EVERY_TOKEN[RecomputeKind.LEADING]))
    planned = asyncio.run(router.plan(AnswerRequest(query=QUERY, chunk_ids=["invoices#00000"], max_new_tokens=2)))
    with pytest.raises(UnservableError, match="carry_sources"):
        generator.generate_blocking(planned, Sampling(max_new_tokens=2), source=LocalLoader(loader_of(uri)))
