"""`stop`, `logit_bias` and the penalties through the OpenAI route (in-process roles behind the FastAPI app), plain
and streamed. Expected values come from outside the code under test: the same request without the control, cut
with `str.find`; the tokenizer's own decoding of the forced ids; a pattern worked by hand from OpenAI's formula."""

from __future__ import annotations

import json

import pytest

from tests.serve.http.test_api import app, call  # noqa: F401  (a fixture)
from tests.support.store_factory import roles, serving_store  # noqa: F401  (fixtures)

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


def test_logprobs_in_openais_shape(app, roles):
    tokenizer = roles.generator.vlm.tokenizer
    answer = chat(app, max_tokens=5, logprobs=True, top_logprobs=3)
    choice = answer["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == answer["usage"]["completion_tokens"] == 5
    assert "".join(bytes(e["bytes"]).decode("utf-8", "ignore") for e in content) == choice["message"]["content"]
    for entry in content:
        tops = entry["top_logprobs"]
        assert len(tops) == 3 and tops[0]["token"] == entry["token"]  # greedy: the emitted token is the best
        assert tops[0]["logprob"] == pytest.approx(entry["logprob"]) and entry["logprob"] <= 0
        assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
        assert sum(2.718281828 ** t["logprob"] for t in tops) <= 1 + 1e-6
    assert chat(app, max_tokens=2)["choices"][0]["logprobs"] is None  # not asked: none
    ids = [tokenizer.encode(bytes(e["bytes"]).decode("utf-8", "ignore"), add_special_tokens=False) for e in content]
    assert all(ids)


def test_streamed_logprobs_arrive_with_their_text_and_add_up_to_the_whole_answers(app):
    """The stream's entries, joined, are the non-streamed answer's (greedy: the same tokens); they come chunk by
    chunk with the text, not all at the end; with a stop string, the tokens after the cut still come (as the
    whole answer lists them). Control: a stream without logprobs carries none."""
    for extra in ({}, {"stop": "zz-never"}):
        whole = chat(app, max_tokens=12, logprobs=True, top_logprobs=2, **extra)["choices"][0]["logprobs"]["content"]
        body = {"model": "qvpic", "messages": QUESTION, "max_tokens": 12, "temperature": 0, "stream": True,
                "logprobs": True, "top_logprobs": 2, **SELECTION, **extra}
        response = call(app, "POST", "/v1/chat/completions", headers=NO_CACHE, json=body)
        assert response.status_code == 200, response.text
        events = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        carried = [c for e in events for c in e["choices"] if (c.get("logprobs") or {}).get("content")]
        assert [x for c in carried for x in c["logprobs"]["content"]] == whole
        assert len(carried) >= len(whole) // 2  # with the text, not in one lump at the end
    plain = call(app, "POST", "/v1/chat/completions", headers=NO_CACHE, json={**body, "logprobs": False,
                                                                              "top_logprobs": None})
    assert "\"logprobs\": {" not in plain.text


PART_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["part", "ships", "units"],
               "properties": {"part": {"type": "string", "maxLength": 12}, "ships": {"type": "boolean"},
                              "units": {"type": "integer", "minimum": 1, "maximum": 99}}}


def test_response_format_json_schema_gives_valid_json_whatever_the_weights(app):
    """The tiny model's weights are random: without the grammar its answer is not JSON (the control)."""
    import jsonschema

    unconstrained = chat(app, max_tokens=40)["choices"][0]["message"]["content"]
    with pytest.raises(ValueError):
        json.loads(unconstrained)
    fmt = {"type": "json_schema", "json_schema": {"name": "part", "schema": PART_SCHEMA, "strict": True}}
    answer = chat(app, max_tokens=80, response_format=fmt)
    value = json.loads(answer["choices"][0]["message"]["content"])
    jsonschema.validate(value, PART_SCHEMA)
    assert answer["choices"][0]["finish_reason"] == "stop"  # the grammar completed before max_tokens
    deltas, finish = streamed(app, max_tokens=80, response_format=fmt)
    jsonschema.validate(json.loads("".join(deltas)), PART_SCHEMA)
    anything = chat(app, max_tokens=60, response_format={"type": "json_object"})["choices"][0]
    if anything["finish_reason"] == "stop":  # a free object may run past max_tokens; when it ends, it parses
        assert isinstance(json.loads(anything["message"]["content"]), dict)


