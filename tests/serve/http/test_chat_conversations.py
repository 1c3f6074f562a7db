"""Conversations on the OpenAI route, without Ray (the in-process roles behind the FastAPI app): system prompts,
history, user images, retrieval per turn, the prefix cache seen through `usage`, and the 400s of bad messages.

Expected values are hand-worked from the request (which chunks a turn names, how many tokens a follow-up's earlier
turns hold) or come from another route of the same server (the native `/v1/answer` over the same messages)."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from tests.serve.http.test_api import app, call, conforms  # noqa: F401  (a fixture)
from tests.support.store_factory import roles, serving_store  # noqa: F401  (fixtures)

NO_CACHE = {"Cache-Control": "no-cache"}  # the model computes every answer (no response cache)
SYSTEM = {"role": "system", "content": "You are a parts clerk. Answer from the documents only, in one line."}


def data_url(color: str = "red", size=(64, 48), fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buffer.getvalue()).decode()}"


def chat(app, messages: list[dict], headers=None, **fields) -> dict:
    body = {"model": "qvpic", "messages": messages, "max_tokens": 6, "temperature": 0, **fields}
    response = call(app, "POST", "/v1/chat/completions", json=body, headers=headers or NO_CACHE)
    assert response.status_code == 200, response.text
    return response.json()


def test_system_history_and_an_image_answer(app):
    messages = [SYSTEM, {"role": "user", "content": "What does invoice 4471 list?"},
                {"role": "assistant", "content": "Part XK-4471-B."},
                {"role": "user", "content": [{"type": "text", "text": "When does it ship? See the photo."},
                                             {"type": "image_url", "image_url": {"url": data_url()}}]}]
    spec = call(app, "GET", "/openapi.json").json()
    completion = chat(app, messages)
    conforms(spec, "ChatCompletion", completion)
    single = chat(app, [{"role": "user", "content": "When does it ship? See the photo."}],
                  qvpic={"retrieval": "none"})
    assert completion["usage"]["prompt_tokens"] > single["usage"]["prompt_tokens"]
    # the question's chunks before it, the earlier question's before that (default_top_k 2 each)
    groups = {c["group"] for c in completion["qvpic"]["chunks"]}
    assert groups == {0, 1} and len({c["chunk_id"] for c in completion["qvpic"]["chunks"]}) >= 2
    native = call(app, "POST", "/v1/answer", headers=NO_CACHE,
                  json={"query": "When does it ship? See the photo.", "messages": messages, "top_k": 2,
                        "max_new_tokens": 6}).json()
    assert native["answer"] == completion["choices"][0]["message"]["content"]


def test_a_follow_up_finds_the_earlier_turn_in_the_prefix_cache(app):
    first_messages = [SYSTEM, {"role": "user", "content": "Which part ships on 12 March?"}]
    first = chat(app, first_messages, max_tokens=24)
    answer = first["choices"][0]["message"]["content"]
    follow_up = first_messages + [{"role": "assistant", "content": answer},
                                  {"role": "user", "content": "And what is the warranty on it?"}]
    second = chat(app, follow_up)
    earlier = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    prefix = second["qvpic"]["usage"]["prefix_cached_tokens"]
    # The answer's text is tokenised again from what the client sent back; with random weights that can split
    # differently from the ids decoded, and the blocks from there on miss: the prompt itself always hits.
    assert prefix >= first["usage"]["prompt_tokens"] - 16
    print(f"follow-up: {prefix} of the earlier turn's {earlier} tokens from the prefix cache; cached {cached}")
    without_history = chat(app, follow_up, qvpic={"history_chunks": False})
    assert len(without_history["qvpic"]["chunks"]) < len(second["qvpic"]["chunks"])


def test_the_prefix_cache_never_crosses_tenants(app):
    """Another tenant's identical follow-up computes its prompt afresh (no block of the first tenant's matches:
    vLLM's CVE-2025-46570 was the timing side channel of such a hit); the first tenant's own repeat hits."""
    messages = [SYSTEM, {"role": "user", "content": "Which part ships on 3 May, and to where?"}]
    owner, other = {**NO_CACHE, "X-Tenant": "prefix-owner"}, {**NO_CACHE, "X-Tenant": "prefix-other"}
    first = chat(app, messages, headers=owner)
    assert first["qvpic"]["usage"]["prefix_cached_tokens"] == 0
    again = chat(app, messages, headers=owner)
    assert again["qvpic"]["usage"]["prefix_cached_tokens"] >= first["usage"]["prompt_tokens"] - 16  # control
    assert chat(app, messages, headers=other)["qvpic"]["usage"]["prefix_cached_tokens"] == 0


def test_retrieval_none_is_plain_chat_and_an_image_alone_retrieves_nothing(app):
    plain = chat(app, [SYSTEM, {"role": "user", "content": "Say hello."}], qvpic={"retrieval": "none"})
    assert plain["qvpic"]["chunks"] == []
    image_only = chat(app, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url()}}]}])
    assert image_only["qvpic"]["chunks"] == []
    named = chat(app, [{"role": "user", "content": "Which part?"}], qvpic={"chunk_ids": ["invoices#00000"]})
    assert [c["chunk_id"] for c in named["qvpic"]["chunks"]] == ["invoices#00000"]


@pytest.mark.parametrize("messages, param, fragment", [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}],
     "messages[0].content[0].image_url", "ingress.image_urls.enabled is off"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!!"}}]}],
     "messages[0].content[0].image_url", "does not decode"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(b"not an image").decode()}}]}],
     "messages[0].content[0].image_url", "does not decode"),
    ([{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": data_url()}}]},
      {"role": "user", "content": "hi"}], "messages[0].content", "user messages only"),
    ([{"role": "system", "content": "be brief"}], "messages", "at least one user message"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}], "messages[1]",
     "continuing an assistant message is not supported"),
    ([{"role": "user", "content": "x" * 200_001}], "messages[0].content", "at most 200000"),
])
def test_bad_messages_are_400_naming_the_field(app, messages, param, fragment):
    response = call(app, "POST", "/v1/chat/completions", json={"model": "qvpic", "messages": messages})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert fragment in error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert len(response.text) < 2_000  # the rejected input is not echoed back


def test_a_conversation_over_the_context_is_openais_400_naming_the_limit(app):
    long_history = [{"role": "user" if i % 2 == 0 else "assistant", "content": "part XK-4471-B ships " * 200}
                    for i in range(9)]
    response = call(app, "POST", "/v1/chat/completions", json={"model": "qvpic", "messages": long_history})
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert "the context holds" in error["message"]
