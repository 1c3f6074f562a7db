"""`/v1/responses` (issue 61): through the openai SDK's own `responses.create` / `responses.stream` against the app
(in-process roles, two API keys), its objects checked against the SDK's types (`openai.types.responses`).

Expected values come from outside the route: the equivalent chat completion's `prompt_tokens` (the same
conversation sent as chat messages, which the chat route renders), the tool's own JSON Schema (`jsonschema`), and
the SDK's parsers of the shapes."""

from __future__ import annotations

import json
import typing

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from serve.governance import key_digest
from tests.serve.governance.test_budget import governed_app
from tests.serve.http.test_api import call
from tests.serve.http.test_chat_conversations import data_url
from tests.serve.http.test_metrics import samples
from tests.serve.http.test_openai_params import SyncASGI
from tests.support.store_factory import roles, serving_store  # noqa: F401  (fixtures)

KEYS = {"acme": "key-acme-1", "globex": "key-globex-1"}
NO_CACHE = {"Cache-Control": "no-cache"}
QVPIC = {"qvpic": {"chunk_ids": ["manual#00000"]}}
QUESTION = "When does part XK-4471-B ship?"
WEATHER = {"type": "function", "name": "get_weather", "description": "The forecast for a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city", "days"], "additionalProperties": False}, "strict": True}
SHIP = {"type": "function", "name": "ship_date", "parameters": {
    "type": "object", "properties": {"part": {"type": "string", "enum": ["XK-4471-B", "QP-1"]}}, "required": ["part"]}}
VERDICT = {"type": "object", "properties": {"ships": {"type": "boolean"}}, "required": ["ships"],
           "additionalProperties": False}
# the SDK's stream event classes by their `type`
EVENT_TYPES = {typing.get_args(c.model_fields["type"].annotation)[0]: c
               for c in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}
JSON_FORMAT = {"format": {"type": "json_schema", "name": "verdict", "schema": VERDICT, "strict": True}}


@pytest.fixture(scope="module")
def app(roles, serving_store):
    return governed_app(roles, serving_store, auth={"api_key_sha256": {key_digest(k): t for t, k in KEYS.items()}})[0]


def sdk(app, tenant: str = "acme") -> openai.OpenAI:
    return openai.OpenAI(api_key=KEYS[tenant], base_url="http://localhost/v1", max_retries=0,
                         http_client=httpx.Client(transport=SyncASGI(app)))


@pytest.fixture(scope="module")
def client(app):
    return sdk(app)


def create(client, **fields) -> Response:
    fields = {"model": "qvpic", "max_output_tokens": 8, "temperature": 0, "input": QUESTION, **fields}
    return client.responses.create(extra_body=QVPIC, extra_headers=NO_CACHE, **fields)


def raw(app, method: str, path: str, tenant: str | None = "acme", **kwargs) -> httpx.Response:
    headers = {**NO_CACHE, **({"Authorization": f"Bearer {KEYS[tenant]}"} if tenant else {})}
    return call(app, method, path, headers=headers, **kwargs)


def chat_prompt_tokens(app, messages: list[dict], **fields) -> int:
    body = {"model": "qvpic", "messages": messages, "max_tokens": 1, **QVPIC, **fields}
    response = raw(app, "POST", "/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens"]


def test_a_text_input_answers_as_the_sdks_response_with_chats_usage(app, client):
    response = create(client, instructions="Answer briefly.")
    Response.model_validate(response.model_dump(by_alias=True))  # every field the SDK's type requires, of its type
    assert response.object == "response" and response.id.startswith("resp_") and response.model == "qvpic"
    assert response.output[0].type == "message" and response.output_text == response.output[0].content[0].text
    expected = chat_prompt_tokens(app, [{"role": "system", "content": "Answer briefly."},
                                        {"role": "user", "content": QUESTION}])
    assert response.usage.input_tokens == expected  # the instructions were read, as a system message
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert 0 < response.usage.output_tokens <= 8
    # the linked chunk's KV came from the store: cached, and part of the prompt only
    assert 0 < response.usage.input_tokens_details.cached_tokens < response.usage.input_tokens
    if response.usage.output_tokens == 8:  # cut at max_output_tokens, as OpenAI reports it
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"