def test_a_schema_the_grammar_cannot_take_is_400(app):
    body = {"model": "qvpic", "messages": QUESTION, "max_tokens": 4, **SELECTION, "response_format": {
        "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}}}}
    response = call(app, "POST", "/v1/chat/completions", json=body, headers=NO_CACHE)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "response_format"


def test_n_choices_each_as_the_request_with_its_own_seed(app):
    """`n: 3` sampled: three choices, index 0..2, choice i the text of the same request with n = 1 and seed + i
    (the expected values come from three separate requests); usage counts every choice's tokens; greedy choices
    are alike (as OpenAI's and vLLM's)."""
    sampled = dict(temperature=1.1, seed=123, max_tokens=10)
    answer = chat(app, n=3, **sampled)
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    singles = [chat(app, **{**sampled, "seed": 123 + i})["choices"][0] for i in range(3)]
    assert [c["message"]["content"] for c in answer["choices"]] == [s["message"]["content"] for s in singles]
    assert [c["finish_reason"] for c in answer["choices"]] == [s["finish_reason"] for s in singles]
    assert len({c["message"]["content"] for c in answer["choices"]}) > 1  # seeds differ: so do the choices
    one = chat(app, **{**sampled, "seed": 123})
    tokens = [chat(app, **{**sampled, "seed": 123 + i})["usage"]["completion_tokens"] for i in range(3)]
    assert answer["usage"]["completion_tokens"] == sum(tokens)
    assert answer["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]  # one prompt, prefilled once
    greedy = chat(app, n=2, max_tokens=6, logprobs=True)["choices"]
    assert greedy[0]["message"] == greedy[1]["message"] and greedy[0]["logprobs"] == greedy[1]["logprobs"]


def test_n_choices_stream_each_under_its_index(app):
    """Streamed, `n: 3` with logprobs: a role chunk per choice, each choice's deltas (joined) are its non-streamed
    text, its entries its logprobs, one finish chunk per choice; the report rides with the last."""
    fields = dict(n=3, temperature=1.1, seed=123, max_tokens=10, logprobs=True, top_logprobs=1)
    whole = chat(app, **fields)["choices"]
    body = {"model": "qvpic", "messages": QUESTION, **SELECTION, **fields, "stream": True,
            "stream_options": {"include_usage": True}}
    response = call(app, "POST", "/v1/chat/completions", json=body, headers=NO_CACHE)
    assert response.status_code == 200, response.text
    events = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    choices = [c for e in events for c in e["choices"]]
    assert [c["index"] for c in choices if c["delta"].get("role")] == [0, 1, 2]
    for i in range(3):
        mine = [c for c in choices if c["index"] == i]
        assert "".join(c["delta"].get("content") or "" for c in mine) == whole[i]["message"]["content"]
        entries = [x for c in mine for x in (c.get("logprobs") or {}).get("content") or []]
        assert entries == whole[i]["logprobs"]["content"]
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == [whole[i]["finish_reason"]]
    assert [e["qvpic"] is not None for e in events if "qvpic" in e] == [True]
    assert events[-1]["usage"]["completion_tokens"] == chat(app, **fields)["usage"]["completion_tokens"]


def test_n_past_the_limit_is_400_naming_n(app):
    body = {"model": "qvpic", "messages": QUESTION, "max_tokens": 2, **SELECTION, "n": 9}
    response = call(app, "POST", "/v1/chat/completions", json=body, headers=NO_CACHE)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "n", response.json()
