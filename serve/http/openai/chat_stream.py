"""A streamed chat completion as OpenAI sends it: SSE chunks, then `data: [DONE]`.

    role chunk            {"delta": {"role": "assistant", "content": ""}}  (one per choice: `index` 0..n-1)
    content chunks        {"delta": {"content": …}, "logprobs": {"content": [the entries of its tokens]}}
    tool-call chunks      {"delta": {"tool_calls": [{index, id, type, function}]}}  (serve/http/openai/tool_calls.py)
    finish chunk          {"delta": {}, "finish_reason": …}, per choice; the last carries the `qvpic` report
    usage chunk           {"choices": [], "usage": …}  with stream_options.include_usage

Log-probabilities travel with the text they belong to (serve/plan.py `TextDelta`): a chunk carries the entries
of the tokens decoded since the previous one; tokens whose text was held back (a possible stop string's or tool
tag's start) ride with the next chunk, and any left at the end (a stop string's own tokens) with a last empty
content chunk, so the stream's entries are the whole answer's, as a non-streamed answer lists them.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from schemas.api import FinishReason
from schemas.chat import (
    ChatCompletionChunk,
    ChatUsage,
    ChunkChoice,
    ChunkDelta,
    PromptTokensDetails,
    ToolCallDelta,
)
from schemas.decoding import ChoiceLogprobs, TokenLogprob
from schemas.report import AnswerReport
from schemas.tools import ToolUse
from serve.http.backend import api_error, sse
from serve.http.openai.errors import openai_error_body
from serve.http.openai.tool_calls import CallStream, names
from serve.plan import Answer, TextDelta


def chat_usage(report: AnswerReport) -> ChatUsage:
    prompt_tokens = report.usage.context_tokens + report.usage.query_tokens
    # an answer from the response cache computed nothing for this request: its whole prompt was cached
    cached = prompt_tokens if report.response_cache.level is not None else report.usage.cached_tokens
    return ChatUsage(prompt_tokens=prompt_tokens, completion_tokens=report.usage.completion_tokens,
                     total_tokens=prompt_tokens + report.usage.completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def chunk_event(chunk: ChatCompletionChunk) -> str:
    """A stream chunk as OpenAI sends it: deltas carry only the fields they set."""
    data = chunk.model_dump(mode="json")
    for choice in data["choices"]:
        choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    return sse({k: v for k, v in data.items() if v is not None or k == "choices"})


class ChoiceState:
    """One choice's side of a stream: its tool-call parser and the log-probability entries not yet sent."""

    def __init__(self, offered: set[str] | None):
        self.calls = CallStream(offered) if offered is not None else None
        self.pending: list[TokenLogprob] = []  # entries of tokens whose text has not gone out yet
        self.sent = 0  # entries sent


class ChatStream:
    """The chunks of one streamed completion; `events(answer_events)` turns the generator's text deltas (each marked
    with its choice's index when n > 1) and its final `Answer` into them."""

    def __init__(self, completion_id: str, created: int, model: str, *, tools: ToolUse | None, logprobs: bool,
                 include_usage: bool, started: float, request_id: str, n: int = 1):
        self.completion_id, self.created, self.model = completion_id, created, model
        offered = names(tools)
        self.choices = [ChoiceState(offered) for _ in range(n)]
        self.logprobs, self.include_usage = logprobs, include_usage
        self.started, self.request_id = started, request_id

    def chunk(self, **fields) -> str:
        return chunk_event(ChatCompletionChunk(id=self.completion_id, created=self.created, model=self.model,
                                               **fields))

    def content(self, index: int, text: str) -> str:
        state = self.choices[index]
        entries, state.pending = state.pending, []
        state.sent += len(entries)
        logprobs = ChoiceLogprobs(content=entries) if self.logprobs else None
        return self.chunk(choices=[ChunkChoice(index=index, delta=ChunkDelta(content=text), logprobs=logprobs)])

    def piece(self, index: int, piece: str | ToolCallDelta) -> str:
        if isinstance(piece, str):
            return self.content(index, piece)
        return self.chunk(choices=[ChunkChoice(index=index, delta=ChunkDelta(tool_calls=[piece]))])

    def ending(self, index: int, finish_reason: FinishReason,
               logprobs: ChoiceLogprobs | None) -> tuple[list[str], ChunkChoice]:
        """Choice `index`'s last chunks: held-back text and tool calls, log-probability entries not yet sent (a
        stop string's tokens), then its finish chunk (without the report: that goes with the last choice's)."""
        state, out = self.choices[index], []
        out += [self.piece(index, piece) for piece in (state.calls.finish() if state.calls is not None else [])]
        if self.logprobs and logprobs is not None and len(logprobs.content) > state.sent:
            state.pending = list(logprobs.content[state.sent:])
            out.append(self.content(index, ""))
        called = state.calls is not None and state.calls.calls
        return out, ChunkChoice(index=index, delta=ChunkDelta(),
                                finish_reason=FinishReason.TOOL_CALLS if called else finish_reason)

    async def events(self, answer_events: AsyncIterator[str | Answer]) -> AsyncIterator[str]:
        for index in range(len(self.choices)):
            yield self.chunk(choices=[ChunkChoice(index=index, delta=ChunkDelta(role="assistant", content=""))])
        try:
            async for event in answer_events:
                if isinstance(event, str):
                    index = event.index if isinstance(event, TextDelta) else 0  # a cached answer's pieces: plain str
                    state = self.choices[index]
                    state.pending.extend(getattr(event, "logprobs", ()))
                    for piece in state.calls.feed(event) if state.calls is not None else [event]:
                        yield self.piece(index, piece)
                    continue
                report = event.report.with_total_ms((time.perf_counter() - self.started) * 1e3)
                every = event.every_choice
                for index, choice in enumerate(every):
                    pieces, finish = self.ending(index, choice.finish_reason, choice.logprobs)
                    for piece in pieces:
                        yield piece
                    last = index == len(every) - 1
                    yield self.chunk(choices=[finish], **({"qvpic": report} if last else {}))
                if self.include_usage:
                    yield self.chunk(choices=[], usage=chat_usage(report))
        except Exception as error:  # noqa: BLE001  after the 200, errors travel as an event the client raises
            yield sse(openai_error_body(*api_error(error, self.request_id)))
        yield sse("[DONE]")
