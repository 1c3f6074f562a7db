"""What clients send by default (issue 61), through the openai SDK itself against the app (in-process roles): the SDK's
own way to continue a chat (`messages.append(r.choices[0].message.model_dump())`), `null` for optional fields, the
deprecated `functions` / `function_call`, and unknown fields, which stay a 400 naming them (OpenAI's answer).

Expected values come from another request to the same server: the same conversation in the form the server took
before (the README's `model_dump(include={"role", "content"})`, `tools` / `tool_choice`, fields left out)."""

from __future__ import annotations

import httpx
import openai
import pytest

from schemas.chat import ChatCompletionRequest
from tests.serve.http.test_api import app, call  # noqa: F401  (a fixture)
from tests.serve.http.test_openai_params import SyncASGI
from tests.support.store_factory import roles, serving_store  # noqa: F401  (fixtures)

NO_CACHE = {"Cache-Control": "no-cache"}
QVPIC = {"qvpic": {"chunk_ids": ["manual#00000"]}}
FIRST = {"role": "user", "content": "When does part XK-4471-B ship?"}
FOLLOW_UP = {"role": "user", "content": "And the invoice?"}


@pytest.fixture(scope="module")
def client(app):
    return openai.OpenAI(api_key="none", base_url="http://localhost/v1", max_retries=0,
                         http_client=httpx.Client(transport=SyncASGI(app)))


def create(client, messages, extra=None, **fields):
    fields = {"model": "qvpic", "max_tokens": 4, "temperature": 0, **fields}
    return client.chat.completions.create(messages=messages, extra_body={**QVPIC, **(extra or {})},
                                          extra_headers=NO_CACHE, **fields)


def test_the_sdks_own_round_trip_continues_the_chat(client):
    """The openai SDK's examples append the answer's message as it dumps it (`refusal`, `annotations`, `audio`,
    `function_call`: null); the follow-up reads the same prompt as with the README's two-key workaround."""
    first = create(client, [FIRST])
    dumped = first.choices[0].message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call"} <= set(dumped)  # what made it a 400
    echoed = create(client, [FIRST, dumped, FOLLOW_UP])
    workaround = create(client, [FIRST, first.choices[0].message.model_dump(include={"role", "content"}), FOLLOW_UP])
    without = create(client, [FIRST, FOLLOW_UP])  # the answer's turn is read: the prompt is longer than without it
    assert echoed.usage.prompt_tokens == workaround.usage.prompt_tokens > without.usage.prompt_tokens
    assert echoed.choices[0].message.content == workaround.choices[0].message.content


def test_an_echoed_refusal_is_the_assistants_text(client):
    refused = {"role": "assistant", "content": None, "refusal": "I cannot help with that."}
    as_content = {"role": "assistant", "content": "I cannot help with that."}
    assert (create(client, [FIRST, refused, FOLLOW_UP]).usage.prompt_tokens
            == create(client, [FIRST, as_content, FOLLOW_UP]).usage.prompt_tokens)


def test_null_is_the_default_of_every_optional_field(app, client):
    """Every optional field of the request sent as null answers as the request without it (one request, every
    field: a field added later is covered)."""
    optional = [name for name, field in ChatCompletionRequest.model_fields.items() if not field.is_required()]
    assert {"temperature", "top_p", "n", "stream", "presence_penalty", "qvpic"} <= set(optional)
    body = {"model": "qvpic", "messages": [FIRST], "max_tokens": 4, "seed": 7}
    nulls = {name: None for name in optional if name not in body}
    plain = call(app, "POST", "/v1/chat/completions", json=body, headers=NO_CACHE)
    nulled = call(app, "POST", "/v1/chat/completions", json={**body, **nulls}, headers=NO_CACHE)
    assert plain.status_code == nulled.status_code == 200, nulled.text
    assert nulled.json()["choices"] == plain.json()["choices"]
    # the SDK passes an explicit None through as null: temperature=None is the default temperature, 1
    sampled, one = create(client, [FIRST], temperature=None, seed=7), create(client, [FIRST], temperature=1, seed=7)
    assert sampled.choices[0].message.content == one.choices[0].message.content


def test_null_in_messages_and_tool_calls_is_the_default(client):
    call_f = {"id": "call_1", "type": None, "function": {"name": "f", "arguments": None}}
    echoed = {"role": "assistant", "content": None, "name": None, "tool_calls": [call_f]}
    result = {"role": "tool", "tool_call_id": "call_1", "content": "42"}
    spelled = {"role": "assistant", "content": None,
               "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}]}
    assert (create(client, [FIRST, echoed, result]).usage.prompt_tokens
            == create(client, [FIRST, spelled, result]).usage.prompt_tokens)


TOOL = {"name": "lookup", "parameters": {"type": "object", "properties": {"part": {"enum": ["XK-4471-B", "QP-1"]}},
                                         "required": ["part"], "additionalProperties": False}}


def test_functions_and_function_call_are_tools_and_tool_choice(client):
    legacy = create(client, [FIRST], functions=[TOOL], function_call={"name": "lookup"}, max_tokens=64,
                    parallel_tool_calls=False)
    tools = create(client, [FIRST], tools=[{"type": "function", "function": TOOL}],
                   tool_choice={"type": "function", "function": {"name": "lookup"}}, max_tokens=64,
                   parallel_tool_calls=False)
    assert legacy.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in legacy.choices[0].message.tool_calls] == ["lookup"]
    assert legacy.choices[0].message.model_dump(exclude={"tool_calls"}) == tools.choices[0].message.model_dump(
        exclude={"tool_calls"})
    assert ([c.function.model_dump() for c in legacy.choices[0].message.tool_calls]
            == [c.function.model_dump() for c in tools.choices[0].message.tool_calls])


def test_the_deprecated_function_turns_read_as_tool_turns(client):
    legacy = [FIRST, {"role": "assistant", "content": None, "function_call": {"name": "lookup", "arguments": "{}"}},
              {"role": "function", "name": "lookup", "content": "ships Monday"}]
    tool = [FIRST, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_lookup", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_lookup", "name": "lookup", "content": "ships Monday"}]
    a, b = create(client, legacy), create(client, tool)
    assert a.usage.prompt_tokens == b.usage.prompt_tokens
    assert a.choices[0].message.content == b.choices[0].message.content


@pytest.mark.parametrize("fields, param", [
    ({"functions": [TOOL], "tools": [{"type": "function", "function": TOOL}]}, "functions"),
    ({"functions": [TOOL], "function_call": {"name": "other"}}, "function_call"),
    ({"extra": {"foo": 1}}, "foo"),  # unknown fields: OpenAI's 400 naming the field, never silently dropped
    ({"messages": [{**FIRST, "foo": 1}]}, "messages[0].foo"),
    ({"messages": [FIRST, {"role": "assistant", "content": "a", "audio": {"id": 7}}, FOLLOW_UP]},
     "messages[1].audio.id"),
])
def test_what_is_refused_names_its_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as raised:
        create(client, **{"messages": [FIRST], **fields})
    assert raised.value.param == param
