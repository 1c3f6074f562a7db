"""`/v1/completions` (legacy completions, plain and streamed): what LlamaIndex's `OpenAILike` (by default,
`is_chat_model=False`) and lm-evaluation-harness's `local-completions` send.

Each prompt is the text of one user message of a chat (schemas/completions.py `CompletionRequest.chat`), run
as `/v1/chat/completions` runs it — the model's chat template, retrieval on the prompt's text, the `qvpic`
extension — so a prompt answers as that chat does; it is not continued raw as vLLM continues it (qvpic's
linked chunks live in the template's context). A list of prompts is answered in order, one governed turn per
prompt (each charged and logged), `n` choices each (index `prompt × n + j`); `usage` sums them and `qvpic` lists
each prompt's report.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from schemas.chat import ChatUsage, PromptTokensDetails
from schemas.completions import Completion, CompletionChoice, CompletionLogprobs, CompletionRequest
from schemas.report import AnswerReport
from serve.config import ApiSpec
from serve.governance import Route
from serve.http.backend import api_error, error_status, sse
from serve.http.exchange import Exchange, Turns
from serve.http.openai.chat import GENERATION_RESPONSES, answer_request, chat_usage, require_served
from serve.http.openai.errors import openai_error_body
from serve.http.parsing import WorkerParsedRoute
from serve.plan import TextDelta


def summed(usages: list[ChatUsage]) -> ChatUsage:
    def total(field: str) -> int:
        return sum(getattr(u, field) for u in usages)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    return ChatUsage(prompt_tokens=total("prompt_tokens"), completion_tokens=total("completion_tokens"),
                     total_tokens=total("total_tokens"),
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def completion_routes(turns: Turns, api: ApiSpec) -> APIRouter:
    routes = APIRouter(tags=["openai"], route_class=WorkerParsedRoute)

    async def admitted(http: Request, request: CompletionRequest, prompt: str) -> Exchange:
        """The prompt's turn, routed and admitted (401, 404, 413, 429 here, before any generation)."""
        exchange = await turns.begin(http, answer_request(request.chat(prompt), api), Route.COMPLETIONS,
                                     n=request.n)
        await exchange.admit()
        return exchange

    @routes.post("/v1/completions", response_model=Completion, responses=GENERATION_RESPONSES)
    async def completions(request: CompletionRequest, http: Request, response: Response):
        require_served(request.model, api)
        started, created = time.perf_counter(), int(time.time())
        completion_id = f"cmpl-{uuid.uuid4().hex}"
        prompts = request.prompts

        def report_of(answer) -> AnswerReport:
            return answer.report.with_total_ms((time.perf_counter() - started) * 1e3)

        if not request.stream:
            choices, reports = [], []
            for index, prompt in enumerate(prompts):
                exchange = await admitted(http, request, prompt)
                answer = await exchange.answer(response)
                if index < len(prompts) - 1:  # the last one's slot goes back once the response is sent
                    turns.governor.release(exchange.turn)
                reports.append(report_of(answer))
                # OpenAI's order: prompt by prompt, each prompt's n choices together
                choices += [CompletionChoice(index=index * request.n + j, text=c.text, finish_reason=c.finish_reason,
                                             logprobs=CompletionLogprobs.of(c.logprobs))
                            for j, c in enumerate(answer.every_choice)]
            return Completion(id=completion_id, created=created, model=request.model, choices=choices,
                              usage=summed([chat_usage(r) for r in reports]), qvpic=reports)

        include_usage = request.stream_options is not None and request.stream_options.include_usage

        def chunk(**fields) -> str:
            data = Completion(id=completion_id, created=created, model=request.model, **fields).model_dump(mode="json")
            return sse({k: v for k, v in data.items() if v is not None or k == "choices"})

        first = await admitted(http, request, prompts[0])  # errors before the 200 are plain error responses

        async def events() -> AsyncIterator[str]:
            usages, exchange = [], first
            try:
                for index, prompt in enumerate(prompts):
                    if index:
                        turns.governor.release(exchange.turn)
                        exchange = await admitted(http, request, prompt)
                    async for event in exchange.stream():
                        if isinstance(event, str):  # choice j of prompt `index` (OpenAI's index: index × n + j)
                            choice = index * request.n + (event.index if isinstance(event, TextDelta) else 0)
                            yield chunk(choices=[CompletionChoice(index=choice, text=event, finish_reason=None)])
                            continue
                        report = report_of(event)
                        usages.append(chat_usage(report))
                        every = event.every_choice
                        for j, c in enumerate(every):
                            end = CompletionChoice(index=index * request.n + j, text="", finish_reason=c.finish_reason)
                            yield chunk(choices=[end], **({"qvpic": [report]} if j == len(every) - 1 else {}))
                if include_usage:
                    yield chunk(choices=[], usage=summed(usages))
            except Exception as error:  # noqa: BLE001  after the 200, errors travel as an event the client raises
                turns.governor.rejected(http, error_status(error))  # the current turn (a later prompt's may fail
                turn = http.state.turn                              # to begin or admit): finished once
                yield sse(openai_error_body(*api_error(error, turn.record.request_id)))
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream", headers=first.headers)

    return routes
