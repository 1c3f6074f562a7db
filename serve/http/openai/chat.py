"""`/v1/chat/completions` (plain and streamed) and `/v1/models`: a conversation in OpenAI's message shape.

The messages become the native request's `messages` (serve/routing/prompt.py renders them with the model's own
chat template, the store's chunks at the start of the last user message's content). Retrieval embeds the last
user message's text, or `qvpic.retrieval_query`; `qvpic.retrieval: "none"` (or `top_k: 0`) is plain chat with
no store chunks. The chunk selection and routing ride in the extension field `qvpic` (the official client sends
it with `extra_body={"qvpic": {...}}`). `usage.prompt_tokens` counts the whole prompt (the messages as rendered,
every chunk) and `prompt_tokens_details.cached_tokens` the part whose KV was not computed for this request: the
linked chunks' (from the store) and the prefix cache's (earlier requests' prompts and answers); all of it when the
answer came from the response cache.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from schemas.api import AnswerReport, AnswerRequest
from schemas.chat import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatUsage,
    ChunkChoice,
    ChunkDelta,
    ModelCard,
    ModelList,
    OpenAIErrorBody,
    PromptTokensDetails,
    RetrievalMode,
)
from schemas.decoding import Decoding
from schemas.errors import UnknownModelError
from serve.config import ApiSpec
from serve.governance import Route
from serve.http.backend import api_error, sse
from serve.http.exchange import Turns
from serve.http.openai.errors import openai_error_body


def chat_usage(report: AnswerReport) -> ChatUsage:
    prompt_tokens = report.usage.context_tokens + report.usage.query_tokens
    # an answer from the response cache computed nothing for this request: its whole prompt was cached
    cached = prompt_tokens if report.response_cache.level is not None else report.usage.cached_tokens
    return ChatUsage(prompt_tokens=prompt_tokens, completion_tokens=report.usage.completion_tokens,
                     total_tokens=prompt_tokens + report.usage.completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def answer_request(request: ChatCompletionRequest, default_top_k: int) -> AnswerRequest:
    """The native request of a chat request: its messages, and what retrieval embeds (`retrieval_query`); a
    question without text (an image alone) retrieves nothing unless chunks are named."""
    options = request.qvpic
    selection = options.model_dump(include={"chunk_ids", "doc_ids", "top_k"}, exclude_none=True)
    if options.retrieval is RetrievalMode.NONE:
        selection = {"top_k": 0}
    query = request.retrieval_query
    if not selection and not query.strip():
        selection = {"top_k": 0}
    try:
        return AnswerRequest(query=query, messages=request.messages, history_chunks=options.history_chunks,
                             mode=options.mode, tau=options.tau,
                             normalisation=options.normalisation, order=options.order, task_type=options.task_type,
                             max_high_res=options.max_high_res, tier=options.tier,
                             max_new_tokens=request.max_new_tokens,
                             temperature=request.temperature, top_p=request.top_p, seed=request.seed,
                             **request.model_dump(include=set(Decoding.model_fields), by_alias=True),
                             stream=request.stream, timeout_s=options.timeout_s,
                             user=request.user or request.safety_identifier,
                             **(selection or {"top_k": default_top_k}))
    except ValidationError as error:  # the chat request's own limits should already exclude this
        raise RequestValidationError(error.errors()) from error


def chunk_event(chunk: ChatCompletionChunk) -> str:
    """A stream chunk as OpenAI sends it: deltas carry only the fields they set."""
    data = chunk.model_dump(mode="json")
    for choice in data["choices"]:
        choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    return sse({k: v for k, v in data.items() if v is not None or k == "choices"})


def openai_routes(turns: Turns, api: ApiSpec) -> APIRouter:
    routes = APIRouter(tags=["openai"])

    card = ModelCard(id=api.served_model_name, created=api.created, owned_by="qvpic")

    @routes.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[card])

    @routes.get("/v1/models/{model}", responses={404: {"model": OpenAIErrorBody}})
    async def model(model: str) -> ModelCard:
        if model != api.served_model_name:
            raise UnknownModelError(f"model {model[:256]!r} is not served here; available: {[card.id]}")
        return card

    @routes.post("/v1/chat/completions", response_model=ChatCompletion, responses={
        200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream=true"},
        **{status: {"model": OpenAIErrorBody} for status in (400, 401, 404, 413, 429, 503)}})
    async def chat_completions(request: ChatCompletionRequest, http: Request, response: Response):
        if request.model != api.served_model_name:
            available = [api.served_model_name]
            raise UnknownModelError(f"model {request.model!r} is not served here; available: {available}")
        started, created = time.perf_counter(), int(time.time())
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        exchange = await turns.begin(http, answer_request(request, api.default_top_k), Route.CHAT)
        await exchange.admit()
        if not request.stream:
            answer = await exchange.answer(response)
            report = answer.report.with_total_ms((time.perf_counter() - started) * 1e3)
            return ChatCompletion(
                id=completion_id, created=created, model=request.model, usage=chat_usage(report), qvpic=report,
                choices=[ChatChoice(message=AssistantMessage(content=answer.text), finish_reason=report.finish_reason,
                                    logprobs=answer.logprobs)])

        include_usage = request.stream_options is not None and request.stream_options.include_usage

        def chunk(**fields) -> str:
            return chunk_event(ChatCompletionChunk(id=completion_id, created=created, model=request.model, **fields))

        async def events() -> AsyncIterator[str]:
            yield chunk(choices=[ChunkChoice(delta=ChunkDelta(role="assistant", content=""))])
            try:
                async for event in exchange.stream():
                    if isinstance(event, str):
                        yield chunk(choices=[ChunkChoice(delta=ChunkDelta(content=event))])
                        continue
                    report = event.report.with_total_ms((time.perf_counter() - started) * 1e3)
                    finish = ChunkChoice(delta=ChunkDelta(), finish_reason=report.finish_reason)
                    yield chunk(choices=[finish], qvpic=report)
                    if include_usage:
                        yield chunk(choices=[], usage=chat_usage(report))
            except Exception as error:  # noqa: BLE001  after the 200, errors travel as an event the client raises
                yield sse(openai_error_body(*api_error(error, exchange.turn.record.request_id)))
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream", headers=exchange.headers)

    return routes
