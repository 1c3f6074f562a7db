"""Tool calling: the prompt, the forced call, the reading of the answer, plain and streamed.

Expected values come from outside the code under test: Qwen2.5-Instruct's own chat template
(tests/fixtures/chat_templates/qwen2_5_instruct.jinja) renders the same conversation and tools, which the prompt
Qwen2.5-VL's template gives after qvpic's rewrite must equal character for character; a call's arguments are
checked with `jsonschema` against the tool's own parameters; the parser is fed hand-written literals."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pipeline.runtime.tiny import build
from schemas.config import ModelSpec
from schemas.conversation import Message
from schemas.tools import ToolUse, parse_calls
from serve.http.openai.tool_calls import CallStream
from serve.routing.prompt import InvalidMessageError, PromptTemplate
from tests.pipeline.runtime.test_chat_templates import fixture_template
from tests.serve.http.test_api import app, call  # noqa: F401  (a fixture)
from tests.support.store_factory import roles, serving_store  # noqa: F401  (fixtures)

NO_CACHE = {"Cache-Control": "no-cache"}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The forecast for a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 12},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                                "required": ["city", "days"], "additionalProperties": False}}}
SHIP = {"type": "function", "function": {"name": "ship_date", "parameters": {
    "type": "object", "properties": {"part": {"type": "string", "enum": ["XK-4471-B", "QP-1"]}},
    "required": ["part"]}}}
HISTORY = [
    {"role": "system", "content": "You answer from the manual."},
    {"role": "user", "content": "Weather in Oslo and Bergen for two days?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": "{\"city\": \"Oslo\", \"days\": 2}"}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": "{\"city\": \"Bergen\", \"days\": 2}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
    {"role": "tool", "tool_call_id": "call_2", "content": "sun"},
    {"role": "assistant", "content": "Rain in Oslo, sun in Bergen.", "tool_calls": [
        {"id": "call_3", "type": "function", "function": {"name": "ship_date", "arguments": "{\"part\": \"QP-1\"}"}}]},
    {"role": "tool", "tool_call_id": "call_3", "content": "12 March"},
    {"role": "user", "content": "And when does QP-1 ship?"},
]


@pytest.fixture(scope="module")
def qwen_vl(tmp_path_factory) -> PromptTemplate:
    """A tiny Qwen2.5-VL checkpoint carrying Qwen2.5-VL-Instruct's real template (which renders no tools)."""
    path = build("tiny-qwen", tmp_path_factory.mktemp("qwen-vl") / "checkpoint",
                 chat_template=fixture_template("qwen2_5_vl_instruct"))
    return PromptTemplate.load(ModelSpec(path=str(path)))


def prompt_text(template: PromptTemplate, messages: list[dict], tools: list[dict] | None, choice="auto") -> str:
    use = ToolUse(tools=tools, choice=choice) if tools else None
    layout = template.conversation([Message.model_validate(m) for m in messages], tools=use)
    ids = [i for segment in layout.texts for piece in segment.pieces for i in piece]
    return template.tokenizer.decode(ids)


def reference(template: PromptTemplate, messages: list[dict], tools: list[dict] | None) -> str:
    """Qwen2.5-Instruct's own template over the same conversation (arguments as mappings, as its `tojson` wants)."""
    plain = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        if "tool_calls" in m:
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        plain.append(m)
    theirs = fixture_template("qwen2_5_instruct")
    return template.tokenizer.apply_chat_template(plain, tools=tools, chat_template=theirs,
                                                  add_generation_prompt=True, tokenize=False)


def test_tools_and_tool_traffic_render_as_qwen2_5s_own_template_does(qwen_vl):
    assert not qwen_vl.native_tools and qwen_vl.default_system == "You are a helpful assistant."
    for messages in (HISTORY, HISTORY[:-1], HISTORY[:5]):  # ending with a question, a result, two results
        assert prompt_text(qwen_vl, messages, [WEATHER, SHIP]) == reference(qwen_vl, messages, [WEATHER, SHIP])
    # controls: tools left out of the prompt, or the history's calls dropped, are not Qwen's rendering
    assert prompt_text(qwen_vl, HISTORY, [WEATHER, SHIP], choice="none") != reference(qwen_vl, HISTORY, [WEATHER, SHIP])
    no_calls = [{k: v for k, v in m.items() if k != "tool_calls"} for m in HISTORY]
    no_calls[2]["content"] = ""
    assert prompt_text(qwen_vl, no_calls, [WEATHER, SHIP]) != reference(qwen_vl, HISTORY, [WEATHER, SHIP])