def test_input_items_read_as_the_chat_messages_they_stand_for(app, client):
    call_ = {"type": "function_call", "call_id": "call_1", "name": "ship_date", "arguments": "{\"part\": \"QP-1\"}"}
    items = [{"role": "developer", "content": "You answer from the manual."},
             {"type": "message", "role": "user", "content": [
                 {"type": "input_text", "text": QUESTION},
                 {"type": "input_image", "image_url": data_url(), "detail": "auto"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
             call_, {"type": "function_call_output", "call_id": "call_1", "output": "12 March"}]
    messages = [{"role": "developer", "content": "You answer from the manual."},
                {"role": "user", "content": [{"type": "text", "text": QUESTION},
                                             {"type": "image_url", "image_url": {"url": data_url()}}]},
                {"role": "assistant", "content": "Let me look.", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "ship_date",
                                                                       "arguments": "{\"part\": \"QP-1\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12 March"}]
    response = create(client, input=items, tools=[SHIP])
    chat_tools = [{"type": "function", "function": {k: v for k, v in SHIP.items() if k != "type"}}]
    assert response.usage.input_tokens == chat_prompt_tokens(app, messages, tools=chat_tools)


def valid_call(item, tool: dict) -> dict:
    assert item.type == "function_call" and item.call_id.startswith("call_") and item.id.startswith("fc_")
    assert item.name == tool["name"]
    arguments = json.loads(item.arguments)
    jsonschema.validate(arguments, tool["parameters"])
    return arguments


def test_required_and_named_tool_choices_give_function_call_items(client):
    forced = create(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_output_tokens=64)
    assert forced.status == "completed" and [item.type for item in forced.output] == ["function_call"]
    valid_call(forced.output[0], WEATHER)
    named = create(client, tools=[WEATHER, SHIP], tool_choice={"type": "function", "name": "ship_date"},
                   max_output_tokens=64)
    calls = [item for item in named.output if item.type == "function_call"]
    assert calls and all(valid_call(item, SHIP) for item in calls)


def test_text_format_json_schema_constrains_the_answer(client):
    response = create(client, text=JSON_FORMAT, max_output_tokens=32)
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), VERDICT)
    assert response.text.format.type == "json_schema"  # echoed as OpenAI echoes it


def test_the_stream_is_the_event_sequence_the_sdk_accumulates(client):
    whole = create(client, text=JSON_FORMAT, max_output_tokens=32)
    with client.responses.stream(model="qvpic", input=QUESTION, text=JSON_FORMAT, max_output_tokens=32,
                                 temperature=0, extra_body=QVPIC, extra_headers=NO_CACHE) as stream:
        events = list(stream)
        final = stream.get_final_response()
    for event in events:  # each one valid as the SDK's own type of its kind
        dumped = event.model_dump(by_alias=True, exclude={"snapshot", "parsed"}, warnings=False)
        EVENT_TYPES[event.type].model_validate(dumped)
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1 and kinds == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * deltas, "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == text == whole.output_text  # greedy: the same answer as the whole response's
    assert final.usage.input_tokens == whole.usage.input_tokens and final.usage.input_tokens_details.cached_tokens > 0


def test_a_streamed_tool_call_is_a_function_call_item(client):
    with client.responses.stream(model="qvpic", input=QUESTION, tools=[WEATHER], tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=64, temperature=0,
                                 extra_body=QVPIC, extra_headers=NO_CACHE) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.output_text.delta" not in kinds  # the call is never shown as text
    assert kinds[2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [item.type for item in final.output] == ["function_call"]
    valid_call(final.output[0], WEATHER)


def test_stored_responses_continue_and_are_read_and_deleted(app, client):
    first = create(client)
    follow = create(client, previous_response_id=first.id, input="And the invoice?")
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "And the invoice?"}]
    assert follow.usage.input_tokens == chat_prompt_tokens(app, messages)  # the first turn and its answer were read
    assert follow.previous_response_id == first.id
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text and got.usage == first.usage
    client.responses.delete(first.id)
    for gone in (raw(app, "GET", f"/v1/responses/{first.id}"), raw(app, "DELETE", f"/v1/responses/{first.id}"),
                 raw(app, "POST", "/v1/responses", json={"model": "qvpic", "input": "hi",
                                                          "previous_response_id": first.id})):
        assert gone.status_code == 404 and first.id in gone.json()["error"]["message"], gone.text
    unstored = create(client, store=False)
    assert raw(app, "GET", f"/v1/responses/{unstored.id}").status_code == 404


