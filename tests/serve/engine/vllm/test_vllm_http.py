"""The HTTP surfaces on vLLM's engine: `/v1/answer`, chat completions (whole and streamed, through the openai SDK
too), legacy completions and usage's cached tokens answer as on qvpic's engine, over the same store; json_object
answers JSON.

Runs where vLLM imports (`make test-vllm`); skipped elsewhere.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm
NO_CACHE = {"Cache-Control": "no-cache"}  # the response cache would answer the second engine from the first's
QUESTION = "When does part XK-4471-B ship?"
SELECTION = {"qvpic": {"chunk_ids": ["invoices#00000", "manual#00001"]}}


@pytest.fixture(scope="module")
def apps(stacks):
    return [s.api() for s in stacks]


def call(app, path: str, body: dict) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as client:
            return await client.post(path, json=body, headers=NO_CACHE)
    return asyncio.run(go())


def both(apps, path: str, body: dict) -> list[httpx.Response]:
    return [call(app, path, body) for app in apps]


def chat_body(**fields) -> dict:
    return {"model": "qvpic", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 10,
            "temperature": 0, **SELECTION, **fields}


def test_chat_answers_as_on_qvpics_engine(apps):
    on_qvpic, on_vllm = (r.json() for r in both(apps, "/v1/chat/completions", chat_body()))
    assert on_vllm["choices"][0]["message"]["content"] == on_qvpic["choices"][0]["message"]["content"]
    assert on_vllm["choices"][0]["finish_reason"] == on_qvpic["choices"][0]["finish_reason"]
    assert on_vllm["usage"]["prompt_tokens"] == on_qvpic["usage"]["prompt_tokens"]
    cached = on_vllm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < on_vllm["usage"]["prompt_tokens"]  # the chunks' KV came from the store, the query did not


def test_streamed_chat_is_the_whole_answer_in_pieces(apps):
    whole = call(apps[1], "/v1/chat/completions", chat_body()).json()["choices"][0]["message"]["content"]
    response = call(apps[1], "/v1/chat/completions", chat_body(stream=True))
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    pieces = [json.loads(line)["choices"][0]["delta"].get("content") or "" for line in lines[:-1]
              if json.loads(line)["choices"]]
    assert "".join(pieces) == whole and len([p for p in pieces if p]) > 1


def test_legacy_completions_and_answer_as_on_qvpics_engine(apps):
    body = {"model": "qvpic", "prompt": QUESTION, "max_tokens": 10, "temperature": 0, **SELECTION}
    on_qvpic, on_vllm = (r.json() for r in both(apps, "/v1/completions", body))
    assert on_vllm["choices"][0]["text"] == on_qvpic["choices"][0]["text"]
    answer = {"query": QUESTION, "chunk_ids": SELECTION["qvpic"]["chunk_ids"], "max_new_tokens": 10}
    on_qvpic, on_vllm = (r.json() for r in both(apps, "/v1/answer", answer))
    assert on_vllm["answer"] == on_qvpic["answer"]


def test_the_openai_sdk_reads_it(apps):
    import openai

    from tests.serve.http.test_openai_params import SyncASGI

    client = openai.OpenAI(api_key="none", base_url="http://localhost/v1",
                           http_client=httpx.Client(transport=SyncASGI(apps[1]), base_url="http://localhost"))
    reply = client.chat.completions.create(model="qvpic", messages=[{"role": "user", "content": QUESTION}],
                                           max_tokens=10, temperature=0, extra_body=SELECTION,
                                           extra_headers=NO_CACHE)
    expected = call(apps[0], "/v1/chat/completions", chat_body()).json()["choices"][0]["message"]["content"]
    assert reply.choices[0].message.content == expected


def test_json_object_answers_json_over_http(apps):
    response = call(apps[1], "/v1/chat/completions", chat_body(max_tokens=48, response_format={"type": "json_object"}))
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and isinstance(json.loads(choice["message"]["content"]), dict)


def test_a_follow_up_turn_answers_as_on_qvpics_engine(apps):
    """A conversation's second turn: the history is text before the chunks (vLLM's prefix cache may hold its full
    blocks; the connector supplies the rest of it and the chunks), the question after them."""
    first = call(apps[0], "/v1/chat/completions", chat_body()).json()["choices"][0]["message"]["content"]
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": first},
                {"role": "user", "content": "And what does the warranty exclude?"}]
    on_qvpic, on_vllm = (r.json() for r in both(apps, "/v1/chat/completions", chat_body(messages=messages)))
    assert on_vllm["choices"][0]["message"]["content"] == on_qvpic["choices"][0]["message"]["content"]
    assert on_vllm["usage"]["prompt_tokens"] == on_qvpic["usage"]["prompt_tokens"]


def test_a_retrieving_conversation_answers_on_vllm_with_its_history_as_text(apps, stacks):
    """A chat that retrieves (no chunks named) over three messages: on vLLM's engine the earlier user message
    retrieves nothing (router.history_chunks follows the engine), so the plan has one group and the answer is a 200,
    not the 400 an engine that cannot take a second group would give."""
    assert not stacks[1].config.router.history_chunks and stacks[0].config.router.history_chunks
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "On 12 March."},
                {"role": "user", "content": "And what does the warranty exclude?"}]
    body = {"model": "qvpic", "messages": messages, "max_tokens": 6, "temperature": 0}
    response = call(apps[1], "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    assert {c["group"] for c in response.json()["qvpic"]["chunks"]} == {0}