def test_without_a_system_message_the_templates_default_is_extended(qwen_vl):
    text = prompt_text(qwen_vl, [{"role": "user", "content": "Hi"}], [WEATHER])
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\nYou may call one or more")
    assert json.dumps(WEATHER) in text  # the tool as Qwen's `tojson` writes it
    # Qwen2.5-Instruct's own default differs ("You are Qwen, …"); past it, the prompts are the same
    theirs = reference(qwen_vl, [{"role": "user", "content": "Hi"}], [WEATHER])
    assert text.split("\n\n# Tools", 1)[1] == theirs.split("\n\n# Tools", 1)[1]


def test_a_family_without_a_tool_format_refuses_tools_by_name(tmp_path):
    path = build("tiny-glm", tmp_path / "glm", chat_template=fixture_template("glm4_1v_thinking"))
    glm = PromptTemplate.load(ModelSpec(path=str(path)))
    with pytest.raises(InvalidMessageError) as refused:
        prompt_text(glm, [{"role": "user", "content": "Hi"}], [WEATHER])
    assert refused.value.param == "tools"
    assert prompt_text(glm, [{"role": "user", "content": "Hi"}], None)  # plain chat still renders


@pytest.mark.parametrize("depth", [5_000, 100])  # past the JSON parser's recursion (a RecursionError: 500); past 64
def test_deeply_nested_arguments_in_the_history_are_a_400_naming_the_call(qwen_vl, depth):
    deep = "[" * depth + "]" * depth
    messages = [HISTORY[1], {"role": "assistant", "content": None, "tool_calls": [
        HISTORY[2]["tool_calls"][0], {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}]},
        {"role": "tool", "tool_call_id": "c", "content": "ok"}, HISTORY[-1]]
    with pytest.raises(InvalidMessageError) as refused:
        prompt_text(qwen_vl, messages, [WEATHER])
    assert refused.value.param == "messages[1].tool_calls[1].function.arguments"
    assert "deeper than 64" in str(refused.value)
    shallow = "[" * 64 + "]" * 64  # control: at the limit, it renders
    messages[1]["tool_calls"][1]["function"]["arguments"] = shallow
    assert shallow in prompt_text(qwen_vl, messages, [WEATHER])


TEXT = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "ship_date", "arguments": {"part": "QP-1"}}\n</tool_call>')


def test_calls_are_read_out_of_the_text():
    names = {"get_weather", "ship_date"}
    content, calls = parse_calls(TEXT, names)
    assert content == "Let me look.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 2}), ("ship_date", {"part": "QP-1"})]
    assert parse_calls(TEXT, {"get_weather"}) == (TEXT, [])  # a call of a function not offered: all text
    assert parse_calls(TEXT.replace('"days": 2}', '"days": 2'), names) == (TEXT.replace('"days": 2}', '"days": 2'), [])
    assert parse_calls("no calls here", names) == ("no calls here", [])


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11, len(TEXT)])
def test_a_stream_of_any_split_reads_as_the_whole_text(size):
    stream, content, calls = CallStream({"get_weather", "ship_date"}), "", []
    for start in range(0, len(TEXT), size):
        for piece in stream.feed(TEXT[start:start + size]):
            if isinstance(piece, str):
                content += piece
                assert not calls, "no text after the first call"
            else:
                calls.append(piece)
            assert "<tool" not in content  # never half a tag shown as text
    assert not stream.finish()
    assert content == "Let me look.\n"
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "get_weather", {"city": "Oslo", "days": 2}), (1, "ship_date", {"part": "QP-1"})]
    held = CallStream({"f"})
    assert held.feed("Hello <tool") == ["Hello "] and held.finish() == ["<tool"]  # not a call after all: text


QUESTION = [{"role": "user", "content": "When does part XK-4471-B ship?"}]


