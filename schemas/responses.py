"""OpenAI's Responses API request (`POST /v1/responses`), read as the chat request it stands for.

`instructions` becomes the leading system message; `input` is a string (one user message) or a list of items:
messages (`input_text` / `input_image` parts, or an assistant's `output_text` / `refusal` parts as the SDK echoes
them back), `function_call` items (an assistant's tool calls: consecutive ones join one assistant turn) and
`function_call_output` items (tool results). Function tools are flat here (`{"type": "function", "name", …}`) where
chat nests them in `function`; `text.format` is chat's `response_format`; `max_output_tokens` is `max_tokens`.
The conversation then runs the chat path (schemas/chat.py `ChatCompletionRequest`, so every limit and check is
chat's). Same rules as the chat request: unknown fields are a 400 naming them, `null` is an optional field's
default. Output models are serve/http/openai/responses.py's.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationError, field_validator

from schemas.api import MAX_NEW_TOKENS
from schemas.chat import ChatCompletionRequest, QvpicOptions
from schemas.conversation import (
    MAX_MESSAGES,
    MAX_PARTS,
    MAX_TEXT_CHARS,
    FunctionCall,
    ImagePart,
    ImageURL,
    Message,
    TextPart,
    ToolCall,
)
from schemas.decoding import JsonSchemaFormat, ResponseFormat
from schemas.tools import MAX_TOOLS, FunctionDef, NamedFunction, NamedToolChoice, ToolDef
from schemas.wire import JsonBool, JsonFloat, JsonInt, NullIsDefault, Strict, Utf8Str

MAX_ID_CHARS = 256


class InputText(Strict):
    type: Literal["input_text"]
    text: Utf8Str = Field(max_length=MAX_TEXT_CHARS)


class InputImage(Strict, NullIsDefault):
    type: Literal["input_image"]
    image_url: str = Field(max_length=ImageURL.model_fields["url"].metadata[0].max_length, description="a data: "
                           "URL (base64 PNG, JPEG or WebP); the server fetches nothing")
    detail: Literal["auto", "low", "high"] | None = None

    @field_validator("image_url")
    @classmethod
    def _data_url(cls, url: str) -> str:
        try:
            return ImageURL(url=url).url  # chat's rule
        except ValidationError as error:  # raised as this field's own, so the 400 names input[i].content[j].image_url
            raise ValueError(str(error.errors()[0]["msg"]).removeprefix("Value error, ")) from None


class EchoedText(Strict, NullIsDefault):
    """An earlier answer's text, as the SDK echoes an output message back."""

    type: Literal["output_text"]
    text: Utf8Str = Field(max_length=MAX_TEXT_CHARS)
    annotations: list[dict[str, Any]] | None = Field(None, max_length=MAX_PARTS)  # accepted, not rendered
    logprobs: list[dict[str, Any]] | None = Field(None, max_length=MAX_NEW_TOKENS)  # accepted, not rendered


class Refusal(Strict):
    type: Literal["refusal"]
    refusal: Utf8Str = Field(max_length=MAX_TEXT_CHARS)


Part = Annotated[InputText | InputImage | EchoedText | Refusal, Field(discriminator="type")]


class MessageItem(Strict, NullIsDefault):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Utf8Str | Annotated[list[Part], Field(max_length=MAX_PARTS)] = Field(max_length=MAX_TEXT_CHARS)
    id: str | None = Field(None, max_length=MAX_ID_CHARS)  # an echoed output message's: accepted
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def message(self) -> Message:
        if isinstance(self.content, str):
            return Message(role=self.role, content=self.content)
        parts = [ImagePart(type="image_url", image_url=ImageURL(url=p.image_url, detail=p.detail))
                 if isinstance(p, InputImage) else
                 TextPart(type="text", text=p.refusal if isinstance(p, Refusal) else p.text) for p in self.content]
        return Message(role=self.role, content=parts)


class FunctionCallItem(Strict, NullIsDefault):
    type: Literal["function_call"]
    call_id: Utf8Str = Field(min_length=1, max_length=MAX_ID_CHARS)
    name: Utf8Str = Field(min_length=1, max_length=256)
    arguments: Utf8Str = Field(max_length=MAX_TEXT_CHARS)
    id: str | None = Field(None, max_length=MAX_ID_CHARS)
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(Strict, NullIsDefault):
    type: Literal["function_call_output"]
    call_id: Utf8Str = Field(min_length=1, max_length=MAX_ID_CHARS)
    output: Utf8Str = Field(max_length=MAX_TEXT_CHARS)
    id: str | None = Field(None, max_length=MAX_ID_CHARS)
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_kind(item: Any) -> str:
    """An item without `type` is a message (OpenAI's `EasyInputMessage`)."""
    kind = item.get("type") if isinstance(item, dict) else getattr(item, "type", None)
    return kind or "message"


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")], Discriminator(_item_kind)]


