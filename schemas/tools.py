"""Tool calling as OpenAI's chat API takes it (`tools`, `tool_choice`, `parallel_tool_calls`), and the one format
the model writes calls in: Qwen2.5's "hermes" form, which vLLM's `hermes` tool parser reads —

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Oslo"}}
    </tool_call>

one block per call, blocks separated by a newline. Everything that knows this format is here, so the prompt (the
tool block in the system message, earlier calls in the history: pipeline/runtime/conversation.py), the grammar
that forces a call (`call_grammar`, compiled by llguidance in serve/engine/grammar.py) and the parser of the
answer (`parse_calls`, `CallStream`) cannot disagree.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from schemas.schema_checks import MAX_SCHEMA_CHARS, schema_chars_error
from schemas.wire import JsonBool, Strict

MAX_TOOLS = 128  # OpenAI's
MAX_TOOL_SCHEMA_CHARS = MAX_SCHEMA_CHARS  # one function's parameters, as JSON
OPEN, CLOSE = "<tool_call>\n", "\n</tool_call>"
# Qwen2.5-Instruct's own tool block (its chat template's words), appended to the system prompt
_TOOLS_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                 "with function signatures within <tools></tools> XML tags:\n<tools>")
_TOOLS_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
                 "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                 "<args-json-object>}\n</tool_call>")
# the separators Qwen's template writes JSON with (`tojson`): the grammar makes the model write the same
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class FunctionDef(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule
    description: str | None = Field(None, max_length=8192)
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments object; none: no arguments
    strict: JsonBool | None = None  # always enforced when a call is forced: decoding follows the schema

    @field_validator("parameters")
    @classmethod
    def _a_small_schema(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        """Its size only: whether it is a JSON Schema is checked after the request is charged, on a worker
        (schemas/schema_checks.py, from serve/http/checks.py), never here on the ingress's event loop."""
        if parameters is not None and (error := schema_chars_error(parameters)):
            raise ValueError(error)
        return parameters

    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters or {"type": "object", "properties": {}}


class ToolDef(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolUse(Strict):
    """The tools of one request and how the model may use them (the native request's `tools`)."""

    tools: list[ToolDef] = Field(min_length=1, max_length=MAX_TOOLS)
    choice: ToolChoice = "auto"
    parallel: JsonBool = True  # several calls in one answer

    @model_validator(mode="after")
    def _consistent(self) -> ToolUse:
        names = [t.function.name for t in self.tools]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        if isinstance(self.choice, NamedToolChoice) and self.choice.function.name not in names:
            raise ValueError(f"tool_choice: names {self.choice.function.name!r}, which is not in tools {names[:16]}")
        return self

    @property
    def offered(self) -> bool:
        """Whether the model sees the tools: `tool_choice: none` renders none (and parses none)."""
        return self.choice != "none"

    @property
    def forced(self) -> list[FunctionDef] | None:
        """The functions one of which the answer must call (`required`, or the named one), else None."""
        if isinstance(self.choice, NamedToolChoice):
            return [t.function for t in self.tools if t.function.name == self.choice.function.name]
        return [t.function for t in self.tools] if self.choice == "required" else None

    def digest_material(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True)


def system_block(tools: list[ToolDef]) -> str:
    """The tools as Qwen2.5's template lists them (one `tojson` line per tool), for the end of the system prompt."""
    lines = "".join("\n" + json.dumps(t.model_dump(mode="json", exclude_none=True), ensure_ascii=False)
                    for t in tools)
    return _TOOLS_HEADER + lines + _TOOLS_FOOTER


def format_call(name: str, arguments: Any) -> str:
    """One call as the model writes it (and as Qwen's template renders an earlier call in the history)."""
    return OPEN + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + CLOSE


def call_grammar(functions: list[FunctionDef], parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) of an answer that is one call — or, with `parallel`, one or more — to
    one of `functions`, each call's JSON valid against that function's schema (name as a constant)."""
    calls = [{"type": "object", "properties": {"name": {"const": f.name}, "arguments": f.arguments_schema()},
              "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    schema = {"anyOf": calls, "x-guidance": JSON_STYLE} if len(calls) > 1 else {**calls[0], "x-guidance": JSON_STYLE}
    repeat = ' ("\\n" call)*' if parallel else ""
    return (f"start: call{repeat}\ncall: {json.dumps(OPEN)} body {json.dumps(CLOSE)}\n"
            f"body: %json{json.dumps(schema)}\n")  # unsorted: name before arguments, as Qwen writes


def call_or_json_grammar(functions: list[FunctionDef], parallel: bool, schema_json: str) -> str:
    """`tool_choice: auto` beside a JSON `response_format`: the answer is a call (`call_grammar`'s, to one of
    `functions`) or the JSON (`json_grammar`'s), as two alternatives of one grammar — whichever the model begins,
    it finishes valid. Each grammar's `start` rule is renamed; their other rules' names do not meet."""
    calls = call_grammar(functions, parallel).replace("start:", "calls:", 1)  # both begin with their start rule
    answer = json_grammar(schema_json).replace("start:", "answer:", 1)
    return "start: calls | answer\n" + calls + answer


def json_grammar(schema_json: str) -> str:
    """`response_format`'s JSON schema as a grammar of the same dialect (compact JSON)."""
    schema = {**json.loads(schema_json), "x-guidance": {"whitespace_flexible": False}}
    return f"start: %json{json.dumps(schema, sort_keys=True)}\n"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # the arguments object as JSON text (OpenAI's `function.arguments`)


_BLOCK = re.compile(re.escape(OPEN.strip()) + r"\s*(.*?)\s*" + re.escape(CLOSE.strip()), re.DOTALL)


def parse_call(body: str, names: set[str]) -> ParsedCall | None:
    """The call in one block's body, or None when it is not a JSON call of a known function."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("name") not in names or not isinstance(data.get("arguments", {}), dict):
        return None
    return ParsedCall(data["name"], json.dumps(data.get("arguments", {}), ensure_ascii=False))


def parse_calls(text: str, names: set[str]) -> tuple[str | None, list[ParsedCall]]:
    """An answer split into its text and its calls (vLLM's hermes parser's reading): no well-formed call of a known
    function → the whole text and no calls; else the text before the first block (None when blank) and the calls."""
    calls, first = [], None
    for match in _BLOCK.finditer(text):
        call = parse_call(match.group(1), names)
        if call is None:
            return text, []
        first = match.start() if first is None else first
        calls.append(call)
    if not calls:
        return text, []
    content = text[:first]
    return (content if content.strip() else None), calls
