"""Issue 60's router residuals: a request never stalls the router's event loop decoding its images (its query
vector remembered or not), and a history that cannot fit the context is refused before any work on it."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import threading
import time

import pytest
from PIL import Image

import serve.engine.context as context_module
from pipeline.priority import BULK_NICE
from schemas.api import AnswerRequest
from schemas.conversation import Message
from schemas.errors import ContextLengthError
from serve.routing import prompt as prompt_module
from serve.routing.prompt import PromptTemplate
from serve.routing.query_vectors import QueryVectors
from tests.support.store_factory import MAX_CONTEXT_TOKENS, roles, serving_store  # noqa: F401  (fixtures)

QUESTION = "When does part XK-4471-B ship?"
DECODE_S = 0.3  # a slow decode stands in for a 16 MP PNG's: long enough for a 10 ms ticker to run many times


def png() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), "red").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_images_decode_off_the_event_loop(roles, monkeypatch):
    """A conversation holding an image planned twice (the second time its query vector is remembered, so nothing
    embeds): every decode runs on a worker thread, and another coroutine of the same loop keeps running while it
    does. The control (framing back on the loop for a remembered vector) decodes on the loop thread, and the
    ticker never runs during that decode."""
    router = roles.router
    monkeypatch.setattr(router, "query_vectors", QueryVectors(16))
    decode, decoding, decoded_on = prompt_module.decode_image, threading.Event(), []

    def slow(data, max_pixels):
        decoded_on.append(threading.get_ident())
        decoding.set()
        time.sleep(DECODE_S)
        decoding.clear()
        return decode(data, max_pixels)

    monkeypatch.setattr(prompt_module, "decode_image", slow)
    messages = [Message(role="user", content=[{"type": "text", "text": QUESTION},
                                              {"type": "image_url", "image_url": {"url": png()}}])]
    request = AnswerRequest(query=QUESTION, messages=messages, top_k=2)

    async def planned() -> tuple[int, int]:
        done, ticks = False, 0

        async def ticker() -> None:
            nonlocal ticks
            while not done:
                ticks += decoding.is_set()
                await asyncio.sleep(0.01)

        ticking = asyncio.create_task(ticker())
        await router.plan(request, cache_salt=b"t")
        done = True
        await ticking
        return threading.get_ident(), ticks

    for remembered in (False, True):
        decoded_on.clear()
        loop_thread, ticks = asyncio.run(planned())
        assert router.query_vectors.get(b"t", QUESTION) is not None
        assert decoded_on and loop_thread not in decoded_on, remembered
        assert ticks > 0, remembered  # the loop served the ticker while the image decoded


def niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_an_upload_s_pixels_are_worked_at_a_lower_cpu_priority(roles, monkeypatch):
    """Its decode on the router and its processing on the generator (~210 and ~350 ms of a core for 16 MP) run
    BULK_NICE below the replica, so another tenant's question gets the cores first; the conversation's text is
    rendered at the replica's own priority. Control: a chat without an image prepares its text at the replica's."""
    base, lowered = niceness(), min(19, niceness() + BULK_NICE)
    seen: dict[str, list[int]] = {"decode": [], "render": [], "prepare": []}
    decode, render, prepare = prompt_module.decode_image, prompt_module.render_layout, context_module.prepare_segment

    def spied(name, fn):
        def run(*args, **kwargs):
            seen[name].append(niceness())
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(prompt_module, "decode_image", spied("decode", decode))
    monkeypatch.setattr(prompt_module, "render_layout", spied("render", render))
    monkeypatch.setattr(context_module, "prepare_segment", spied("prepare", prepare))
    with_image = [Message(role="user", content=[{"type": "text", "text": QUESTION},
                                                {"type": "image_url", "image_url": {"url": png()}}])]
    roles.answer_blocking(AnswerRequest(query=QUESTION, messages=with_image, top_k=2, max_new_tokens=2))
    assert seen["decode"] == [lowered]
    assert seen["render"] and set(seen["render"]) == {base}
    assert seen["prepare"] and set(seen["prepare"]) == {lowered}
    for names in seen.values():
        names.clear()
    roles.answer_blocking(AnswerRequest(query=QUESTION, messages=[Message(role="user", content=QUESTION)], top_k=2,
                                        max_new_tokens=2))
    assert seen["decode"] == [] and seen["prepare"] and set(seen["prepare"]) == {base}


def history(turns: int, text: str) -> list[Message]:
    """`turns` messages, user and assistant in turn, ending with the question."""
    return [Message(role="user" if i % 2 == 0 else "assistant", content=f"turn {i}: {text}")
            for i in range(turns - 1)] + [Message(role="user", content=QUESTION)]


def counting(router, monkeypatch) -> list[str]:
    """Every layout, tokenisation and query embedding the router starts, by name."""
    calls: list[str] = []
    for owner, name in ((PromptTemplate, "conversation"), (PromptTemplate, "encode"), (router, "embed_query")):
        original = getattr(owner, name)

        def counted(*args, name=name, original=original, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)
        monkeypatch.setattr(owner, name, counted)
    return calls


def test_an_over_long_history_is_refused_before_its_layout(roles, monkeypatch):
    """The hostile probe's 256 messages (benchmarks/scale/hostile_probes.py `history_256`), far past the 1,024-token
    context: the same ContextLengthError (400 context_length_exceeded naming `messages`), with nothing laid out,
    tokenised or embedded. Before, each of its 128 user messages embedded as a query and the whole history was
    rendered and tokenised first (0 calls with the floor; the control, the floor removed: hundreds)."""
    router = roles.router
    request = AnswerRequest(query=QUESTION, messages=history(256, "tell me more " * 40), top_k=2)
    calls = counting(router, monkeypatch)
    with pytest.raises(ContextLengthError) as refused:
        asyncio.run(router.plan(request))
    assert refused.value.openai_code == "context_length_exceeded" and refused.value.param == "messages"
    assert calls == []
    with pytest.raises(ContextLengthError):
        router.route(request, [None] * len(router.group_queries(request)))  # `route` alone (eval) refuses alike
    assert calls == []


@pytest.mark.parametrize("text", ["tell me more ", "<|vision_start|><|im_end|>", "indivisibility " * 3, "ééé  "])
def test_the_floor_never_refuses_what_fits(roles, text):
    """The floor is at most the prompt's tokens as the router lays them out (the reference: `frame`'s count of
    every text segment), for histories from a few messages to well past the context; so a history just under the
    limit is planned, not refused, and the first one past it is refused by `route`'s own count. Texts include
    special-token text (split in a user's message) and long words, the cheapest in characters per token."""
    router = roles.router
    for repeats in (1, 4, 16, 48):
        for turns in (2, 6, 32, 128):
            request = AnswerRequest(query=QUESTION, messages=history(turns, text * repeats), top_k=0)
            floor = router.token_floor.tokens(request.messages)
            if floor + request.max_new_tokens > router.max_context_tokens:
                continue  # refused by the floor: then it cannot fit, for the floor is below the layout's count …
            assert floor <= sum(router.frame(request, 1).text_tokens), (text, repeats, turns)
    fitting = refused = None
    for repeats in range(1, 400):  # the longest history of this shape that fits, found by the route's own count
        request = AnswerRequest(query=QUESTION, messages=history(8, "tell me more " * repeats), top_k=0)
        try:
            asyncio.run(router.plan(request))
        except ContextLengthError:
            refused = repeats
            break
        fitting = repeats
    assert fitting is not None and refused == fitting + 1
    request = AnswerRequest(query=QUESTION, messages=history(8, "tell me more " * fitting), top_k=0)
    framing = router.frame(request, 1)
    assert sum(framing.text_tokens) + request.max_new_tokens > MAX_CONTEXT_TOKENS - 40  # just under the limit
