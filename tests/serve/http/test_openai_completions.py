"""`POST /v1/completions` (legacy completions) over the in-process roles: a prompt answers as the chat of one user
message does (same engine: a consistency check, with a control that a different prompt renders differently), the
legacy shapes (text, streamed chunks, logprobs), the clients that send it (openai's `completions.create`,
LlamaIndex's `OpenAILike` with its default `is_chat_model=False`), and each refused parameter a 400 naming it."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from schemas.completions import MAX_PROMPTS
from tests.serve.http.test_api import app, call  # noqa: F401  (a fixture)
from tests.serve.http.test_openai_params import SyncASGI
from tests.support.store_factory import roles, serving_store  # noqa: F401  (fixtures)

NO_CACHE = {"Cache-Control": "no-cache"}
PROMPT = "When does part XK-4471-B ship?"
SELECTION = {"qvpic": {"chunk_ids": ["invoices#00000"]}}


def complete(app, **fields) -> dict:
    body = {"model": "qvpic", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, **SELECTION, **fields}
    response = call(app, "POST", "/v1/completions", json=body, headers=NO_CACHE)
    assert response.status_code == 200, response.text
    return response.json()


def chat(app, prompt: str = PROMPT, **fields) -> dict:
    body = {"model": "qvpic", "messages": [{"role": "user", "content": prompt}], "max_tokens": 12,
            "temperature": 0, **SELECTION, **fields}
    response = call(app, "POST", "/v1/chat/completions", json=body, headers=NO_CACHE)
    assert response.status_code == 200, response.text
    return response.json()


def streamed(app, **fields) -> list[dict]:
    body = {"model": "qvpic", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stream": True, **SELECTION,
            **fields}
    response = call(app, "POST", "/v1/completions", json=body, headers=NO_CACHE)
    assert response.status_code == 200, response.text
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_a_prompt_answers_as_the_chat_of_one_user_message(app):
    completion, reference = complete(app), chat(app)
    assert completion["object"] == "text_completion" and completion["id"].startswith("cmpl-")
    choice = completion["choices"][0]
    assert choice["text"] == reference["choices"][0]["message"]["content"] and choice["index"] == 0
    assert choice["finish_reason"] == reference["choices"][0]["finish_reason"]
    for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert completion["usage"][field] == reference["usage"][field], field
    assert [c["chunk_id"] for c in completion["qvpic"][0]["chunks"]] == ["invoices#00000"]
    other = complete(app, prompt="Bake the bread at what temperature, and for how long exactly?")  # control
    assert other["usage"]["prompt_tokens"] != completion["usage"]["prompt_tokens"]
    assert other["usage"]["prompt_tokens"] == chat(app, "Bake the bread at what temperature, and for how long "
                                                        "exactly?")["usage"]["prompt_tokens"]


def test_max_tokens_defaults_to_the_legacy_16(app):
    body = {"model": "qvpic", "prompt": PROMPT, "temperature": 0, **SELECTION}
    answer = call(app, "POST", "/v1/completions", json=body, headers=NO_CACHE).json()
    reference = chat(app, max_tokens=16)  # OpenAI's documented default, not the constant under test
    assert answer["choices"][0]["text"] == reference["choices"][0]["message"]["content"]
    assert answer["usage"]["completion_tokens"] == reference["usage"]["completion_tokens"]
    longer = chat(app, max_tokens=17)  # control: the random-weight model runs past 16 when let
    assert longer["usage"]["completion_tokens"] == 17 and answer["usage"]["completion_tokens"] == 16


def test_a_list_of_prompts_is_one_choice_each_in_order(app):
    prompts = [PROMPT, "Which part ships on 3 April?"]
    answer = complete(app, prompt=prompts)
    singles = [complete(app, prompt=p) for p in prompts]
    assert [c["index"] for c in answer["choices"]] == [0, 1] and len(answer["qvpic"]) == 2
    assert [c["text"] for c in answer["choices"]] == [s["choices"][0]["text"] for s in singles]
    for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert answer["usage"][field] == sum(s["usage"][field] for s in singles), field


def test_n_choices_per_prompt_in_openais_order(app):
    """Two prompts × `n: 2` sampled: index = prompt × n + j, choice j of a prompt the chat answer with seed + j
    (expected from separate chat requests, n = 1)."""
    prompts = [PROMPT, "Which part ships on 3 April?"]
    answer = complete(app, prompt=prompts, n=2, temperature=1.0, seed=5)
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3] and len(answer["qvpic"]) == 2
    expected = [chat(app, p, temperature=1.0, seed=5 + j)["choices"][0]["message"]["content"]
                for p in prompts for j in range(2)]
    assert [c["text"] for c in answer["choices"]] == expected
    events = streamed(app, prompt=prompts, n=2, temperature=1.0, seed=5)
    texts = ["".join(c["text"] for e in events for c in e["choices"] if c["index"] == i) for i in range(4)]
    assert texts == expected
    ends = [c["index"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert sorted(ends) == [0, 1, 2, 3]


def test_stop_ends_the_text_before_it(app):
    text = complete(app, max_tokens=16)["choices"][0]["text"]
    assert len(text) >= 8, text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    stopped = complete(app, max_tokens=16, stop=[stop])
    assert stopped["choices"][0]["text"] == text[:text.find(stop)]
    assert stopped["choices"][0]["finish_reason"] == "stop"
    events = streamed(app, max_tokens=16, stop=stop)
    assert "".join(c["text"] for e in events for c in e["choices"]) == text[:text.find(stop)]


def test_streamed_chunks_are_openais_legacy_shape(app):
    plain = complete(app)
    events = streamed(app, stream_options={"include_usage": True})
    assert {e["object"] for e in events} == {"text_completion"} and len({e["id"] for e in events}) == 1
    texts = [c["text"] for e in events for c in e["choices"]]
    assert "".join(texts) == plain["choices"][0]["text"] and sum(map(bool, texts)) >= 2
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == [plain["choices"][0]["finish_reason"]]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == plain["usage"][
        "completion_tokens"]
    assert "usage" not in events[0]
    two = streamed(app, prompt=[PROMPT, "Which part ships on 3 April?"])
    assert sorted({c["index"] for e in two for c in e["choices"]}) == [0, 1]


def test_logprobs_in_the_legacy_shape(app):
    answer = complete(app, logprobs=2)
    choice, usage = answer["choices"][0], answer["usage"]
    reference = chat(app, logprobs=True, top_logprobs=2)["choices"][0]["logprobs"]["content"]
    legacy = choice["logprobs"]
    assert legacy["tokens"] == [e["token"] for e in reference] and len(legacy["tokens"]) == usage["completion_tokens"]
    assert legacy["token_logprobs"] == [e["logprob"] for e in reference]
    assert legacy["top_logprobs"] == [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in reference]
    assert all(len(top) <= 2 for top in legacy["top_logprobs"])
    offsets = [0]
    for token in legacy["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert legacy["text_offset"] == offsets
    assert "".join(legacy["tokens"]) == choice["text"]
    assert complete(app)["choices"][0]["logprobs"] is None


def test_the_openai_client_completes_plain_and_streamed(app):
    client = openai.OpenAI(api_key="none", base_url="http://localhost/v1",
                           http_client=httpx.Client(transport=SyncASGI(app)))
    reference = complete(app)["choices"][0]["text"]
    result = client.completions.create(model="qvpic", prompt=PROMPT, max_tokens=12, temperature=0,
                                       extra_body=SELECTION, extra_headers=NO_CACHE)
    assert result.object == "text_completion" and result.choices[0].text == reference
    assert result.usage.completion_tokens >= 1
    stream = client.completions.create(model="qvpic", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                       extra_body=SELECTION, extra_headers=NO_CACHE)
    assert "".join(c.choices[0].text for c in stream if c.choices) == reference
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="qvpic", prompt=PROMPT, echo=True)
    assert refused.value.param == "echo"


def test_llamaindex_openailike_completes_by_default(app):
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(model="qvpic", api_base="http://localhost/v1", api_key="unused", max_tokens=12, temperature=0.0,
                     max_retries=0, context_window=1024, http_client=httpx.Client(transport=SyncASGI(app)),
                     additional_kwargs={"extra_body": SELECTION, "extra_headers": NO_CACHE})
    assert not llm.metadata.is_chat_model
    response = llm.complete(PROMPT)
    assert response.text == complete(app)["choices"][0]["text"] and response.text
    assert response.raw.object == "text_completion"


@pytest.mark.parametrize("fields, param", [
    ({"n": 9}, "n"), ({"best_of": 2}, "best_of"), ({"echo": True}, "echo"),
    ({"suffix": "x"}, "suffix"),
    ({"logprobs": 6}, "logprobs"), ({"logprobs": 1, "stream": True}, "logprobs"),
    ({"prompt": [101, 2023]}, "prompt"), ({"prompt": [[101, 2023]]}, "prompt"),
    ({"prompt": ["a"] * (MAX_PROMPTS + 1)}, "prompt"), ({"prompt": []}, "prompt"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"response_format": {"type": "text"}}, "response_format"),
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": 3}, "temperature"),
])
def test_refused_parameters_are_400_naming_them(app, fields, param):
    body = {"model": "qvpic", "prompt": PROMPT, **SELECTION, **fields}
    response = call(app, "POST", "/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_an_unknown_model_is_404(app):
    response = call(app, "POST", "/v1/completions", json={"model": "gpt-3.5-turbo-instruct", "prompt": PROMPT})
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
