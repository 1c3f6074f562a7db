"""Wire contracts of the online API: native `/v1/answer`, estimates, error bodies (the errors: schemas/errors.py;
OpenAI shapes: schemas/chat.py).

Every request model rejects unknown fields and bounds every list and string, so a request is either
well-formed or a 422 before any work starts. No field names a filesystem path or URI: ids are opaque
keys looked up in the store the server was started on.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Annotated

from pydantic import Field, StringConstraints, model_validator

from schemas.config import MAX_RAW_TAU, ScoreNormalisation, check_tau
from schemas.conversation import MAX_MESSAGES, MESSAGES, Message, check_conversation
from schemas.decoding import Decoding
from schemas.modes import ChunkOrder, Mode
from schemas.tools import FunctionDef, ToolUse, call_grammar, call_or_json_grammar
from schemas.wire import JsonBool, JsonFloat, JsonInt, Strict

MAX_IDS_PER_REQUEST = 1024  # body-shape cap (422); the server's `max_chunks` (413) is usually lower
MAX_QUERY_CHARS = 8_000
MAX_NEW_TOKENS = 4_096
MAX_SEED = 2**63 - 1
MAX_TIMEOUT_S = 3600.0

# Printable, bounded, no control characters: ids are looked up, never opened.
StoreId = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$")]
Query = Annotated[str, StringConstraints(min_length=1, max_length=MAX_QUERY_CHARS)]
# Tenant and task-type names: short, printable, safe as log columns and cache-key parts.
Label = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:@-]*$")]


class FinishReason(str, Enum):
    STOP = "stop"  # the model ended its turn
    LENGTH = "length"  # max_new_tokens reached
    TOOL_CALLS = "tool_calls"  # the answer is tool calls (the OpenAI surface reads them out of the text)


class ErrorBody(Strict):
    detail: str


class BudgetErrorBody(ErrorBody):
    """413 of a request over its token budget."""

    # what the request needs at least: its whole prompt (qvpic: every chunk at its lowest tier) and n × max_tokens
    min_context_tokens: int
    budget_tokens: int


# ---- chunk selection -------------------------------------------------------------------------------
class Selection(Strict):
    """Which chunks form the context: an ordered id list, whole documents, or retrieval."""

    chunk_ids: list[StoreId] | None = Field(None, min_length=1, max_length=MAX_IDS_PER_REQUEST)
    doc_ids: list[StoreId] | None = Field(None, min_length=1, max_length=MAX_IDS_PER_REQUEST)
    top_k: JsonInt | None = Field(None, ge=0, le=MAX_IDS_PER_REQUEST, description="retrieve this many chunks; 0: "
                                  "none (plain chat over the prompt alone)")
    order: ChunkOrder = Field(ChunkOrder.RETRIEVAL, description="top_k: the order retrieved chunks are assembled "
                              "in (best first, or as they appear in their documents)")

    def num_given(self) -> int:
        return sum(v is not None for v in (self.chunk_ids, self.doc_ids, self.top_k))


class Routing(Strict):
    mode: Mode = Mode.QVPIC
    tau: JsonFloat | None = Field(None, ge=0.0, le=MAX_RAW_TAU, description="cumulative relevance share promoted "
                                  "(raw normalisation: cumulative cosine, may exceed 1); server default when null")
    normalisation: ScoreNormalisation | None = Field(None, description="how relevance becomes what τ is compared "
                                                     "with (server default when null)")
    max_high_res: JsonInt | None = Field(None, ge=0, le=MAX_IDS_PER_REQUEST, description="budget B of promoted chunks")
    tier: str | None = Field(None, pattern=r"^[a-z][a-z0-9_]{0,31}$",
                             description="uniform modes (uniform, image_pic, image_pic_dummy): the tier of every "
                             "chunk; routed modes (qvpic, full_image): the tier chunks are promoted to. Default: "
                             "the mode's own (highest for uniform and routed modes, lowest for the image_pic ones)")

    @model_validator(mode="after")
    def _tier_fits_mode(self) -> Routing:
        if self.tier is not None and not self.mode.takes_tier:
            raise ValueError(f"mode {self.mode.value!r} takes no tier (uniform_high is uniform at the highest tier)")
        if self.tau is not None and self.normalisation is not None:
            check_tau(self.tau, self.normalisation)
        return self


class Attribution(Strict):
    task_type: Label | None = Field(None, description="what the request is for (cost reports; for a task type "
                                    "the server declares query-independent, the l3 response cache answers a repeated "
                                    "task over the same chunks); else header X-Task-Type")


def check_generation_prompt(add_generation_prompt: bool, continue_final_message: bool) -> None:
    """vLLM's rule: an open final message takes no assistant header after it."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message: needs add_generation_prompt false (vLLM's rule: the answer "
                         "continues the final message, so no new assistant turn opens after it)")


