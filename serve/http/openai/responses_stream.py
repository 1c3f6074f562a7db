"""A streamed `/v1/responses` answer as OpenAI sends it (the openai SDK's `responses.stream()` accumulates these):

    response.created, response.in_progress                 the response, status in_progress, no output yet
    response.output_item.added (message)                   when the first text arrives
      response.content_part.added (output_text "")
      response.output_text.delta …                          the text as it is decoded
      response.output_text.done, response.content_part.done, response.output_item.done
    response.output_item.added (function_call, arguments "")   per tool call, once its block closes
      response.function_call_arguments.delta, .done
      response.output_item.done
    response.completed (or response.incomplete)            the whole response: output, usage, the qvpic report

Every event carries `type` and a `sequence_number` counting from 0. Tool calls are read out of the text as chat's
stream reads them (serve/http/openai/tool_calls.py `CallStream`): text before the first call is the message, a call
goes out whole. An error after the 200 is one `{"error": …}` event, which the SDK raises. No `[DONE]` (OpenAI
sends none on this route).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from schemas.chat import ToolCallDelta
from schemas.response_objects import (
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponseStatus,
)
from schemas.tools import ToolUse
from serve.http.backend import api_error, sse
from serve.http.openai.errors import openai_error_body
from serve.http.openai.tool_calls import CallStream, names
from serve.plan import Answer


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def function_call_id() -> str:
    return f"fc_{uuid.uuid4().hex}"


class ResponseStream:
    """The events of one streamed response; `finish(answer, output)` makes the final response (and stores it)."""

    def __init__(self, snapshot: ResponseObject, tools: ToolUse | None,
                 finish: Callable[[Answer, list[OutputItem]], Awaitable[ResponseObject]], request_id: str):
        self.snapshot, self.finish, self.request_id = snapshot, finish, request_id
        offered = names(tools)
        self.calls = CallStream(offered) if offered is not None else None
        self.sequence = 0
        self.output: list[OutputItem] = []
        self.message: OutputMessage | None = None  # the message being streamed, if one is open

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse(data)

    def item(self, kind: str, item: OutputItem) -> str:
        return self.event(f"response.output_item.{kind}", output_index=len(self.output) - 1,
                          item=item.model_dump(mode="json"))

    def text(self, piece: str) -> list[str]:
        out = [] if self.message is not None else self.open_message()
        message = self.message
        message.content[0].text += piece
        out.append(self.event("response.output_text.delta", item_id=message.id, output_index=len(self.output) - 1,
                              content_index=0, delta=piece, logprobs=[]))
        return out

    def open_message(self) -> list[str]:
        self.message = OutputMessage(id=message_id(), status=ResponseStatus.IN_PROGRESS)
        self.output.append(self.message)
        added = self.item("added", self.message)
        self.message.content.append(OutputText(text=""))
        return [added, self.event("response.content_part.added", item_id=self.message.id,
                                  output_index=len(self.output) - 1, content_index=0,
                                  part=OutputText(text="").model_dump(mode="json"))]

    def close_message(self) -> list[str]:
        message, self.message = self.message, None
        if message is None:
            return []
        index, part = self.output.index(message), message.content[0]
        message.status = ResponseStatus.COMPLETED
        return [self.event("response.output_text.done", item_id=message.id, output_index=index, content_index=0,
                           text=part.text, logprobs=[]),
                self.event("response.content_part.done", item_id=message.id, output_index=index, content_index=0,
                           part=part.model_dump(mode="json")),
                self.event("response.output_item.done", output_index=index, item=message.model_dump(mode="json"))]

    def call(self, delta: ToolCallDelta) -> list[str]:
        out = self.close_message()
        item = OutputFunctionCall(id=function_call_id(), call_id=delta.id, name=delta.function.name,
                                  arguments=delta.function.arguments)
        self.output.append(item)
        opened = item.model_copy(update={"arguments": "", "status": ResponseStatus.IN_PROGRESS})
        index = len(self.output) - 1
        return out + [self.item("added", opened),
                      self.event("response.function_call_arguments.delta", item_id=item.id, output_index=index,
                                 delta=item.arguments),
                      self.event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                                 name=item.name, arguments=item.arguments),
                      self.item("done", item)]

    def pieces(self, pieces: list[str | ToolCallDelta]) -> list[str]:
        return [e for piece in pieces for e in (self.text(piece) if isinstance(piece, str) else self.call(piece))]

    async def events(self, answer_events: AsyncIterator[str | Answer]) -> AsyncIterator[str]:
        snapshot = self.snapshot.model_dump(mode="json")
        yield self.event("response.created", response=snapshot)
        yield self.event("response.in_progress", response=snapshot)
        try:
            async for event in answer_events:
                if isinstance(event, str):
                    for out in self.pieces(self.calls.feed(event) if self.calls is not None else [event]):
                        yield out
                    continue
                for out in self.pieces(self.calls.finish() if self.calls is not None else []):
                    yield out
                if not self.output:  # an empty answer is still one (empty) message, as a whole answer's
                    for out in self.open_message():
                        yield out
                for out in self.close_message():
                    yield out
                final = await self.finish(event, self.output)
                kind = "completed" if final.status is ResponseStatus.COMPLETED else "incomplete"
                yield self.event(f"response.{kind}", response=final.model_dump(mode="json"))
        except Exception as error:  # noqa: BLE001  after the 200, errors travel as an event the client raises
            yield sse(openai_error_body(*api_error(error, self.request_id)))
