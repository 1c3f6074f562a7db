"""`stop`, `logit_bias` and the penalties through the OpenAI route (in-process roles behind the FastAPI app), plain
and streamed. Expected values come from outside the code under test: the same request without the control, cut
with `str.find`; the tokenizer's own decoding of the forced ids; a pattern worked by hand from OpenAI's formula."""

from __future__ import annotations

import json

import pytest

from tests.store_factory import roles, serving_store  # noqa: F401  (fixtures)
from tests.test_api import app, call  # noqa: F401  (a fixture)

NO_CACHE = {"Cache-Control": "no-cache"}
QUESTION = [{"role": "user", "content": "When does part XK-4471-B ship?"}]
SELECTION = {"qvpic": {"chunk_ids": ["manual#00000"]}}


def chat(app, **fields) -> dict:
    body = {"model": "qvpic", "messages": QUESTION, "max_tokens": 16, "temperature": 0, **SELECTION, **fields}
    response = call(app, "POST", "/v1/chat/completions", json=body, headers=NO_CACHE)
    assert response.status_code == 200, response.text
    return response.json()


def streamed(app, **fields) -> tuple[list[str], str]:
    body = {"model": "qvpic", "messages": QUESTION, "max_tokens": 16, "temperature": 0, "stream": True,
            **SELECTION, **fields}
    response = call(app, "POST", "/v1/chat/completions", json=body, headers=NO_CACHE)
    assert response.status_code == 200, response.text
    events = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [c["delta"].get("content") or "" for e in events for c in e["choices"]]
    finish = [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")]
    return deltas, finish[-1]


def test_stop_ends_the_answer_before_the_stop_string(app):
    full = chat(app)
    text = full["choices"][0]["message"]["content"]
    assert full["usage"]["completion_tokens"] == 16 and len(text) >= 8, text
    stop = text[len(text) // 2:len(text) // 2 + 3]  # three characters from the middle: likely across tokens
    cut = text[:text.find(stop)]
    stopped = chat(app, stop=["never-appears", stop])
    assert stopped["choices"][0]["message"]["content"] == cut
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] < 16  # decoding stopped at the match
    deltas, finish = streamed(app, stop=stop)
    assert "".join(deltas) == cut and finish == "stop"
    shown = ""
    for delta in deltas:  # a stream never shows a stop string's beginning ahead of the cut
        shown += delta
        assert cut.startswith(shown)


def test_logit_bias_forces_and_bans_tokens(app, roles):
    tokenizer = roles.generator.vlm.tokenizer
    forced = tokenizer.encode(" ship", add_special_tokens=False)[0]
    answer = chat(app, max_tokens=5, logit_bias={str(forced): 100})
    assert answer["choices"][0]["message"]["content"] == tokenizer.decode([forced] * 5)
    greedy = chat(app, max_tokens=1)["choices"][0]["message"]["content"]
    first = tokenizer.encode(greedy, add_special_tokens=False)[0]
    banned = chat(app, max_tokens=1, logit_bias={str(first): -100})["choices"][0]["message"]["content"]
    assert banned != greedy


def test_frequency_penalty_alternates_two_forced_tokens(app, roles):
    """Tokens a and b both +100 (everything else is ~100 below): greedy takes the better one each step. With
    frequency_penalty 2, each use costs 2, so — as long as the model's own a/b gap stays under 2 — the answer
    alternates a and b: after a, b leads by 2 - gap, and so on (worked by hand from OpenAI's formula)."""
    tokenizer = roles.generator.vlm.tokenizer
    a, b = (tokenizer.encode(w, add_special_tokens=False)[0] for w in (" alpha", " beta"))
    bias = {str(a): 100, str(b): 100}
    ids = tokenizer.encode(chat(app, max_tokens=8, logit_bias=bias, frequency_penalty=2.0)["choices"][0]
                           ["message"]["content"], add_special_tokens=False)
    assert set(ids) == {a, b} and all(x != y for x, y in zip(ids, ids[1:])), ids
    presence = tokenizer.encode(chat(app, max_tokens=8, logit_bias=bias, presence_penalty=2.0)["choices"][0]
                                ["message"]["content"], add_special_tokens=False)
    assert set(presence) == {a, b}  # both used: the first pays its presence once, then the other leads


@pytest.mark.parametrize("fields, param", [
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"999999999": 1}}, "logit_bias"),  # past the vocabulary: known only to the generator
    ({"presence_penalty": 2.5}, "presence_penalty"),
])
def test_bad_controls_are_400_naming_the_field(app, fields, param):
    body = {"model": "qvpic", "messages": QUESTION, "max_tokens": 2, **SELECTION, **fields}
    response = call(app, "POST", "/v1/chat/completions", json=body, headers=NO_CACHE)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()
