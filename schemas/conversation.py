"""Messages of a conversation, as OpenAI's chat API (and vLLM's) take them.

Roles `system`, `developer` (rendered as `system`: the templates qvpic serves have no developer role), `user`,
`assistant` (content may be empty or null, with `tool_calls`) and `tool` (a tool's result, `tool_call_id`); the
deprecated `function` role and an assistant's `function_call` read as a tool result and a tool call.
Content is a string or a list of parts: `text`, and `image_url` with a `data:` URL (PNG, JPEG, WebP) in user
messages, or an `http(s)` URL that the ingress fetches where the operator allows it (`ingress.image_urls`,
serve/http/image_urls.py; refused by default). Every string and list is bounded here; the
token count of the whole conversation is checked against the context by the router (413 naming the limit).
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, field_validator, model_validator

from schemas.wire import NullIsDefault, Strict, Utf8Str

MAX_MESSAGES = 256
MAX_TEXT_CHARS = 200_000  # one text part or string content
MAX_CONVERSATION_CHARS = 400_000  # all text of all messages
MAX_PARTS = 64  # content parts of one message
MAX_IMAGES = 8  # image parts of one conversation
MAX_IMAGE_BYTES = 8 << 20  # one decoded image
MAX_IMAGE_PIXELS = 16_000_000  # width × height of one image, before the processor's own resize
MAX_URL_CHARS = 2048  # an http(s) image URL
_DATA_URL = re.compile(r"^data:image/(png|jpeg|jpg|webp);base64,(.*)$", re.DOTALL)
IMAGE_URLS_KEY = "ingress.image_urls.enabled"  # the serve config key that lets the ingress fetch image URLs


class TextPart(Strict):
    type: Literal["text"]
    text: Utf8Str = Field(max_length=MAX_TEXT_CHARS)


class ImageURL(Strict):
    url: str = Field(max_length=(MAX_IMAGE_BYTES * 4) // 3 + 64, description="a data: URL (base64 PNG, JPEG or "
                     "WebP), or an http(s) URL where the server's operator allows fetching (else a 400)")
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the processor's own resize decides

    @field_validator("url")
    @classmethod
    def _data_url(cls, url: str) -> str:
        if url.startswith(("http://", "https://")):
            if len(url) > MAX_URL_CHARS:
                raise ValueError(f"an image URL has at most {MAX_URL_CHARS} characters")
            return url  # whether it is fetched is the ingress's decision (its config), not the schema's
        if _DATA_URL.match(url) is None:
            raise ValueError("expected a data:image/png, image/jpeg or image/webp URL with base64 data, or an "
                             "http(s) URL")
        return url

    @property
    def remote(self) -> bool:
        """An http(s) URL, not yet fetched (the ingress replaces it with the fetched image's data: URL)."""
        return self.url.startswith(("http://", "https://"))

    def data(self) -> bytes:
        if self.remote:  # reached a role without the ingress's fetch (it is off, or this is not the ingress)
            raise ValueError(f"image URLs are not fetched by this server (serve config {IMAGE_URLS_KEY} is off); "
                             "send the image as a data: URL")
        match = _DATA_URL.match(self.url)
        assert match is not None  # validated
        try:
            return base64.b64decode(match.group(2), validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("the image's base64 data does not decode") from None


class ImagePart(Strict):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(Strict, NullIsDefault):
    name: Utf8Str = Field(min_length=1, max_length=256)
    arguments: Utf8Str = Field("", max_length=MAX_TEXT_CHARS)  # JSON text, as the model wrote it


class ToolCall(Strict, NullIsDefault):
    id: Utf8Str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Strict, NullIsDefault):
    """A message as OpenAI takes it, an assistant message as the openai SDK dumps it included
    (`message.model_dump()`: `refusal`, `annotations`, `audio` and `function_call`, null or not). The deprecated
    function-calling turns read as tool turns: `function_call` as the one call of `tool_calls`, role `function`
    as a `tool` result (`_legacy_turns`)."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Utf8Str | Annotated[list[ContentPart], Field(max_length=MAX_PARTS)] | None = Field(
        None, max_length=MAX_TEXT_CHARS)
    name: Utf8Str | None = Field(None, min_length=1, max_length=64)
    tool_calls: list[ToolCall] | None = Field(None, max_length=64)  # assistant messages
    tool_call_id: Utf8Str | None = Field(None, max_length=256)  # tool messages
    # what an echoed assistant message carries beside its content: a refusal is its text (when content is null);
    # annotations (url citations) and an audio reference are accepted and not rendered (no audio output here)
    refusal: Utf8Str | None = Field(None, max_length=MAX_TEXT_CHARS)
    annotations: list[dict[str, Any]] | None = Field(None, max_length=MAX_PARTS)
    audio: dict[str, Annotated[str, Field(max_length=256)]] | None = Field(None, max_length=4)
    function_call: FunctionCall | None = None  # deprecated by OpenAI: an assistant message's one call

    @model_validator(mode="after")
    def _legacy_turns(self) -> Message:
        """OpenAI's deprecated function-calling turns as the tool turns they stand for: the model reads one form."""
        if self.role == "function":
            self.role = "tool"
        if self.function_call is not None:
            if self.tool_calls:
                raise ValueError("function_call: give tool_calls or function_call, not both")
            self.tool_calls = [ToolCall(id=f"call_{self.function_call.name}"[:256], function=self.function_call)]
            self.function_call = None
        if self.content is None and self.refusal is not None:
            self.content = self.refusal
        return self
    def text(self) -> str:
        """The message's text, its parts joined (images left out)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))

    def images(self) -> list[ImageURL]:
        return [p.image_url for p in self.content or [] if isinstance(p, ImagePart)] \
            if not isinstance(self.content, str) else []


# a conversation as pydantic's JSON and back (Rust both ways): how it crosses Serve handles and the framing pipe
MESSAGES = TypeAdapter(list[Message])


def check_conversation(messages: list[Message], continue_final: bool = False) -> None:
    """What OpenAI's shape alone does not say (ValueError naming the message). `continue_final` (vLLM's
    `continue_final_message`): the conversation ends with the assistant message the answer continues."""
    if not any(m.role == "user" for m in messages):
        raise ValueError("messages: a conversation needs at least one user message")
    last = messages[-1]
    if continue_final:
        if last.role != "assistant" or last.tool_calls or not isinstance(last.content, str):
            raise ValueError("continue_final_message: the conversation must end with an assistant message whose "
                             "content is text (the answer continues it)")
    elif last.role not in ("user", "tool"):
        raise ValueError(f"messages[{len(messages) - 1}]: the conversation ends with a {last.role} message; it must "
                         "end with a user or tool message (continuing an assistant message is not supported)")
    images = 0
    for i, message in enumerate(messages):
        found = message.images()
        if found and message.role != "user":
            raise ValueError(f"messages[{i}].content: image parts are accepted in user messages only")
        images += len(found)
        if message.role in ("user", "system", "developer") and message.content is None:
            raise ValueError(f"messages[{i}].content: a {message.role} message needs content")
        if message.tool_calls is not None and message.role != "assistant":
            raise ValueError(f"messages[{i}].tool_calls: only assistant messages carry tool calls")
    if images > MAX_IMAGES:
        raise ValueError(f"messages: {images} images; at most {MAX_IMAGES} per conversation")
    chars = sum(len(m.text()) for m in messages)
    if chars > MAX_CONVERSATION_CHARS:
        raise ValueError(f"messages: {chars} characters of text; at most {MAX_CONVERSATION_CHARS} per conversation")


def last_user_index(messages: list[Message]) -> int:
    return max(i for i, m in enumerate(messages) if m.role == "user")