def conversation(items: list[MessageItem | FunctionCallItem | FunctionCallOutputItem]) -> list[Message]:
    """Items as chat messages: a function call joins the assistant turn just before it (its text, or the calls
    before it), as the model wrote them in one answer."""
    messages: list[Message] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append(item.message())
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(Message(role="tool", tool_call_id=item.call_id, content=item.output))
        else:
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(Message(role="assistant", content=None, tool_calls=[call]))
    return messages


class FunctionTool(Strict, NullIsDefault):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = Field(None, max_length=8192)
    parameters: dict[str, Any] | None = None
    strict: JsonBool | None = None  # always enforced when a call is forced

    def chat(self) -> ToolDef:
        return ToolDef(type="function", function=FunctionDef(name=self.name, description=self.description,
                                                             parameters=self.parameters, strict=self.strict))


class NamedFunctionChoice(Strict):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)


class TextFormat(Strict, NullIsDefault):
    """`text.format`: chat's `response_format` with the json_schema's fields at its top."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: JsonBool | None = None

    def response_format(self) -> ResponseFormat:
        if self.type != "json_schema":
            if self.name is not None or self.schema_ is not None:
                raise ValueError(f"text.format: name and schema go with type json_schema, not {self.type}")
            return ResponseFormat(type=self.type)
        if self.name is None:
            raise ValueError("text.format.name: a json_schema format needs a name")
        schema = JsonSchemaFormat(name=self.name, description=self.description, schema=self.schema_ or {},
                                  strict=self.strict)
        return ResponseFormat(type="json_schema", json_schema=schema)


class TextConfig(Strict, NullIsDefault):
    format: TextFormat = TextFormat(type="text")
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted: no verbosity control here


class ResponseRequest(Strict, NullIsDefault):
    """OpenAI's `responses.create` parameters this server takes; any other is a 400 naming it (docs/OPENAI.md)."""

    model: str = Field(min_length=1, max_length=256)
    input: Utf8Str | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)] = Field(
        max_length=MAX_TEXT_CHARS)
    instructions: Utf8Str | None = Field(None, max_length=MAX_TEXT_CHARS)
    previous_response_id: str | None = Field(None, min_length=1, max_length=MAX_ID_CHARS)
    store: JsonBool = True  # OpenAI's default: kept for GET and previous_response_id (per tenant, bounded, expiring)
    stream: JsonBool = False
    max_output_tokens: JsonInt | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    temperature: JsonFloat = Field(1.0, ge=0.0, le=2.0)
    top_p: JsonFloat = Field(1.0, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: JsonBool | None = None
    text: TextConfig = Field(default_factory=TextConfig)
    user: str | None = Field(None, max_length=256)
    safety_identifier: str | None = Field(None, max_length=256)
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=16)  # kept with a stored response, returned as given
    include: list[Literal["message.output_text.logprobs"]] | None = Field(None, max_length=1)
    truncation: Literal["disabled"] | None = None  # the context is never cut: a prompt past it is a 413
    prompt_cache_key: str | None = Field(None, max_length=256)  # accepted and ignored, as chat's
    service_tier: Literal["auto", "default"] | None = None
    qvpic: QvpicOptions = Field(default_factory=QvpicOptions)

    def items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def chat(self, history: list[Message]) -> ChatCompletionRequest:
        """The chat request this stands for, after `history` (a stored response's conversation). ValueError
        naming the field when the conversation is not one chat takes."""
        system = [Message(role="system", content=self.instructions)] if self.instructions is not None else []
        choice = self.tool_choice
        if isinstance(choice, NamedFunctionChoice):
            choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
        fields = dict(model=self.model, messages=[*system, *history, *conversation(self.items())],
                      max_completion_tokens=self.max_output_tokens, temperature=self.temperature, top_p=self.top_p,
                      tools=[t.chat() for t in self.tools] if self.tools else None, tool_choice=choice,
                      parallel_tool_calls=self.parallel_tool_calls, response_format=self.text.format.response_format(),
                      logprobs=bool(self.include), stream=self.stream, user=self.user,
                      safety_identifier=self.safety_identifier, qvpic=self.qvpic)
        try:
            return ChatCompletionRequest(**fields)
        except ValidationError as error:
            first = error.errors()[0]
            text = str(first["msg"]).removeprefix("Value error, ")
            where = ".".join(str(p) for p in first["loc"] if not isinstance(p, int))
            if where and not text.startswith(where):
                text = f"{where}: {text}"
            for chat_name, name in _CHAT_NAMES.items():  # the field as this request spells it
                if text.startswith(chat_name):
                    rest = text.removeprefix(chat_name + ":").strip()  # "messages[3]: …" keeps chat's index
                    text = f"{name}: {rest}"
                    break
            raise ValueError(text) from None


# chat's field names in the messages of the chat request's checks → this request's (the conversation is `input`,
# with the instructions and a stored history before it: chat's message index is kept in the text)
_CHAT_NAMES = {"messages": "input", "response_format": "text.format", "max_completion_tokens": "max_output_tokens"}
