"""LLaVA-OneVision's images-first order where it is used: `Router.plan` on a store compiled by a tiny-llava checkpoint
carrying the real template (issue 38: replacing the `images_first` condition in serve/routing/router.py with
`if False` left every template test green, since those built the prompt with their own helper).

Expected values are worked by hand from the template (every image of a turn, then its text): with pages in context
the instruction moves after them, to the front of the text prefilled after the chunks; in a text mode nothing moves.
"""

from __future__ import annotations

import asyncio

import pytest

from pipeline.runtime import VLM, Embedder
from pipeline.runtime.tiny import build
from schemas.api import AnswerRequest
from schemas.config import HybridSpec, ModelSpec
from serve.config import RouterConfig
from serve.routing import Router
from tests.pipeline.runtime.test_chat_templates import fixture_template
from tests.support.store_factory import build_store

INSTRUCTION = "Answer from the pages below.\n"
QUERY = "Which part ships on 12 March?"
IDS = ["manual#00001", "invoices#00000"]  # named in this order: the plan keeps it (no retrieval reorders)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava-router")
    path = build("tiny-llava", root / "checkpoint", chat_template=fixture_template("llava_onevision"))
    spec = ModelSpec(path=str(path), device="cpu")
    vlm = VLM(spec)
    assert vlm.adapter.template.images_first  # the real template, read from the checkpoint
    store = build_store(root / "store", vlm, Embedder())
    router = Router(RouterConfig(store=store.uri, model=spec, max_chunks=8))
    yield vlm, router
    router.close()


def plan(router: Router, **fields):
    request = AnswerRequest(query=QUERY, instruction=INSTRUCTION, chunk_ids=IDS, **fields)
    return asyncio.run(router.plan(request))


def test_pages_put_the_instruction_after_them(llava):
    vlm, router = llava
    planned = plan(router, mode="qvpic")
    assert [c.chunk_id for c in planned.chunks] == IDS and all(c.tier is not None for c in planned.chunks)
    assert planned.instruction == "" and planned.query_prompt == INSTRUCTION + QUERY
    # the text before the chunks is the chat prefix alone; the instruction's tokens are counted after them
    assert planned.prefix_tokens == len(vlm.adapter.prefix_ids)
    assert planned.query_tokens == len(vlm.query_turn_ids(INSTRUCTION + QUERY))


def test_text_chunks_leave_the_instruction_where_it_was(llava):
    """Control: no page in context, so the template has no image to move the text behind."""
    vlm, router = llava
    planned = plan(router, mode="text_pic")
    assert [c.chunk_id for c in planned.chunks] == IDS and all(c.tier is None for c in planned.chunks)
    assert planned.instruction == INSTRUCTION and planned.query_prompt is None
    assert planned.prefix_tokens == len(vlm.adapter.prefix_ids) + len(vlm.adapter.encode(INSTRUCTION))


def test_a_conversation_puts_its_pages_before_its_text_chunks(llava):
    """The chat path (issue 57: its branch in `Router.group` was unguarded): in one user turn the template renders
    every image, then the text, so with the hybrid rule serving one chunk as text and one as pages, the pages come
    first whatever the request's order. The rule's ratio is set between the two chunks' own text/page ratios, so
    exactly the chunk named first is text; the expected order (pages, then text) is the template's, by hand."""
    vlm, router = llava
    ratios = {}
    for chunk_id in IDS:  # each chunk's text tokens over its lowest-tier pages' (what rule 1 compares)
        as_text = asyncio.run(router.plan(AnswerRequest(query=QUERY, chunk_ids=[chunk_id], mode="text_pic")))
        as_pages = asyncio.run(router.plan(AnswerRequest(query=QUERY, chunk_ids=[chunk_id], mode="image_pic")))
        ratios[chunk_id] = as_text.chunks[0].num_tokens / as_pages.chunks[0].num_tokens
    first, second = sorted(IDS, key=ratios.get)  # `first` turns to text at a ratio `second` does not
    assert ratios[first] < ratios[second]
    config = router.config.model_copy(update={"defaults": router.config.defaults.model_copy(update={
        "hybrid": HybridSpec(enabled=True, text_cost_ratio=(ratios[first] + ratios[second]) / 2)})})
    hybrid = Router(config)
    try:
        messages = [{"role": "user", "content": QUERY}]
        planned = asyncio.run(hybrid.plan(AnswerRequest(query=QUERY, messages=messages, chunk_ids=[first, second],
                                                        mode="qvpic")))
    finally:
        hybrid.close()
    assert [(c.chunk_id, c.tier is None) for c in planned.chunks] == [(second, False), (first, True)]
