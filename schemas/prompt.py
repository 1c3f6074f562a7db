"""What the model reads around a request's linked chunks, as the router builds it and the plan carries it.

`PromptLayout` is `[texts[0]][group 0][texts[1]] … [group n-1][texts[n]]`: a conversation rendered by the
checkpoint's chat template and cut where the store's chunks go (pipeline/runtime/conversation.py renders it,
the generator expands its images through the model's processor). Plain data: the router and the plan hold
layouts without loading torch or the tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ImageRef:
    """A user image: its encoded bytes (PNG, JPEG or WebP, as sent, already checked to decode), their sha256
    and its size (pipeline.runtime.conversation.decode_image builds one)."""

    data: bytes
    digest: str  # sha256 hex of `data`: the image's identity in the prefix cache's block keys
    width_px: int
    height_px: int


Piece = tuple[int, ...] | ImageRef  # a run of token ids, or one image (its markup and tokens come from the processor)


@dataclass(frozen=True)
class Segment:
    """Token runs and images in the order the model reads them."""

    pieces: tuple[Piece, ...] = ()

    @property
    def images(self) -> list[ImageRef]:
        return [p for p in self.pieces if isinstance(p, ImageRef)]

    def text_tokens(self) -> int:
        return sum(len(p) for p in self.pieces if not isinstance(p, ImageRef))

    @classmethod
    def of_ids(cls, ids: Sequence[int]) -> Segment:
        return cls((tuple(ids),) if ids else ())


@dataclass(frozen=True)
class PromptLayout:
    """`[texts[0]][group 0][texts[1]] … [group n-1][texts[n]]`: what the model reads around the linked chunks."""

    texts: tuple[Segment, ...]  # one more than the groups of chunks

    @classmethod
    def of(cls, before: Segment, after: Segment) -> PromptLayout:
        return cls((before, after))

    @property
    def before(self) -> Segment:
        return self.texts[0]

    @property
    def after(self) -> Segment:
        return self.texts[-1]

    @property
    def num_groups(self) -> int:
        return len(self.texts) - 1

    @property
    def images(self) -> list[ImageRef]:
        return [image for text in self.texts for image in text.images]
