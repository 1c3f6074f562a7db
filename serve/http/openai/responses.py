"""`/v1/responses` (OpenAI's Responses API): create (plain and streamed), and GET / DELETE of a stored response.

A request becomes the chat request it stands for (schemas/responses.py: instructions, a stored history, the input
items) and runs chat's turn (serve/http/openai/chat.py `answer_request`: the same retrieval, PIC path, key, rate
charge and response cache), as its own governance route (`responses`). The answer's text is read for tool calls
as chat reads it; the output is a message with its text and a `function_call` item per call.
`store` (OpenAI's default: true) keeps the response and its conversation under the tenant the server
authenticated (serve/http/openai/response_store.py: this replica's memory, or Redis shared by every replica);
`previous_response_id`, GET and DELETE look it up under that tenant only: another tenant's id is a 404, like one
that never existed.
"""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from fastapi.routing import APIRoute

from schemas.api import FinishReason
from schemas.chat import OpenAIErrorBody
from schemas.conversation import Message
from schemas.errors import InvalidRequestError, UnknownResponseError
from schemas.response_objects import (
    DeletedResponse,
    IncompleteDetails,
    InputTokensDetails,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponseStatus,
    ResponseUsage,
)
from schemas.responses import FunctionCallItem, MessageItem, ResponseRequest, conversation
from schemas.tools import ToolUse
from serve.config import ApiSpec
from serve.governance import Governor, Route
from serve.http.exchange import Turns
from serve.http.openai.chat import GENERATION_RESPONSES, answer_request, require_served
from serve.http.openai.chat_stream import chat_usage
from serve.http.openai.response_store import ResponseStore
from serve.http.openai.responses_stream import ResponseStream, function_call_id, message_id
from serve.http.openai.tool_calls import read_calls
from serve.http.parsing import WorkerParsedRoute
from serve.plan import Answer

NOT_FOUND = {404: {"model": OpenAIErrorBody}, 401: {"model": OpenAIErrorBody}, 429: {"model": OpenAIErrorBody}}


def whole_output(answer: Answer, tools: ToolUse | None) -> list[OutputItem]:
    """A whole answer's items: its text (before the first call) as a message, then one item per call."""
    content, calls = read_calls(answer.text, tools)
    output: list[OutputItem] = []
    if content is not None or not calls:
        output.append(OutputMessage(id=message_id(), content=[OutputText(text=content or "")]))
    output += [OutputFunctionCall(id=function_call_id(), call_id=c.id, name=c.function.name,
                                  arguments=c.function.arguments) for c in calls]
    return output


def as_items(output: list[OutputItem]) -> list[MessageItem | FunctionCallItem]:
    """The output as the input items that continue from it (what a client would send back)."""
    return [MessageItem(role="assistant", content=item.content[0].text if item.content else "")
            if isinstance(item, OutputMessage) else
            FunctionCallItem(type="function_call", call_id=item.call_id, name=item.name, arguments=item.arguments)
            for item in output]


def echoed(request: ResponseRequest, response_id: str, created: int) -> ResponseObject:
    """The response before its answer: the request's settings, as OpenAI echoes them."""
    choice = request.tool_choice
    return ResponseObject(
        id=response_id, created_at=created, status=ResponseStatus.IN_PROGRESS, model=request.model,
        instructions=request.instructions, max_output_tokens=request.max_output_tokens,
        parallel_tool_calls=request.parallel_tool_calls is not False, previous_response_id=request.previous_response_id,
        store=request.store, temperature=request.temperature, top_p=request.top_p,
        text=request.text.model_dump(mode="json", by_alias=True, exclude_none=True),
        tool_choice=choice.model_dump(mode="json") if hasattr(choice, "model_dump") else (choice or "auto"),
        tools=[t.model_dump(mode="json", exclude_none=True) for t in request.tools or []],
        user=request.user, metadata=request.metadata or {})


class StoredRoute(APIRoute):
    """GET and DELETE of `/v1/responses/{id}` are two routes on one path: a 405 on it lists both in `Allow`
    (Starlette's lists the first route's methods alone)."""

    async def handle(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] not in STORED_METHODS:
            raise HTTPException(status_code=405, headers={"Allow": ", ".join(STORED_METHODS)})
        await super().handle(scope, receive, send)


STORED_METHODS = ("GET", "DELETE")