class Prompt(Strict):
    """The text around the chunks. The router scores chunks against `query` alone; the model reads
    `[chat prefix][instruction][chunks][query_prompt, or query if none][assistant header]`."""

    query: str = Field(max_length=MAX_QUERY_CHARS, description="the question: what relevance routing embeds, and, "
                       "unless query_prompt or messages are given, the text prefilled after the chunks")
    instruction: str = Field("", max_length=MAX_QUERY_CHARS,
                             description="prompt text before the chunks (e.g. a task instruction), prefilled online "
                             "after the chat-template prefix; never routed, never a chunk")
    query_prompt: str | None = Field(None, min_length=1, max_length=MAX_QUERY_CHARS,
                                     description="text prefilled after the chunks in place of query, e.g. the "
                                     "question wrapped in its answer cue; routing still uses query alone")

    messages: list[Message] | None = Field(None, min_length=1, max_length=MAX_MESSAGES, description="a conversation "
                                           "(OpenAI's message shape): the prompt is the model's chat template over "
                                           "it, the chunks at the start of the last user message's content; "
                                           "`query` is then only what retrieval embeds")

    tools: ToolUse | None = Field(None, description="functions the model may call (OpenAI's tools, tool_choice, "
                                  "parallel_tool_calls), in the system prompt as the model's tool format "
                                  "(schemas/tools.py); needs messages")

    add_generation_prompt: JsonBool = Field(True, description="vLLM's: the template's assistant header closes the "
                                            "prompt; false: the conversation is rendered without it (needs messages)")
    continue_final_message: JsonBool = Field(False, description="vLLM's: the answer continues the conversation's "
                                             "last message, an assistant one, rendered open (no end of turn); needs "
                                             "add_generation_prompt false, as vLLM's")
    history_chunks: JsonBool = Field(True, description="messages with retrieval: each earlier user message keeps the "
                                     "chunks its text retrieves, before it, as when it was asked (a follow-up then "
                                     "finds the earlier turns in the prefix cache); false: history as text alone")

    @model_validator(mode="after")
    def _prompt_given(self) -> Prompt:
        if self.messages is None:
            if self.tools is not None:
                raise ValueError("tools: need messages (a conversation)")
            if self.continue_final_message or not self.add_generation_prompt:
                raise ValueError("continue_final_message: add_generation_prompt and continue_final_message need "
                                 "messages (a conversation)")
            if not self.query:
                raise ValueError("query: should have at least 1 character (the question), unless messages are given")
            return self
        if self.instruction or self.query_prompt is not None:
            raise ValueError("give messages, or instruction / query_prompt, not both")
        check_generation_prompt(self.add_generation_prompt, self.continue_final_message)
        check_conversation(self.messages, self.continue_final_message)
        return self

    @property
    def text_after_chunks(self) -> str:
        return self.query if self.query_prompt is None else self.query_prompt


class AnswerRequest(Selection, Routing, Attribution, Prompt, Decoding):
    max_new_tokens: JsonInt = Field(64, ge=1, le=MAX_NEW_TOKENS)
    temperature: JsonFloat = Field(0.0, ge=0.0, le=2.0, description="0 = greedy")
    top_p: JsonFloat = Field(1.0, gt=0.0, le=1.0)
    seed: JsonInt | None = Field(None, ge=0, le=MAX_SEED)
    sampling_top_k: JsonInt = Field(0, ge=-1, description="vLLM's sampling `top_k` (this request's `top_k` is "
                                    "retrieval's): sample from the k most likely tokens only (0 or -1: all)")
    stream: JsonBool = False
    user: str | None = Field(None, max_length=256, description="the end user (OpenAI's `user`), recorded in the "
                             "request log; never the tenant, which is the API key's")
    timeout_s: JsonFloat | None = Field(None, gt=0.0, le=MAX_TIMEOUT_S, description="deadline of the whole request "
                                        "(504 past it, and its work stops); else header X-Request-Timeout, else "
                                        "the server's default")

    @model_validator(mode="after")
    def _one_selection(self) -> AnswerRequest:
        if self.num_given() != 1:
            raise ValueError("give exactly one of chunk_ids, doc_ids or top_k")
        if self.forced_calls is not None and self.structured_outputs is not None:
            raise ValueError("structured_outputs: a forced tool call and structured_outputs cannot both constrain "
                             "the answer; give one")
        self.check_min_tokens(self.max_new_tokens)
        return self

    def __reduce_ex__(self, protocol):
        """Across Serve handles and into the router's framing process, a conversation goes as pydantic's JSON: Ray's
        cloudpickle walks it object by object (a 63-message × 62-part conversation ~11 ms with the ingress's GIL held,
        the JSON ~2 ms), and the messages are validated where they arrive (Rust; the same messages: they round-trip)."""
        if not self.messages:
            return super().__reduce_ex__(protocol)
        return _with_messages, (self.model_copy(update={"messages": None}), MESSAGES.dump_json(self.messages))

    @property
    def forced_calls(self) -> list[FunctionDef] | None:
        return self.tools.forced if self.tools is not None else None

    @property
    def grammar_text(self) -> str | None:
        """A forced tool call's grammar (beside a JSON response_format too, as OpenAI takes both: the format shapes
        answers, and a forced turn gives none — the Agents SDK sends both when an `output_type` agent forces its
        first tool); with tool_choice auto and a JSON response_format, a call or that JSON (the two grammars as
        alternatives); else response_format's (Decoding)."""
        if (forced := self.forced_calls) is not None:
            return call_grammar(forced, self.tools.parallel)
        if self.tools is not None and self.tools.offered and (schema := self.answer_schema) is not None:
            return call_or_json_grammar([t.function for t in self.tools.tools], self.tools.parallel, schema)
        return super().grammar_text

    @property
    def answer_schema(self) -> str | None:
        """response_format's JSON schema as JSON text (json_object: any object), or None for text."""
        if self.response_format is None or self.response_format.type == "text":
            return None
        if self.response_format.type == "json_object":
            return json.dumps({"type": "object"})
        return json.dumps(self.response_format.json_schema.schema_)

    @property
    def grammar_param(self) -> str:
        return "tools" if self.forced_calls is not None else super().grammar_param


def _with_messages(request: AnswerRequest, messages: bytes) -> AnswerRequest:
    """`AnswerRequest.__reduce_ex__`'s inverse: `request` (without its messages) with `messages` validated back."""
    return request.model_copy(update={"messages": MESSAGES.validate_json(messages)})
