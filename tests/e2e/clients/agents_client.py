"""The OpenAI Agents SDK against a live `qvpic serve`: run in the agents venv (requirements-agents.lock, openai 3.x),
not the project's (openai 2.x), by tests/e2e/test_agents_sdk.py. Pure client code: it imports `agents`, `openai` and
`pydantic` only, never qvpic.

    python agents_client.py BASE_URL API_KEY SCENARIO [SCENARIO ...]

prints one JSON line, {scenario: result}: what the SDK gave back (or the error it raised), for the test to assert
on. The served model is random-weight, so each run makes its outcome certain by what the server guarantees, not by
what the weights say: a forced tool choice, and the `calls | answer` grammar of `output_type` beside tools.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from typing import Any, Literal

from agents import (
    Agent,
    AgentHooks,
    ModelSettings,
    OpenAIChatCompletionsModel,
    RawResponsesStreamEvent,
    Runner,
    function_tool,
    set_default_openai_client,
    set_tracing_disabled,
)
from openai import AsyncOpenAI
from pydantic import BaseModel, Field

MODEL = "qvpic"
QUESTION = "What is the weather in Oslo?"
INSTRUCTIONS = "Answer questions about the weather. Use the tools."
calls: list[dict[str, Any]] = []  # every call of the tool, as the SDK made it


@function_tool
def get_weather(city: Literal["Oslo", "Paris", "Lima"]) -> str:  # an enum: random weights' arguments end
    """The weather in a city today."""
    calls.append({"city": city})
    return f"Sunny in {city}, 21 C."


class Forecast(BaseModel):
    city: str = Field(max_length=12)  # bounded, so a random-weight answer closes its JSON within max_tokens
    sunny: bool


class AnswerAfterTheTool(AgentHooks):
    """After the tool ran, the next turn may only answer: tool_choice "none" leaves the server's `answer` grammar
    alone (the JSON of `output_type`). Without it, tool_choice auto lets a random-weight model call the tool turn
    after turn until max_turns."""

    async def on_tool_end(self, context, agent, tool, result) -> None:
        agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice="none")


def settings(tool_choice: str | None = None, max_tokens: int = 64) -> ModelSettings:
    return ModelSettings(temperature=0.0, max_tokens=max_tokens, tool_choice=tool_choice,
                         extra_headers={"Cache-Control": "no-cache"})  # computed, not the response cache's copy


async def tool(chat: AsyncOpenAI | None) -> dict[str, Any]:
    """A function tool forced on the first turn. Through the Responses model the run stops at the tool's result
    (`stop_on_first_tool`): a second, free-text turn of random weights runs to max_tokens, which the server reports
    as `response.incomplete` (as OpenAI does) and the SDK raises. `chat`: through OpenAIChatCompletionsModel, where
    the SDK's `reset_tool_choice` asks a second turn with tool_choice auto and takes its text (finish_reason
    length is an answer there), after sending the call and its result back."""
    model = OpenAIChatCompletionsModel(model=MODEL, openai_client=chat) if chat is not None else MODEL
    agent = Agent(name="weather", instructions=INSTRUCTIONS, tools=[get_weather], model=model,
                  model_settings=settings(tool_choice="get_weather"),
                  tool_use_behavior="run_llm_again" if chat is not None else "stop_on_first_tool")
    result = await Runner.run(agent, QUESTION, max_turns=3)
    return {"final_output": result.final_output, "final_type": type(result.final_output).__name__,
            "model_calls": len(result.raw_responses),
            "input_tokens": [r.usage.input_tokens for r in result.raw_responses]}


async def structured(tool_choice: str) -> dict[str, Any]:
    """`output_type` beside a tool: the first turn is a valid call or a valid Forecast (the grammar); after a call
    the hook lets the second turn only answer. Either way the run ends with a Forecast within two turns."""
    agent = Agent(name="forecaster", instructions=INSTRUCTIONS, tools=[get_weather], model=MODEL,
                  output_type=Forecast, model_settings=settings(tool_choice=tool_choice, max_tokens=96),
                  reset_tool_choice=False, hooks=AnswerAfterTheTool())
    result = await Runner.run(agent, QUESTION, max_turns=2)
    output = result.final_output
    return {"final_type": type(output).__name__, "final_output": output.model_dump() if isinstance(output, Forecast)
            else output, "model_calls": len(result.raw_responses), "schema": Forecast.model_json_schema()}


async def stream() -> dict[str, Any]:
    """Runner.run_streamed: the SDK's raw events are the server's; their text deltas are the final output. With
    `output_type` the JSON grammar ends the answer (free text of random weights would run to max_tokens: an
    incomplete response, which the SDK raises)."""
    agent = Agent(name="streamer", instructions="Answer in JSON.", model=MODEL, output_type=Forecast,
                  model_settings=settings(max_tokens=96))
    result = Runner.run_streamed(agent, QUESTION, max_turns=1)
    kinds, deltas, completed = [], [], None
    async for event in result.stream_events():
        if isinstance(event, RawResponsesStreamEvent):
            kinds.append(event.data.type)
            if event.data.type == "response.output_text.delta":
                deltas.append(event.data.delta)
            elif event.data.type == "response.completed":
                completed = event.data.response
    output = result.final_output
    return {"kinds": kinds, "deltas": deltas, "final_type": type(output).__name__,
            "final_output": output.model_dump() if isinstance(output, Forecast) else output,
            "completed_text": completed.output_text if completed is not None else None,
            "output_tokens": completed.usage.output_tokens if completed is not None else None}


async def main(base_url: str, api_key: str, scenarios: list[str]) -> dict[str, Any]:
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300)
    set_default_openai_client(client, use_for_tracing=False)
    set_tracing_disabled(True)  # no trace export to OpenAI's servers
    runs = {"tool": lambda: tool(None), "tool_chat": lambda: tool(client), "structured": lambda: structured("auto"),
            "structured_called": lambda: structured("required"), "stream": stream}
    results: dict[str, Any] = {}
    for name in scenarios:
        calls.clear()
        try:
            results[name] = await runs[name]()
        except Exception as error:  # reported, not raised: the test shows what the SDK said
            results[name] = {"error": f"{type(error).__name__}: {error}"}
        results[name]["tool_calls"] = list(calls)
    return results


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3:]))))