def input_param(param: str | None, offset: int) -> str | None:
    """A chat message's field as the Responses request's: `messages[k]…` is `input[k - offset]…`, `offset` the
    messages before the input's (instructions, a stored response's history). An input item that merges into the
    message before it (a function call into its assistant turn) shifts the ones after it: the index is then
    approximate, the rest of the path exact."""
    if param is None or not param.startswith("messages["):
        return param
    index, rest = param.removeprefix("messages[").split("]", 1)
    return f"input[{max(0, int(index) - offset)}]{rest}" if index.isdigit() else param


def response_routes(turns: Turns, api: ApiSpec, store: ResponseStore) -> APIRouter:
    routes = APIRouter(tags=["openai"], route_class=WorkerParsedRoute)
    stored_routes = APIRouter(tags=["openai"], route_class=StoredRoute)
    governor: Governor = turns.governor

    @routes.post("/v1/responses", response_model=ResponseObject, responses=GENERATION_RESPONSES)
    async def create(request: ResponseRequest, http: Request, response: Response):
        require_served(request.model, api)
        started, created = time.perf_counter(), int(time.time())
        tenant = governor.auth.tenant(http.headers)
        history: list[Message] = []
        if request.previous_response_id is not None:
            previous = await store.get(tenant, request.previous_response_id)
            if previous is None:
                raise UnknownResponseError(request.previous_response_id, "previous_response_id")
            history = [Message.model_validate(m) for m in previous.history]
        try:
            chat = request.chat(history)
        except ValueError as error:  # named by its field: a 400 (serve/http/openai/errors.py `openai_invalid`)
            raise RequestValidationError([{"type": "value_error", "loc": ("body",), "msg": str(error),
                                           "input": None}]) from None
        try:
            exchange = await turns.begin(http, answer_request(chat, api), Route.RESPONSES, tools_path="tools[{i}]")
        except InvalidRequestError as error:  # named on the chat it became (an image URL's fetch): named on `input`
            error.param = input_param(error.param, (request.instructions is not None) + len(history))
            raise

        await exchange.admit()
        response_id = f"resp_{uuid.uuid4().hex}"
        snapshot, tools = echoed(request, response_id, created), chat.tool_use

        async def finish(answer: Answer, output: list[OutputItem]) -> ResponseObject:
            report = answer.report.with_total_ms((time.perf_counter() - started) * 1e3)
            usage = chat_usage(report)
            called = any(isinstance(item, OutputFunctionCall) for item in output)
            cut = answer.report.finish_reason is FinishReason.LENGTH and not called
            if request.include and answer.logprobs is not None:  # message.output_text.logprobs
                for item in output:
                    if isinstance(item, OutputMessage):
                        item.content[0].logprobs = list(answer.logprobs.content or [])
            final = snapshot.model_copy(update=dict(
                status=ResponseStatus.INCOMPLETE if cut else ResponseStatus.COMPLETED, output=output,
                incomplete_details=IncompleteDetails(reason="max_output_tokens") if cut else None, qvpic=report,
                usage=ResponseUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                                    total_tokens=usage.total_tokens,
                                    input_tokens_details=InputTokensDetails(
                                        cached_tokens=usage.prompt_tokens_details.cached_tokens))))
            if request.store:
                kept = [*history, *conversation(request.items()), *conversation(as_items(output))]
                await store.put(tenant, response_id, final.model_dump(mode="json"),  # not kept: said in the log
                                [m.model_dump(mode="json", exclude_none=True) for m in kept])
            return final

        if not request.stream:
            answer = await exchange.answer(response)
            return await finish(answer, whole_output(answer, tools))
        stream = ResponseStream(snapshot, tools, finish, exchange.turn.record.request_id)
        return StreamingResponse(stream.events(exchange.stream()), media_type="text/event-stream",
                                 headers=exchange.headers)

    @stored_routes.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=NOT_FOUND)
    async def retrieve(response_id: str, http: Request):
        stored = await store.get(await governor.account(http, Route.RESPONSES), response_id)
        if stored is None:
            raise UnknownResponseError(response_id)
        return stored.body

    @stored_routes.delete("/v1/responses/{response_id}", response_model=DeletedResponse, responses=NOT_FOUND)
    async def delete(response_id: str, http: Request):
        if not await store.delete(await governor.account(http, Route.RESPONSES), response_id):
            raise UnknownResponseError(response_id)
        return DeletedResponse(id=response_id)

    routes.include_router(stored_routes)
    return routes
