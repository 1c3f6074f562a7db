"""An answer's tool calls, read out of its text (schemas/tools.py's format), as OpenAI returns them.

Whole answers: `message.tool_calls` and `finish_reason: "tool_calls"` when the text holds well-formed calls of the
offered functions, the text before the first call as `content` (None when blank) — vLLM's hermes parser's reading.

Streams (`CallStream`): text is passed on as content deltas until a `<tool_call>` begins (a tail that could be the
start of one is held back, so a client never sees half a tag); a call is sent as one tool-call delta, complete
(`index`, `id`, `function.name`, `function.arguments`), once its block closes. After the first call, text between
and after blocks is dropped, as in a whole answer. A block that is not a call of an offered function goes out as
content before the first call and is dropped after it: a stream cannot take back the calls it has sent, where a
whole answer with such a block is read as text alone.
"""

from __future__ import annotations

import uuid

from schemas.chat import CallFunction, ResponseToolCall, ToolCallDelta
from schemas.tools import CLOSE, OPEN, ParsedCall, ToolUse, parse_call, parse_calls

_OPEN, _CLOSE = OPEN.strip(), CLOSE.strip()  # the tags, without the newlines around the JSON


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def response_call(call: ParsedCall) -> ResponseToolCall:
    return ResponseToolCall(id=call_id(), function=CallFunction(name=call.name, arguments=call.arguments))


def names(tools: ToolUse | None) -> set[str] | None:
    """The functions whose calls are read out of the answer; None when no tools are offered."""
    if tools is None or not tools.offered:
        return None
    return {t.function.name for t in tools.tools}


def read_calls(text: str, tools: ToolUse | None) -> tuple[str | None, list[ResponseToolCall]]:
    """`(content, tool_calls)` of a whole answer."""
    offered = names(tools)
    if offered is None:
        return text, []
    content, calls = parse_calls(text, offered)
    return content, [response_call(c) for c in calls]


def _held_tail(text: str) -> int:
    """Length of the longest tail of `text` that begins the opening tag (it may become one)."""
    for size in range(min(len(text), len(_OPEN) - 1), 0, -1):
        if _OPEN.startswith(text[-size:]):
            return size
    return 0


class CallStream:
    """Splits streamed text into content and tool calls; `feed` and `finish` return the deltas to send."""

    def __init__(self, offered: set[str]):
        self.offered = offered
        self.buffer = ""
        self.inside = False  # the buffer starts with an opening tag
        self.calls = 0  # tool-call deltas sent

    def feed(self, piece: str) -> list[str | ToolCallDelta]:
        self.buffer += piece
        out: list[str | ToolCallDelta] = []
        while True:
            if not self.inside:
                start = self.buffer.find(_OPEN)
                if start < 0:
                    keep = _held_tail(self.buffer)
                    self._content(out, self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return out
                self._content(out, self.buffer[:start])
                self.buffer, self.inside = self.buffer[start:], True
            end = self.buffer.find(_CLOSE)
            if end < 0:
                return out
            block = self.buffer[:end + len(_CLOSE)]
            self.buffer, self.inside = self.buffer[end + len(_CLOSE):], False
            call = parse_call(block[len(_OPEN):-len(_CLOSE)].strip(), self.offered)
            if call is None:
                self._content(out, block)
            else:
                rc = response_call(call)
                out.append(ToolCallDelta(index=self.calls, id=rc.id, function=rc.function))
                self.calls += 1

    def finish(self) -> list[str | ToolCallDelta]:
        """What is left: an unfinished block or a held tail, as content."""
        out: list[str | ToolCallDelta] = []
        self._content(out, self.buffer)
        self.buffer, self.inside = "", False
        return out

    def _content(self, out: list, text: str) -> None:
        if text and self.calls == 0:  # after the first call, text outside calls is dropped (as in a whole answer)
            out.append(text)
