"""A JSON answer beside tools (issue 61): with `response_format` (json_schema or json_object) and `tool_choice:
auto`, decoding follows one grammar with two alternatives — a valid call of an offered tool, or valid JSON of the
schema — so whichever the model begins, the answer parses (schemas/tools.py `call_or_json_grammar`).

The random-weight test model chooses nothing on purpose: a logit bias pushes it towards the call's opening tag or
away from it, and each branch is checked through the openai SDK's `chat.completions.parse` (the schema and the
tool as pydantic models, as the Agents SDK's `output_type` sends them over chat completions).
"""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict

from schemas.api import AnswerRequest
from serve.engine.grammar import Grammars
from tests.serve.http.test_api import app  # noqa: F401  (a fixture)
from tests.serve.http.test_openai_params import SyncASGI
from tests.support.store_factory import roles, serving_store  # noqa: F401  (fixtures)

QUESTION = [{"role": "user", "content": "When does part XK-4471-B ship?"}]


class ShipDate(BaseModel):
    """The ship date of a part."""

    model_config = ConfigDict(extra="forbid")
    part: Literal["XK-4471-B", "QP-1"]  # enums and booleans: no free text a bias could run to max_tokens in


class Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    when: Literal["12 March", "unknown"]
    confident: bool


@pytest.fixture(scope="module")
def client(app):  # noqa: F811
    return openai.OpenAI(api_key="none", base_url="http://localhost/v1", max_retries=0,
                         http_client=httpx.Client(transport=SyncASGI(app)))


@pytest.fixture(scope="module")
def tokenizer(roles):  # noqa: F811
    return roles.generator.vlm.tokenizer


@pytest.fixture(scope="module")
def call_tag(tokenizer) -> int:
    """The first token of a call's opening tag (`<`: no JSON of these schemas holds one)."""
    ids = tokenizer.encode("<tool_call>", add_special_tokens=False)
    assert tokenizer.decode(ids[:1]) == "<"
    return ids[0]


def parse(client, bias: dict[str, int]):
    return client.chat.completions.parse(
        model="qvpic", messages=QUESTION, response_format=Answer, tools=[openai.pydantic_function_tool(ShipDate)],
        max_tokens=160, temperature=0, logit_bias=bias, parallel_tool_calls=False,
        extra_headers={"Cache-Control": "no-cache"}, extra_body={"qvpic": {"chunk_ids": ["manual#00000"]}})


def test_pushed_to_a_call_the_answer_is_a_valid_call(client, call_tag):
    choice = parse(client, {str(call_tag): 100}).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "ShipDate" and isinstance(call.function.parsed_arguments, ShipDate)


def test_kept_from_a_call_the_answer_is_valid_json_of_the_schema(client, call_tag):
    choice = parse(client, {str(call_tag): -100}).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert isinstance(choice.message.parsed, Answer)  # the SDK validated it against the schema
    jsonschema.validate(json.loads(choice.message.content), Answer.model_json_schema())


def test_json_object_beside_tools_takes_a_call_or_an_object_and_nothing_else(tokenizer, roles):  # noqa: F811
    tool = {"type": "function", "function": {"name": "ship", "parameters": {
        "type": "object", "properties": {"part": {"type": "string"}}, "required": ["part"]}}}
    lark = AnswerRequest.model_validate({"query": "q", "messages": QUESTION, "top_k": 0, "tools": {"tools": [tool]},
                                         "response_format": {"type": "json_object"}}).grammar_text
    grammars = Grammars(tokenizer, roles.generator.vlm.vocab_size, {tokenizer.eos_token_id})

    def accepts(text: str) -> bool:
        ids = tokenizer.encode(text, add_special_tokens=False)
        matcher = grammars.matcher(lark, "response_format")
        return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()

    assert accepts('<tool_call>\n{"name": "ship", "arguments": {"part": "QP-1"}}\n</tool_call>')
    assert accepts('{"anything":[1,2]}')
    assert not accepts('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>')  # not an offered tool
    assert not accepts('[1,2]') and not accepts("It ships on 12 March.")  # not an object, not JSON


def test_the_grammar_is_the_call_or_the_json_only_with_tool_choice_auto():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    base = {"query": "q", "messages": QUESTION, "top_k": 0, "response_format": {"type": "json_object"}}
    auto = AnswerRequest.model_validate({**base, "tools": {"tools": [tool]}}).grammar_text
    assert auto.startswith("start: calls | answer\n") and "<tool_call>" in auto
    hidden = AnswerRequest.model_validate({**base, "tools": {"tools": [tool], "choice": "none"}}).grammar_text
    assert hidden == AnswerRequest.model_validate(base).grammar_text and "<tool_call>" not in hidden


def test_a_forced_call_beside_a_json_format_is_the_call(client):
    """`tool_choice: required` with a JSON format too (a 400 before): what the Agents SDK sends when an agent with an
    `output_type` forces its first tool (agents/models/openai_responses.py puts both in one request). OpenAI takes
    both; the turn's answer is the call, constrained to the tool's schema, on chat's route and on /v1/responses."""
    tool = openai.pydantic_function_tool(ShipDate)
    forced = {"tool_choice": "required", "temperature": 0, "extra_headers": {"Cache-Control": "no-cache"},
              "extra_body": {"qvpic": {"chunk_ids": ["manual#00000"]}}}
    chat = client.chat.completions.parse(model="qvpic", messages=QUESTION, response_format=Answer, tools=[tool],
                                         max_tokens=96, **forced).choices[0]
    assert chat.finish_reason == "tool_calls" and isinstance(chat.message.tool_calls[0].function.parsed_arguments,
                                                              ShipDate)
    flat = {"type": "function", **tool["function"]}
    answer = {"format": {"type": "json_schema", "name": "Answer", "schema": Answer.model_json_schema(),
                         "strict": True}}
    response = client.responses.create(model="qvpic", input=QUESTION, tools=[flat], text=answer,
                                       max_output_tokens=96, **forced)
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "ShipDate" and ShipDate.model_validate_json(call.arguments)


def test_a_forced_calls_grammar_is_the_same_with_a_json_format_or_without():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    base = {"query": "q", "messages": QUESTION, "top_k": 0, "tools": {"tools": [tool], "choice": "required"}}
    plain = AnswerRequest.model_validate(base).grammar_text
    assert plain and "<tool_call>" in plain and "answer" not in plain.split("\n", 1)[0]
    for format_ in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}}):
        assert AnswerRequest.model_validate({**base, "response_format": format_}).grammar_text == plain