def test_another_tenants_stored_response_is_a_404(app, client):
    mine = create(client)
    theirs = sdk(app, "globex")
    for attempt in (lambda: theirs.responses.retrieve(mine.id), lambda: theirs.responses.delete(mine.id),
                    lambda: create(theirs, previous_response_id=mine.id)):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert client.responses.retrieve(mine.id).output_text == mine.output_text  # their DELETE removed nothing
    assert raw(app, "GET", f"/v1/responses/{mine.id}", tenant=None).status_code == 401
    assert raw(app, "POST", "/v1/responses", tenant=None, json={"model": "qvpic", "input": "hi"}).status_code == 401


def test_the_route_is_governed_under_its_own_label(app, client):
    before = raw(app, "GET", "/metrics").text
    create(client)
    assert samples(raw(app, "GET", "/metrics").text, "qvpic_requests_total", route="responses") == samples(
        before, "qvpic_requests_total", route="responses") + 1


@pytest.mark.parametrize(("fields", "param"), [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}]},
     "input[0].content[0].image_url"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{**WEATHER, "parameters": {"type": 5}}]}, "tools[0].parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}, "input"),
    ({"text": {"format": {"type": "json_schema", "schema": VERDICT}}}, "text.format.name"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": [{"type": "function_call_output", "output": "42"}]}, "input[0].call_id"),
])
def test_bad_input_is_a_400_naming_the_field(app, fields, param):
    response = raw(app, "POST", "/v1/responses", json={"model": "qvpic", "input": QUESTION, **fields})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param and error["type"] == "invalid_request_error", error


def test_the_agents_sdks_tool_loop_round_trips(app, client):
    """What openai-agents 0.24.0's `OpenAIResponsesModel` sends (agents/models/openai_responses.py `_build_request`:
    `include: []`, flat function tools with `strict`, the answer's output items echoed back with
    `model_dump(exclude_unset=True)` (agents/items.py `to_input_item`), then the tool's `function_call_output`);
    its default `reset_tool_choice` asks the second turn with tool_choice auto. The SDK itself needs openai>=3
    (this venv pins 2.x): tests/e2e/test_agents_sdk.py runs it from its own venv against a live server."""
    tool = {"name": "ship_date", "parameters": {**SHIP["parameters"], "additionalProperties": False},
            "strict": True, "type": "function", "description": "When a part ships."}
    user = {"content": QUESTION, "role": "user"}
    first = client.responses.create(model="qvpic", instructions="Use the tools.", input=[user], include=[],
                                    tools=[tool], tool_choice="required", max_output_tokens=64,
                                    extra_body=QVPIC, extra_headers=NO_CACHE)
    called = [item for item in first.output if item.type == "function_call"]
    assert called and valid_call(called[0], tool)
    echoed = [item.model_dump(exclude_unset=True) for item in first.output]
    result = {"call_id": called[0].call_id, "output": "12 March", "type": "function_call_output"}
    second = client.responses.create(model="qvpic", instructions="Use the tools.", input=[user, *echoed, result],
                                     include=[], tools=[tool], tool_choice="auto", max_output_tokens=4,
                                     extra_body=QVPIC, extra_headers=NO_CACHE)
    assert second.output[0].type == "message" and second.output_text
    assert second.usage.input_tokens > first.usage.input_tokens  # the call and its result were read


def test_a_405_on_a_stored_response_lists_both_methods(app):
    """Schemathesis found `Allow: GET` (Starlette lists the first route on the path): GET and DELETE both serve it."""
    refused = raw(app, "PATCH", "/v1/responses/resp_x")
    assert refused.status_code == 405 and set(refused.headers["Allow"].split(", ")) == {"GET", "DELETE"}
