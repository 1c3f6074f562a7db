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
from schemas.config import ModelSpec
from serve.config import RouterConfig
from serve.routing import Router
from tests.store_factory import build_store
from tests.test_chat_templates import fixture_template

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
