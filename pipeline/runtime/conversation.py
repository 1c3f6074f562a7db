"""A conversation as the checkpoint's own chat template renders it, cut where the linked chunks go.

`render_layout` renders the messages with `tokenizer.apply_chat_template` — the template compile used, never
hand-written string assembly — with a sentinel in place of every text part and a chunk sentinel at the start of
the content of the message that receives the store's chunks (the last user message). The rendered string is
cut at the sentinels and at the template's image markup:

    texts[0]  = everything from the first token to where the first such message's content starts
                (template start, system prompt, the turn's header)
    texts[i]  = from there to the next one's (that message's content, the answer, the next header …)
    texts[-1] = the last one's content, anything after it (a tool result), and the generation prompt

so `[texts[0]][group 0 re-anchored][texts[1]] … [group n-1][texts[n]]` is the template's own prompt with each
group of chunks at the start of its user turn — exactly where single-turn compile put them (after the template
prefix, which ends with the user header). The router puts a group at every user message (each earlier question
with the chunks it retrieves, the last with its own), so a follow-up's stream begins with the earlier turn's.
Template text is tokenised with special tokens parsed; user content with them split
(`split_special_tokens`), so a message cannot forge a role marker or an image token; both through one
`TextEncoder` per tokenizer (pipeline/runtime/text_encoder.py), safe from several threads.

`Segment`s hold token runs and images in order; the generator expands each image through the model's own
processor (`prepare_segment`), which yields the ids, pixel values and grids one forward takes.
"""

from __future__ import annotations

import hashlib
import io
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from PIL import Image, UnidentifiedImageError

from pipeline.runtime.text_encoder import text_encoder
from schemas.prompt import ImageRef, Piece, PromptLayout, Segment

if TYPE_CHECKING:  # the router and the plan hold layouts without loading torch
    import torch

    from pipeline.runtime.adapters import ChatTemplate

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")  # what a chat message's image may be (schemas/conversation.py's data URLs)
_TEXT = "\u2063QVPIC_PART_{}\u2063"
_CHUNKS = "\u2063QVPIC_CHUNKS_{}\u2063"
_SENTINEL = re.compile("\u2063QVPIC_(PART_\\d+|CHUNKS_\\d+)\u2063")


class ConversationError(ValueError):
    """The conversation cannot be rendered by this checkpoint's template (a 400: `param` names the message)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def decode_image(data: bytes, max_pixels: int) -> ImageRef:
    """Checked before any model work: it is PNG, JPEG or WebP (only those decoders are tried: Pillow would try
    every plugin it has on bytes that are none of them), its header's size is within `max_pixels` (before a pixel
    is decoded), and it decodes (ValueError saying which)."""
    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:
            width, height = image.size
            if width * height > max_pixels:
                raise ValueError(f"the image has {width}x{height} = {width * height} pixels; at most "
                                 f"{max_pixels} are accepted")
            image.load()  # a truncated or corrupt file fails here, not in the generator
    except UnidentifiedImageError:
        raise ValueError("the image does not decode as PNG, JPEG or WebP") from None
    except (OSError, Image.DecompressionBombError, SyntaxError) as error:
        raise ValueError(f"the image does not decode: {error}") from None
    return ImageRef(data, hashlib.sha256(data).hexdigest(), width, height)


def pil_image(image: ImageRef) -> Image.Image:
    """The decoded image in RGB (not copied again when it is RGB already: 48 MB at 16 MP)."""
    decoded = Image.open(io.BytesIO(image.data), formats=IMAGE_FORMATS)
    decoded.load()
    return decoded if decoded.mode == "RGB" else decoded.convert("RGB")


@dataclass(frozen=True)
class ChatPart:
    """One part of a message's content: text, or an image."""

    text: str | None = None
    image: ImageRef | None = None


@dataclass(frozen=True)
class ChatTurn:
    """A message as the template takes it (`developer` already mapped to `system`)."""

    role: str
    parts: tuple[ChatPart, ...]
    as_string: bool = True  # content was a string (rendered as one), not a list of parts
    name: str | None = None
    tool_calls: tuple[dict, ...] = ()
    tool_call_id: str | None = None


def render_layout(tokenizer, template: ChatTemplate, image_token: str, turns: Sequence[ChatTurn],
                  chunks_at: Sequence[int], tools: list[dict] | None = None, add_generation_prompt: bool = True,
                  continue_final: bool = False) -> PromptLayout:
    """The layout of `turns` with group g of chunks at the start of turn `chunks_at[g]`'s content (increasing;
    ConversationError if the template does not render every part exactly once, in order).

    Templates differ in the content they take: most render a string as it is, some (llava-hf's) iterate over a
    list of parts and render nothing of a string. As vLLM's `--chat-template-content-format auto` does, string
    content is tried as a string first, then as one text part, and the form that renders every message is kept.
    `tools` go to the template as they are (for one that renders them: serve/routing/tool_turns.py), and so do
    `add_generation_prompt` and `continue_final` (transformers' `continue_final_message`: the last message, an
    assistant one, rendered open so the answer continues it)."""
    ending = (add_generation_prompt, continue_final)
    try:
        return _render(tokenizer, template, image_token, turns, chunks_at, tools, True, ending)
    except ConversationError as error:
        if not any(t.as_string for t in turns):
            raise
        try:
            return _render(tokenizer, template, image_token, turns, chunks_at, tools, False, ending)
        except ConversationError:
            raise error from None


