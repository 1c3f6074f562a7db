"""What the model reads around a request's chunks, as token ids and images (`PromptLayout`), and its size.

A conversation (`messages`) is rendered by the checkpoint's own chat template with the chunks at the start of
the last user message's content (pipeline/runtime/conversation.py). A native request without messages keeps
its prompt: `[template prefix][instruction]`, the chunks, `[query prompt or query][turn end]`. `PromptTemplate`
is what the router loads of the model to do this without its weights: the tokenizer, the template cut and the
family's vision-token arithmetic, so the context is priced before any model work.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from transformers import AutoConfig, AutoTokenizer

from pipeline.priority import BULK_NICE
from pipeline.runtime import ChatTemplate, family_classes, resolve_path, vision_tokens
from pipeline.runtime.conversation import ChatPart, ChatTurn, ConversationError, decode_image, render_layout
from pipeline.runtime.text_encoder import text_encoder
from pipeline.runtime.threads import in_passing_thread
from schemas.api import AnswerRequest
from schemas.config import ModelFamily, ModelSpec
from schemas.conversation import MAX_IMAGE_PIXELS, ImagePart, Message, last_user_index
from schemas.errors import ApiError, ContextLengthError
from schemas.prompt import PromptLayout, Segment
from schemas.schema_checks import MAX_ARGUMENTS_DEPTH, arguments_depth_error
from schemas.tools import ToolUse
from serve.plan import PlannedChunk
from serve.routing.tool_turns import default_system, hermes_turns, renders_tools, tool_dicts

# families whose language model is Qwen2 / Qwen2.5, trained on Qwen2.5's tool format (serve/routing/tool_turns.py)
HERMES_FAMILIES = frozenset({ModelFamily.QWEN2_5_VL, ModelFamily.QWEN2_VL, ModelFamily.LLAVA_ONEVISION})


@dataclass(frozen=True)
class Framing:
    """`PromptTemplate.frame`'s result: the prompt's text around the chunks, and the conversation's identity."""

    layout: PromptLayout  # the texts between the groups of chunks
    text_tokens: tuple[int, ...]  # tokens of each of `layout.texts`
    conversation: str = ""  # conversation_digest of a chat request ("" without messages)
    conversation_chain: tuple[str, ...] = ()  # conversation_chain of a chat request's messages

    def refuse_past(self, context_tokens: int, max_new_tokens: int) -> None:
        """ContextLengthError once the prompt's text, counted exactly, and `max_new_tokens` exceed the context:
        before any chunk is retrieved (the route refuses what the chunks then add); its counted tokens are charged."""
        text_tokens = sum(self.text_tokens)
        if text_tokens + max_new_tokens > context_tokens:
            raise ContextLengthError(
                f"request needs {text_tokens + max_new_tokens} tokens before any chunk (prompt text {text_tokens} + "
                f"max_new_tokens {max_new_tokens}); the context holds {context_tokens}", counted_tokens=text_tokens)


