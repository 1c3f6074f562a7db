"""`/v1/chat/completions` (plain and streamed) and `/v1/models`: a conversation in OpenAI's message shape.

The messages become the native request's `messages` (serve/routing/prompt.py renders them with the model's own chat
template, the store's chunks at the start of the last user message's content). Retrieval embeds the last user
message's text, or `qvpic.retrieval_query`; `qvpic.retrieval: "none"` (or `top_k: 0`), or the plain-chat model id
(`qvpic-chat`, listed by `/v1/models`), is plain chat with no store chunks. The chunk selection and routing ride in
the extension field `qvpic` (the official client sends it with `extra_body={"qvpic": {...}}`).
`usage.prompt_tokens` counts the whole prompt (the messages as rendered, every chunk) and
`prompt_tokens_details.cached_tokens` the part whose KV was not computed for this request: the linked chunks' (from
the store) and the prefix cache's (earlier requests' prompts and answers); all of it when the answer came from the
response cache.
"""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from schemas.api import AnswerRequest, FinishReason
from schemas.chat import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ModelCard,
    ModelList,
    OpenAIErrorBody,
    RetrievalMode,
)
from schemas.decoding import Decoding
from schemas.errors import UnknownModelError
from schemas.tools import ToolUse
from serve.config import ApiSpec
from serve.governance import Route
from serve.http.exchange import Turns
from serve.http.openai.chat_stream import ChatStream, chat_usage
from serve.http.openai.tool_calls import read_calls
from serve.http.parsing import WorkerParsedRoute
from serve.plan import Choice

# what a generating route answers: JSON, SSE, or OpenAI's error shape
GENERATION_RESPONSES = {200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream=true"},
                        **{status: {"model": OpenAIErrorBody} for status in (400, 401, 404, 413, 429, 503)}}


def require_served(model: str, api: ApiSpec) -> None:
    """404 `model_not_found` for a model this server does not serve."""
    if model not in api.model_ids:
        raise UnknownModelError(f"model {model[:256]!r} is not served here; available: {api.model_ids}")


def decoding_fields(request: Decoding) -> dict[str, object]:
    """The request's decoding controls as the validated values themselves, not dumped: a dump copied a client's
    response_format schema (3,000 subschemas) and the native request validated the copy again, JSON-dumping it for
    its size, on the event loop — the most of the loop's time under that probe (issue 60 item 5)."""
    return {name: getattr(request, name) for name in Decoding.model_fields}


def answer_request(request: ChatCompletionRequest, api: ApiSpec) -> AnswerRequest:
    """The native request of a chat request: its messages, and what retrieval embeds (`retrieval_query`); a
    question without text (an image alone) retrieves nothing unless chunks are named. The plain-chat model id
    (`api.plain_chat_model`) never retrieves: `retrieval: "none"` whatever the request says, and a chunk
    selection with it is a 400 naming `qvpic`."""
    options = request.qvpic
    selection = options.model_dump(include={"chunk_ids", "doc_ids", "top_k"}, exclude_none=True)
    if request.model == api.plain_chat_model and selection:
        raise RequestValidationError([{"type": "value_error", "loc": ("body", "qvpic"), "input": None, "msg": (
            f"model {request.model!r} never retrieves, so it takes no chunk_ids, doc_ids or top_k; name them with "
            f"model {api.served_model_name!r}")}])
    if options.retrieval is RetrievalMode.NONE or request.model == api.plain_chat_model:
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
                             sampling_top_k=request.top_k, add_generation_prompt=request.add_generation_prompt,
                             continue_final_message=request.continue_final_message,
                             **decoding_fields(request),
                             stream=request.stream, timeout_s=options.timeout_s,
                             user=request.user or request.safety_identifier, tools=request.tool_use,
                             **(selection or {"top_k": api.default_top_k}))
    except ValidationError as error:  # the chat request's own limits should already exclude this
        raise RequestValidationError(error.errors()) from error


def chat_choice(index: int, choice: Choice, tools: ToolUse | None) -> ChatChoice:
    """Choice `index` as OpenAI's: its text read for tool calls when tools were offered."""
    content, calls = read_calls(choice.text, tools)
    finish = FinishReason.TOOL_CALLS if calls else choice.finish_reason
    return ChatChoice(index=index, message=AssistantMessage(content=content, tool_calls=calls or None),
                      finish_reason=finish, logprobs=choice.logprobs)


def openai_routes(turns: Turns, api: ApiSpec) -> APIRouter:
    routes = APIRouter(tags=["openai"], route_class=WorkerParsedRoute)

    cards = {name: ModelCard(id=name, created=api.created, owned_by="qvpic", max_model_len=api.max_model_len)
             for name in api.model_ids}

    @routes.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=list(cards.values()))

    @routes.get("/v1/models/{model}", responses={404: {"model": OpenAIErrorBody}})
    async def model(model: str) -> ModelCard:
        require_served(model, api)
        return cards[model]

    @routes.post("/v1/chat/completions", response_model=ChatCompletion, responses=GENERATION_RESPONSES)
    async def chat_completions(request: ChatCompletionRequest, http: Request, response: Response):
        require_served(request.model, api)
        started, created = time.perf_counter(), int(time.time())
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        exchange = await turns.begin(http, answer_request(request, api), Route.CHAT, n=request.n,
                                     tools_path="tools")
        await exchange.admit()
        tools = request.tool_use
        if not request.stream:
            answer = await exchange.answer(response)
            report = answer.report.with_total_ms((time.perf_counter() - started) * 1e3)
            return ChatCompletion(
                id=completion_id, created=created, model=request.model, usage=chat_usage(report), qvpic=report,
                choices=[chat_choice(i, choice, tools) for i, choice in enumerate(answer.every_choice)])

        stream = ChatStream(completion_id, created, request.model, tools=tools, logprobs=bool(request.logprobs),
                            include_usage=request.stream_options is not None and request.stream_options.include_usage,
                            started=started, request_id=exchange.turn.record.request_id, n=request.n)
        return StreamingResponse(stream.events(exchange.stream()), media_type="text/event-stream",
                                 headers=exchange.headers)

    return routes