def chat(app, headers=NO_CACHE, status=200, **fields) -> dict:
    body = {"model": "qvpic", "messages": QUESTION, "max_tokens": 64, "temperature": 0,
            "qvpic": {"chunk_ids": ["manual#00000"]}, **fields}
    response = call(app, "POST", "/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == status, response.text
    return response.json()


def valid_call(call: dict, tool: dict) -> dict:
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == tool["function"]["name"]
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


def test_required_and_named_choices_give_valid_calls_whatever_the_weights(app):
    plain = chat(app)
    forced = chat(app, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    choice = forced["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert len(choice["message"]["tool_calls"]) == 1
    valid_call(choice["message"]["tool_calls"][0], WEATHER)
    assert forced["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 50  # the tool block was prefilled
    named = chat(app, tools=[WEATHER, SHIP], tool_choice={"type": "function", "function": {"name": "ship_date"}})
    calls = named["choices"][0]["message"]["tool_calls"]
    assert calls and all(valid_call(c, SHIP) for c in calls)
    hidden = chat(app, tools=[WEATHER], tool_choice="none")  # the tools are not shown, nothing is read as a call
    assert hidden["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert hidden["choices"][0]["message"]["tool_calls"] is None


def test_parallel_tool_calls_decides_whether_a_second_call_may_follow(app, roles):
    """A bias towards the newline that would open a next call: with parallel calls allowed the answer makes several
    (each valid), with parallel_tool_calls false the grammar allows only one whatever the logits."""
    newline = roles.generator.vlm.tokenizer.encode("\n", add_special_tokens=False)
    assert len(newline) == 1
    pushed = {"logit_bias": {str(newline[0]): 60}, "max_tokens": 200, "tools": [SHIP], "tool_choice": "required"}
    several = chat(app, **pushed)["choices"][0]["message"]["tool_calls"]
    assert len(several) >= 2 and all(valid_call(c, SHIP) for c in several)
    assert len({c["id"] for c in several}) == len(several)
    one = chat(app, **pushed, parallel_tool_calls=False)["choices"][0]["message"]["tool_calls"]
    assert len(one) == 1 and valid_call(one[0], SHIP)


def test_a_streamed_call_arrives_as_tool_call_deltas(app):
    whole = chat(app, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    body = {"model": "qvpic", "messages": QUESTION, "max_tokens": 64, "temperature": 0, "stream": True,
            "qvpic": {"chunk_ids": ["manual#00000"]}, "tools": [WEATHER], "tool_choice": "required",
            "parallel_tool_calls": False}
    response = call(app, "POST", "/v1/chat/completions", json=body, headers=NO_CACHE)
    events = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert all(not d.get("content") for d in deltas)  # the call is never shown as text
    calls = [t for d in deltas for t in d.get("tool_calls", [])]
    assert [c["index"] for c in calls] == [0]
    assert valid_call(calls[0], WEATHER) == json.loads(whole["choices"][0]["message"]["tool_calls"][0]["function"][
        "arguments"])  # the same call as the whole answer's (greedy)
    assert [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")] == ["tool_calls"]


def test_the_tool_result_round_trip_answers(app):
    first = chat(app, tools=[SHIP], tool_choice="required", parallel_tool_calls=False)
    call_ = first["choices"][0]["message"]["tool_calls"][0]
    follow = QUESTION + [{"role": "assistant", "content": None, "tool_calls": [call_]},
                         {"role": "tool", "tool_call_id": call_["id"], "content": "12 March"}]
    answer = chat(app, messages=follow, tools=[SHIP], max_tokens=4)
    assert answer["choices"][0]["message"]["content"]
    assert answer["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"]  # the call and its result were read


def test_the_response_cache_keys_on_the_tools(app):
    cached = {"X-Tenant": "tools-cache"}
    first = chat(app, headers=cached, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert first["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    other = chat(app, headers=cached, tools=[SHIP], tool_choice="required", parallel_tool_calls=False)
    assert other["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "ship_date"
    again = chat(app, headers=cached, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert again["qvpic"]["response_cache"]["level"] is not None  # control: the same tools do hit the cache
    # with tool_choice auto no grammar tells the requests apart: only the tools themselves do
    auto = chat(app, headers=cached, tools=[WEATHER], max_tokens=4)
    assert auto["qvpic"]["response_cache"]["level"] is None
    assert chat(app, headers=cached, tools=[SHIP], max_tokens=4)["qvpic"]["response_cache"]["level"] is None
    assert chat(app, headers=cached, tools=[WEATHER], max_tokens=4)["qvpic"]["response_cache"]["level"] is not None


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
])  # a forced call beside a JSON response_format is no longer one: test_tools_or_json.py (OpenAI takes both)
def test_bad_tools_are_400_naming_the_field(app, fields, param):
    error = chat(app, status=400, **fields)["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
