"""`/v1/responses` against a live `qvpic serve` (issue 61): the OpenAI Agents SDK (openai-agents, in its own client
venv: it needs openai>=3, the project pins 2.x) and the openai SDK's own `responses.create` / `responses.stream`.

One server for the module, with two tenants' API keys. The Agents SDK runs in tests/e2e/clients/agents_client.py
with the agents venv's python (`make install-agents`; QVPIC_AGENTS_PYTHON names it): one subprocess runs every
scenario and prints what the SDK gave back. The served model is random-weight: each outcome asserted is one the
server guarantees (a forced call is a valid call; `output_type` is a valid call or valid JSON), never one the
weights would have to choose.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import jsonschema
import openai
import pytest

from serve.governance import key_digest
from tests.e2e.test_serve_lifecycle import START_TIMEOUT_S, serve_process, wait_for
from tests.support.paths import REPO
from tests.support.ray_fixtures import free_port
from tests.support.store_factory import serving_store  # noqa: F401  (fixture)

pytestmark = pytest.mark.e2e
KEYS = {"acme": "key-acme-1", "globex": "key-globex-1"}
CLIENT = Path(__file__).parent / "clients" / "agents_client.py"
SCENARIOS = ["tool", "tool_chat", "structured", "structured_called", "stream"]
CITIES = {"Oslo", "Paris", "Lima"}  # the client's tool takes one of these
FRESH = {"Cache-Control": "no-cache"}  # computed, not the response cache's copy
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": sorted(CITIES)}},
                          "required": ["city"], "additionalProperties": False}}
VERDICT = {"type": "object", "properties": {"sunny": {"type": "boolean"}}, "required": ["sunny"],
           "additionalProperties": False}
JSON_FORMAT = {"format": {"type": "json_schema", "name": "verdict", "schema": VERDICT, "strict": True}}


@pytest.fixture(scope="module")
def base_url(serving_store, tmp_path_factory) -> str:
    logs = tmp_path_factory.mktemp("responses-serve")
    keys = "".join(f"            {key_digest(key)}: {tenant}\n" for tenant, key in KEYS.items())
    config = logs / "config.yaml"
    config.write_text(f"applications:\n- args:\n    ingress:\n      governance:\n        auth:\n"
                      f"          api_key_sha256:\n{keys}")
    port = free_port()
    server = serve_process(serving_store.uri, port, logs, "--config", str(config))
    try:
        wait_for(lambda: "qvpic: serving" in (logs / "stdout").read_text() or server.poll() is not None or None,
                 START_TIMEOUT_S, "qvpic serve")
        assert server.poll() is None, (logs / "stderr").read_text()[-3000:]
        yield f"http://127.0.0.1:{port}/v1"
        assert "Traceback" not in (logs / "stderr").read_text()
    finally:
        server.terminate()
        server.wait(timeout=120)


def sdk(base_url: str, tenant: str = "acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=KEYS[tenant], max_retries=0, timeout=START_TIMEOUT_S)


@pytest.fixture(scope="module")
def agents_python() -> Path:
    """The agents venv's python: skipped without it, but failed under CI=1 (.ci/run), where a skip proves nothing.
    Asked before the server starts (the `agents` fixture's first argument): no server for a skip."""
    python = Path(os.environ.get("QVPIC_AGENTS_PYTHON") or REPO / ".venv-agents" / "bin" / "python")
    if not os.access(python, os.X_OK):
        message = f"no agents venv at {python} (`make install-agents`, or set QVPIC_AGENTS_PYTHON)"
        if os.environ.get("CI"):
            pytest.fail(f"CI is set and {message}")
        pytest.skip(message)
    return python


@pytest.fixture(scope="module")
def agents(agents_python, base_url) -> dict:
    done = subprocess.run([str(agents_python), str(CLIENT), base_url, KEYS["acme"], *SCENARIOS],
                          capture_output=True, text=True, timeout=START_TIMEOUT_S, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def ran(result: dict) -> dict:
    assert "error" not in result, result["error"]
    return result


def test_an_agent_runs_its_function_tool_through_the_responses_model(agents):
    tool = ran(agents["tool"])
    [call] = tool["tool_calls"]  # the forced call reached the tool, with an argument its schema allows
    assert call["city"] in CITIES and tool["model_calls"] == 1
    assert tool["final_output"] == f"Sunny in {call['city']}, 21 C."  # stop_on_first_tool: the tool's own result


def test_an_agent_sends_the_tools_result_back_through_the_chat_completions_model(agents):
    tool = ran(agents["tool_chat"])
    assert len(tool["tool_calls"]) == 1 and tool["tool_calls"][0]["city"] in CITIES
    assert tool["model_calls"] == 2 and tool["final_type"] == "str" and tool["final_output"]
    first, second = tool["input_tokens"]
    assert second > first  # the second turn read the call and its result


@pytest.mark.parametrize("scenario", ["structured", "structured_called"])
def test_an_output_type_beside_a_tool_ends_in_a_parsed_instance(agents, scenario):
    """tool_choice auto: a call or the JSON, whichever; required: the call, then the JSON (a 400 before: a forced
    call beside a JSON format). Either way the run ends with the pydantic model, one model call per tool call more."""
    structured = ran(agents[scenario])
    assert structured["final_type"] == "Forecast"
    jsonschema.validate(structured["final_output"], structured["schema"])
    assert structured["model_calls"] == 1 + len(structured["tool_calls"])
    assert all(call["city"] in CITIES for call in structured["tool_calls"])
    if scenario == "structured_called":
        assert len(structured["tool_calls"]) == 1


def test_a_streamed_agent_run_sees_the_text_deltas_and_the_completed_response(agents):
    stream = ran(agents["stream"])
    kinds = [k for k in stream["kinds"] if k != "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.completed"]
    assert len(stream["deltas"]) > 1 and "".join(stream["deltas"]) == stream["completed_text"]
    assert stream["final_type"] == "Forecast" and json.loads(stream["completed_text"]) == stream["final_output"]


def test_the_openai_sdks_responses_create_calls_continues_retrieves_and_deletes(base_url):
    client, other = sdk(base_url), sdk(base_url, "globex")
    first = client.responses.create(model="qvpic", instructions="Use the tools.", input="Weather in Oslo?",
                                    tools=[WEATHER], tool_choice="required", max_output_tokens=64, temperature=0,
                                    extra_headers=FRESH)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."}
    answer = dict(model="qvpic", tools=[WEATHER], tool_choice="none", text=JSON_FORMAT, max_output_tokens=32,
                  temperature=0, extra_headers=FRESH)  # none: the JSON grammar alone, so the answer ends
    second = client.responses.create(previous_response_id=first.id, input=[result], **answer)
    assert second.previous_response_id == first.id and second.status == "completed"
    jsonschema.validate(json.loads(second.output_text), VERDICT)
    alone = client.responses.create(input="Weather in Oslo?", store=False, **answer)
    assert second.usage.input_tokens > alone.usage.input_tokens  # the stored question, its call, and the result
    kept = client.responses.retrieve(first.id)
    assert kept.id == first.id and kept.output[-1].call_id == call.call_id
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(first.id)  # another tenant's id is unknown to it
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(first.id)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_the_openai_sdks_responses_stream_events_in_order(base_url):
    with sdk(base_url).responses.stream(model="qvpic", input="Is it sunny in Oslo?", text=JSON_FORMAT,
                                        max_output_tokens=32, temperature=0, extra_headers=FRESH) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert [k for k in kinds if k != "response.output_text.delta"] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert len(deltas) > 1 and "".join(deltas) == final.output_text and final.status == "completed"
    jsonschema.validate(json.loads(final.output_text), VERDICT)
    assert final.usage.output_tokens >= len(deltas)
