"""What one request puts in context, as the generator hands it to an engine: one half of the engine seam
(serve/engine/interface.py is the other).

The generator's context builder (serve/engine/context.py) makes one of two from the router's plan:

    LinkedContext   `[texts[0]][group 0][texts[1]] … [group n-1][texts[n]]`: the texts as the model takes them
                    (token ids, images expanded), each group the linked chunks' compiled KV on the device, at their
                    compile-time positions; an engine re-anchors them where they land and prefills the texts
    OnlineContext   the same texts with each group's chunks as their source (text, or page images): the online
                    modes (full_text, full_image) prefill all of it with the question

Both answer the same questions the engines ask (`online`, `num_prompt_tokens`, `num_query_tokens`, `after`), so
nothing downstream dispatches on which one it holds. Each carries the tenant's prefix-cache salt, set by the
server from the authenticated tenant (never by the client).
"""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

from pipeline.runtime import ChunkInputs, ChunkKV, PreparedSegment
from schemas.config import RecomputeSpec


@dataclass
class LinkedPrompt:
    """The texts and linked chunks of a linked context, in the order the model reads them."""

    texts: list[PreparedSegment]  # one more than the groups
    groups: list[list[ChunkKV]]  # loaded KV at compile-time positions, in request order
    identities: list[list[bytes]]  # each chunk's entry key (chunk, tier, variant, fingerprint), as bytes

    @classmethod
    def single(cls, before: PreparedSegment, chunks: list[ChunkKV], identities: list[bytes],
               after: PreparedSegment) -> LinkedPrompt:
        return cls([before, after], [list(chunks)], [list(identities)])

    @property
    def before(self) -> PreparedSegment:
        return self.texts[0]

    @property
    def after(self) -> PreparedSegment:
        return self.texts[-1]

    @property
    def chunks(self) -> list[ChunkKV]:
        return [c for group in self.groups for c in group]

    @property
    def num_tokens(self) -> int:
        return sum(t.num_tokens for t in self.texts) + sum(c.num_tokens for c in self.chunks)

    def starts(self) -> list[int]:
        """First column of each part, in order: texts[0], group 0, texts[1], …, texts[n]; then the end."""
        columns, starts = 0, []
        for i, text in enumerate(self.texts):
            starts.append(columns)
            columns += text.num_tokens
            if i < len(self.groups):
                starts.append(columns)
                columns += sum(c.num_tokens for c in self.groups[i])
        return starts + [columns]


@dataclass
class LinkedContext:
    """A linked prompt (cached chunk KV on the device) and the tenant salt its prefix-cache blocks are keyed under."""

    prompt: LinkedPrompt
    salt: bytes = b""  # set by the server from the authenticated tenant, never by the client
    recompute: tuple[RecomputeSpec, list[ChunkInputs]] | None = None  # chunk tokens to recompute, and their sources

    online = False  # its chunks' KV is linked, not computed: only its texts are prefilled

    @property
    def chunks(self) -> list[ChunkKV]:
        return self.prompt.chunks

    @property
    def query_ids(self) -> list[int]:
        return self.prompt.after.ids

    @property
    def after(self) -> PreparedSegment:
        """The text after the last group of chunks: the question and the turn's closing."""
        return self.prompt.after

    @property
    def num_prompt_tokens(self) -> int:
        """Columns the prompt holds once prefilled: texts and linked chunks (a lazily compiled entry's own count)."""
        return self.prompt.num_tokens

    @property
    def num_query_tokens(self) -> int:
        """Tokens its join forwards at most: every text of the prompt (the one after the chunks, and those before
        its groups, computed in the same forward unless the prefix cache holds them; a system prompt and a history
        can be most of them)."""
        return sum(t.num_tokens for t in self.prompt.texts)


@dataclass
class OnlineContext:
    """The online modes' context: chunk text or page images, prefilled in full with the query."""

    texts: list[PreparedSegment]  # the prompt around the groups (template start, system, history, the question)
    groups: list[list[str | list[Image.Image]]]  # each group's chunks: text, or page images
    salt: bytes = b""  # the tenant's prefix-cache salt, as LinkedContext's
    chunk_tokens: int = 0  # the groups' tokens as the router priced them (text tokens, or vision tokens of the pages)

    online = True  # everything is prefilled, alone: a full prefill per request

    @property
    def after(self) -> PreparedSegment:
        return self.texts[-1]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(t.num_tokens for t in self.texts) + self.chunk_tokens

    @property
    def num_query_tokens(self) -> int:
        """0: its whole prompt is prefilled alone, not in the batched query prefill."""
        return 0


PreparedContext = LinkedContext | OnlineContext