class InvalidMessageError(ApiError):
    """A message the model cannot take (400); `param` is its path, e.g. `messages[2].content[1].image_url`."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # crosses Serve handles and the framing process: keep the path
        return type(self), (str(self), self.param)


@dataclass(frozen=True)
class PromptTemplate:
    """What the router needs of the model without loading its weights: token counts and limits."""

    tokenizer: object
    template: ChatTemplate
    max_positions: int
    image_token: str
    family: ModelFamily
    spec: ModelSpec
    native_tools: bool = False  # the template renders `tools` itself (else Qwen2.5's format: tool_turns.py)
    default_system: str = ""  # what the template writes as the system prompt when a conversation has none

    @classmethod
    def load(cls, spec: ModelSpec) -> PromptTemplate:
        path = resolve_path(spec)
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=spec.trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=spec.trust_remote_code)
        image_token = tokenizer.convert_ids_to_tokens(config.image_token_id)
        template = ChatTemplate.from_tokenizer(tokenizer, image_token)
        text_config = getattr(config, "text_config", config)
        return cls(tokenizer, template, int(text_config.max_position_embeddings), image_token,
                   family_classes(config.model_type).family, spec, renders_tools(tokenizer), default_system(tokenizer))

    def encode(self, text: str) -> list[int]:
        return text_encoder(self.tokenizer).encode(text)  # from any thread: the router frames on worker threads

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def native(self, instruction: str, text_after: str) -> PromptLayout:
        """`[template prefix][instruction]` before the chunks, `[text_after][turn end]` after them."""
        before = self.encode(self.template.prefix) + (self.encode(instruction) if instruction else [])
        return PromptLayout.of(Segment.of_ids(before), Segment.of_ids(self.encode(text_after)
                                                                      + self.encode(self.template.turn_suffix)))

    def conversation(self, messages: list[Message], chunks_at: list[int] | None = None,
                     tools: ToolUse | None = None, add_generation_prompt: bool = True,
                     continue_final: bool = False) -> PromptLayout:
        """The template's rendering of `messages` (and the `tools` offered), cut where each group of chunks goes: at
        the start of the content of the user messages `chunks_at` (default: the last one). vLLM's
        `add_generation_prompt` and `continue_final_message` go to the template as they are.
        InvalidMessageError: 400."""
        turns = [chat_turn(i, m) for i, m in enumerate(messages)]
        chunks_at = chunks_at or [last_user_index(messages)]
        offered = tools.tools if tools is not None and tools.offered else None
        native = None
        if self.native_tools:
            native = tool_dicts(offered) if offered else None
        elif offered or any(t.tool_calls or t.role == "tool" for t in turns):
            if self.family not in HERMES_FAMILIES:
                raise InvalidMessageError(f"tools: this model's chat template ({self.family.value}) has no tool "
                                          "format, and its language model was not trained on one", "tools")
            turns, where = hermes_turns(turns, offered, self.default_system)
            chunks_at = [where[i] for i in chunks_at]
        try:
            return render_layout(self.tokenizer, self.template, self.image_token, turns, chunks_at, native,
                                 add_generation_prompt, continue_final)
        except ConversationError as error:
            raise InvalidMessageError(str(error), error.param) from None

    def frame(self, request: AnswerRequest, groups: int) -> Framing:
        """The prompt's text around `groups` groups of chunks, laid out and counted, and the conversation's digests:
        the part of a route that needs no query vector and no store (the router runs it on a thread, or a large
        conversation's in a framing process: serve/routing/framer.py). InvalidMessageError: 400."""
        if request.messages is None:
            layout = self.native(request.instruction, request.text_after_chunks)
            return Framing(layout, tuple(self.tokens(t) for t in layout.texts))
        return self.frame_conversation(request.messages, groups, request.tools, request.add_generation_prompt,
                                       request.continue_final_message)

    def frame_conversation(self, messages: list[Message], groups: int, tools: ToolUse | None = None,
                           add_generation_prompt: bool = True, continue_final: bool = False) -> Framing:
        """`frame` of a conversation: its groups sit at its last `groups` user messages."""
        users = [i for i, m in enumerate(messages) if m.role == "user"]
        layout = self.conversation(messages, users[-groups:], tools, add_generation_prompt, continue_final)
        return Framing(layout, tuple(self.tokens(t) for t in layout.texts),
                       conversation_digest(messages, tools, add_generation_prompt, continue_final),
                       conversation_chain(messages))

    def conversation_tokens(self, messages: list[Message]) -> list[int]:
        """`/tokenize`'s answer for `messages`: the prompt's token ids as a chat request's holds them, no chunks."""
        layout = self.conversation(messages)
        return [t for text in layout.texts for piece in text.pieces if isinstance(piece, tuple) for t in piece]

    def tokens(self, segment: Segment) -> int:
        """Tokens of `segment` as the model will see it: text, plus each image's markup and vision tokens as the
        processor will make them (pipeline/runtime/tokens.py, the same arithmetic `qvpic estimate` prices with)."""
        markup = self.count(self.template.image_before) + self.count(self.template.image_after)
        total = segment.text_tokens()
        for image in segment.images:
            total += markup + vision_tokens(self.family, image.width_px, image.height_px,
                                            min_pixels=self.spec.min_pixels, max_pixels=self.spec.max_pixels)
        return total


def chat_turn(index: int, message: Message) -> ChatTurn:
    """One message as the template takes it: `developer` as `system`, images decoded and checked."""
    role = "system" if message.role == "developer" else message.role
    tool_calls = tuple({"id": c.id, "type": c.type, "function": {
        "name": c.function.name,
        "arguments": _arguments(c.function.arguments, f"messages[{index}].tool_calls[{j}].function.arguments")}}
        for j, c in enumerate(message.tool_calls or ()))
    common = dict(name=message.name, tool_calls=tool_calls, tool_call_id=message.tool_call_id)
    if message.content is None or isinstance(message.content, str):
        return ChatTurn(role, (ChatPart(text=message.content or ""),), as_string=True, **common)
    parts = []
    for j, part in enumerate(message.content):
        if isinstance(part, ImagePart):
            param = f"messages[{index}].content[{j}].image_url"
            try:
                # decoded at a lower CPU priority: up to 16 MP, ~210 ms of a core; b's question goes first (issue 60)
                image = in_passing_thread(decode_image, part.image_url.data(), MAX_IMAGE_PIXELS, name="qvpic-image",
                                          nice=BULK_NICE)
                parts.append(ChatPart(image=image))
            except ValueError as error:
                raise InvalidMessageError(f"{param}: {error}", param) from None
        else:
            parts.append(ChatPart(text=part.text))
    return ChatTurn(role, tuple(parts), as_string=False, **common)


def _arguments(arguments: str, param: str):
    """Templates render a call's arguments from a mapping (Qwen's `tojson`); keep the text when it is not JSON.
    Arguments nested past MAX_ARGUMENTS_DEPTH (past the parser's recursion limit, a RecursionError: a 500) are a
    400 naming `param`."""
    try:
        value = json.loads(arguments) if arguments else {}
    except RecursionError:
        raise InvalidMessageError(f"{param}: the arguments nest deeper than {MAX_ARGUMENTS_DEPTH} levels",
                                  param) from None
    except ValueError:
        return arguments
    if error := arguments_depth_error(value):
        raise InvalidMessageError(f"{param}: {error}", param)
    return value


def conversation_digest(messages: list[Message], tools: ToolUse | None = None, add_generation_prompt: bool = True,
                        continue_final: bool = False) -> str:
    """sha256 of the conversation as sent, its tools and how its end is rendered: what the response cache keys an
    answer to it on (the default rendering keeps the digest it had before vLLM's two flags)."""
    ending = [] if add_generation_prompt and not continue_final else [add_generation_prompt, continue_final]
    material = json.dumps([[m.model_dump(mode="json") for m in messages],
                           tools.digest_material() if tools is not None else None, *ending], sort_keys=True)
    return hashlib.sha256(material.encode()).hexdigest()


def conversation_chain(messages: list[Message]) -> tuple[str, ...]:
    """sha256 of each prefix of the conversation (messages[:1], messages[:2], …, all): a turn's whole
    conversation is a prefix of its follow-up's, which is how the affinity router finds the replica holding
    the earlier turn's KV in its prefix cache (serve/dispatch/affinity.py)."""
    chain, digest = [], hashlib.sha256()
    for message in messages:
        digest.update(json.dumps(message.model_dump(mode="json"), sort_keys=True).encode() + b"\x00")
        chain.append(digest.copy().hexdigest())
    return tuple(chain)


def retrieval_text(messages: list[Message]) -> str:
    """What retrieval embeds by default: the last user message's text."""
    return messages[last_user_index(messages)].text()


def template_order(chunks: list[PlannedChunk], instruction: str, text_after: str
                   ) -> tuple[list[PlannedChunk], str, str]:
    """`(chunks, instruction, text after the chunks)` in the order a chat template that renders every image of a
    turn before any of its text (`ChatTemplate.images_first`: LLaVA-OneVision's) renders the same content: the
    chunks served as pages first, then those served as text, each in request order; with pages in context the
    instruction, being text, follows them too, at the front of the text prefilled after the chunks. That is the
    template's own prompt unless text chunks sit beside pages: the template would put the instruction before
    them, and linked KV leaves no place to prefill text between chunks, so there it comes after them."""
    pages = [c for c in chunks if c.tier is not None]
    if not pages:
        return chunks, instruction, text_after
    return pages + [c for c in chunks if c.tier is None], "", instruction + text_after