def _render(tokenizer, template: ChatTemplate, image_token: str, turns: Sequence[ChatTurn],
            chunks_at: Sequence[int], tools: list[dict] | None, strings: bool,
            ending: tuple[bool, bool] = (True, False)) -> PromptLayout:
    contents: list[str] = []  # the text parts, by their sentinel's number
    groups = {index: g for g, index in enumerate(chunks_at)}
    messages = []
    for index, turn in enumerate(turns):
        content: list[dict] = []
        if index in groups:
            content.append({"type": "text", "text": _CHUNKS.format(groups[index])})
        for part in turn.parts:
            if part.image is not None:
                content.append({"type": "image"})
            else:
                content.append({"type": "text", "text": _TEXT.format(len(contents))})
                contents.append(part.text or "")
        message: dict = {"role": turn.role}
        if strings and turn.as_string and all(c["type"] == "text" for c in content):
            message["content"] = "".join(c["text"] for c in content)
        elif turn.as_string:  # one text part (the chunk sentinel joined to it: the template renders no gap)
            message["content"] = [{"type": "text", "text": "".join(c["text"] for c in content)}]
        else:
            message["content"] = content
        if turn.name is not None:
            message["name"] = turn.name
        if turn.tool_calls:
            message["tool_calls"] = list(turn.tool_calls)
        if turn.tool_call_id is not None:
            message["tool_call_id"] = turn.tool_call_id
        messages.append(message)
    try:
        rendered = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=ending[0],
                                                 continue_final_message=ending[1], tokenize=False)
    except Exception as error:  # noqa: BLE001  a jinja error raised by the template itself (its own checks)
        raise ConversationError(f"the model's chat template refused the conversation: {error}", "messages") from None
    markup = template.image_before + image_token + template.image_after
    images = [part.image for turn in turns for part in turn.parts if part.image is not None]
    splitter = re.compile(f"({_SENTINEL.pattern}|{re.escape(markup)})")
    texts: list[list[Piece | int]] = [[]]  # an int: the number of a text in `pending`, encoded below
    pending: list[tuple[str, bool]] = []  # (text, split_special)
    seen, image_index = set(), 0

    def encode(text: str, split_special: bool) -> None:
        if text:
            texts[-1].append(len(pending))
            pending.append((text, split_special))

    for i, piece in enumerate(splitter.split(rendered)):
        kind = i % 3  # re.split with one outer and one inner group: text, whole match, inner group
        if kind == 0:
            encode(piece, split_special=False)
        elif kind == 1:
            if piece == markup:
                if image_index >= len(images):
                    raise ConversationError("the chat template renders more images than the messages hold", "messages")
                texts[-1].append(images[image_index])
                image_index += 1
            elif piece.startswith("\u2063QVPIC_CHUNKS_"):
                if int(piece[len("\u2063QVPIC_CHUNKS_"):-1]) != len(texts) - 1:
                    raise ConversationError("the chat template renders messages out of order", "messages")
                texts.append([])
            else:
                number = int(piece[len("\u2063QVPIC_PART_"):-1])
                if number in seen:
                    raise ConversationError("the chat template renders a message's content twice", "messages")
                seen.add(number)
                encode(contents[number], split_special=True)
    if len(texts) != len(chunks_at) + 1 or len(seen) != len(contents) or image_index != len(images):
        roles = sorted({t.role for t in turns})
        raise ConversationError(f"this model's chat template does not render every message (roles {roles}): "
                                "some content would be dropped", "messages")
    ids = _encoded(text_encoder(tokenizer), pending)
    return PromptLayout(tuple(Segment(tuple(ids[p] if isinstance(p, int) else p for p in group
                                            if not isinstance(p, int) or ids[p]))  # a text of no tokens: left out
                              for group in texts))


def _encoded(encoder, pending: list[tuple[str, bool]]) -> list[tuple[int, ...]]:
    """The ids of each (text, split_special) of `pending`, in order: one batch call per setting. A 256-message
    history is ~500 texts; encoded one call each, they held the GIL ~40 ms in all (issue 60): the batch call
    releases it."""
    ids: list[tuple[int, ...]] = [()] * len(pending)
    for split in (False, True):
        where = [i for i, (_, s) in enumerate(pending) if s is split]
        for i, encoded in zip(where, encoder.encode_many([pending[i][0] for i in where], split), strict=True):
            ids[i] = tuple(encoded)
    return ids


@dataclass
class PreparedSegment:
    """A segment as the model takes it: token ids with each image's tokens expanded, and its pixel inputs."""

    ids: list[int]
    pixel_values: list[torch.Tensor] = field(default_factory=list)  # one per image, in order
    grids: list[torch.Tensor] = field(default_factory=list)  # one `[1, 3]` (or LLaVA `[1, 2]`) per image
    image_spans: list[tuple[int, int, str]] = field(default_factory=list)  # (first column, end column, digest)

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    def tail(self, start: int) -> PreparedSegment:
        """Columns `[start, end)`; `start` must not fall inside an image."""
        if any(first < start < end for first, end, _ in self.image_spans):
            raise ValueError(f"column {start} lies inside an image")
        keep = [i for i, (first, _, _) in enumerate(self.image_spans) if first >= start]
        return PreparedSegment(self.ids[start:], [self.pixel_values[i] for i in keep], [self.grids[i] for i in keep],
                               [(f - start, e - start, d) for i, (f, e, d) in enumerate(self.image_spans) if i in keep])


def prepare_segment(vlm, segment: Segment) -> PreparedSegment:
    """Images expanded by the model's own processor (`VLM.image_inputs`), in order."""
    prepared = PreparedSegment([])
    for piece in segment.pieces:
        if isinstance(piece, ImageRef):
            pixel_values, grids, ids = vlm.image_inputs([pil_image(piece)])
            first = len(prepared.ids)
            prepared.ids.extend(ids)
            prepared.pixel_values.append(pixel_values)
            prepared.grids.append(grids)
            prepared.image_spans.append((first, len(prepared.ids), piece.digest))
        else:
            prepared.ids.extend(piece)
    return prepared
