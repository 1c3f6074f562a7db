"""The OpenAI Agents SDK and LiteLLM against a live `qvpic serve`: what tests/e2e/test_clients.py runs on its server
(one server for every client). Each returns what came back for the test to assert on.

The Agents SDK (`openai-agents` 0.13.6: 0.14+ needs openai 3, which llama-index-llms-openai refuses) runs an agent
with one function tool, on its Responses model (/v1/responses, its default) and its chat-completions model. The tiny
random-weight model never calls a tool by itself, so `tool_choice: required` makes the first turn a call; the SDK
resets it to auto after the call (`reset_tool_choice`), so the second turn answers. `output_type` makes the SDK ask
for JSON beside the tool (issue 61 item 5: the answer is the call or valid JSON, never prose)."""

from __future__ import annotations

import asyncio
import os

from pydantic import BaseModel

TIMEOUT_S = 300.0


class ShipDate(BaseModel):
    part: str
    date: str


def run_agent(base_url: str, api: str, output_type: type | None = None) -> tuple[list[str], object, list[str]]:
    """One agent run: (the tool's calls, the final output, the kinds of the run's new items)."""
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
                        function_tool, set_tracing_disabled)
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # the SDK would export traces to OpenAI's servers
    calls: list[str] = []

    @function_tool
    def ship_date(part: str) -> str:
        """When a part ships."""
        calls.append(part)
        return f"{part} ships on 12 March"

    async def run():
        client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=TIMEOUT_S)
        model = (OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel)("qvpic", client)
        agent = Agent(name="clerk", instructions="Answer from the documents, in one line.", model=model,
                      tools=[ship_date], output_type=output_type,
                      model_settings=ModelSettings(tool_choice="required", max_tokens=48, temperature=0))
        result = await Runner.run(agent, "When does part XK-4471-B ship?", max_turns=4)
        return calls, result.final_output, [item.type for item in result.new_items]

    return asyncio.run(run())


def litellm_completion(base_url: str, stream: bool = False):
    """LiteLLM's vLLM provider (`hosted_vllm/`, OpenAI-compatible) with vLLM's sampling extras, which it sends as
    body fields: top_k 1 at temperature 1.5 is greedy, as temperature 0 is."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list from GitHub
    import litellm

    messages = [{"role": "user", "content": "Which part ships on 12 March?"}]
    common = dict(model="hosted_vllm/qvpic", api_base=base_url, api_key="unused", messages=messages, max_tokens=6,
                  timeout=TIMEOUT_S, num_retries=0)
    greedy = litellm.completion(**common, temperature=0)
    extras = litellm.completion(**common, temperature=1.5, top_k=1, repetition_penalty=1.0, min_tokens=1,
                                stream=stream, **({"stream_options": {"include_usage": True}} if stream else {}))
    return greedy, extras
