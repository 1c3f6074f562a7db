"""What a store holds and a request is served from: chunk kinds, compile prefixes, the stored variants, the
modes (a source times an allocation over one variant) and how retrieved chunks are ordered."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class ChunkKind(str, Enum):
    IMAGE = "image"
    TEXT = "text"


class CompilePrefix(str, Enum):
    """What a chunk is compiled after; that prefix's KV is stripped before the chunk's is stored."""

    TEMPLATE = "template"  # the model's own chat-template prefix: what serving places before the chunks
    NONE = "none"  # nothing: the chunk starts at position 0 (prefix-free PIC)
    DUMMY = "dummy"  # as many arbitrary tokens as the template prefix has, drawn with DUMMY_PREFIX_SEED


DUMMY_PREFIX_SEED = 0  # part of the dummy variant's entry fingerprint


class Variant(str, Enum):
    """What one stored KV entry of a chunk is: page images or source text, compiled after which prefix."""

    TEMPLATE = "template"  # page images under the chat-template prefix (qvpic, uniform)
    PLAIN = "plain"  # page images with no prefix, at position 0 (image PIC baseline)
    DUMMY = "dummy"  # page images under a dummy prefix of the template's length (virtual-prefix baseline)
    TEXT = "text"  # source text under the chat-template prefix (text PIC baseline)
    TEXT_PLAIN = "text_plain"  # source text with no prefix (base text PIC)

    @property
    def kind(self) -> ChunkKind:
        return ChunkKind.TEXT if self in (Variant.TEXT, Variant.TEXT_PLAIN) else ChunkKind.IMAGE

    @property
    def prefix(self) -> CompilePrefix:
        return _VARIANT_PREFIX[self]


_VARIANT_PREFIX = {Variant.TEMPLATE: CompilePrefix.TEMPLATE, Variant.PLAIN: CompilePrefix.NONE,
                   Variant.DUMMY: CompilePrefix.DUMMY, Variant.TEXT: CompilePrefix.TEMPLATE,
                   Variant.TEXT_PLAIN: CompilePrefix.NONE}


class Source(str, Enum):
    """Where a mode's chunks come from when a request is served."""

    LINKED = "linked"  # their KV, compiled offline: linked and re-anchored, only the text around them is prefilled
    ONLINE = "online"  # their source (text, or pages): prefilled with the question, the reference baselines


class Allocation(str, Enum):
    """How a mode gives each chunk its tier."""

    ROUTED = "routed"  # relevance routing promotes chunks from the lowest tier to a target tier (τ, B, token budget)
    UNIFORM = "uniform"  # every chunk at one tier (or, for text, none)


class TierDefault(str, Enum):
    """The tier an image mode serves (uniform) or promotes to (routed) when the request names none."""

    LOWEST = "lowest"
    HIGHEST = "highest"


@dataclass(frozen=True)
class ModeShape:
    """What a mode is: a source times an allocation, over one stored variant."""

    source: Source
    allocation: Allocation
    variant: Variant | None  # the entries it links (or prices pages from); None: chunk text, priced from the catalog
    tier: TierDefault | None = None  # image modes: the default tier (None for text)
    fixed_tier: bool = False  # the tier is the mode's own (uniform_high): a request's `tier` is refused


class Mode(str, Enum):
    """How the engine builds the context of a request; every mode is served side by side.

    The name is what a request carries (`mode`); what it means is its `shape` (a source times an allocation over one
    stored variant), which everything downstream reads. The uniform ones serve every chunk at one tier, the
    request's `tier` or the mode's default.
    """

    FULL_TEXT = "full_text"  # prefill every chunk's text online
    FULL_IMAGE = "full_image"  # encode every page online and prefill everything (qvpic's tiers, or one `tier`)
    TEXT_PIC = "text_pic"  # link cached text KV compiled under the template prefix
    TEXT_PIC_PLAIN = "text_pic_plain"  # link cached text KV compiled with no prefix
    IMAGE_PIC = "image_pic"  # link cached prefix-free image KV, uniform (lowest tier by default)
    IMAGE_PIC_DUMMY = "image_pic_dummy"  # link cached dummy-prefix image KV, uniform (lowest tier by default)
    UNIFORM = "uniform"  # link cached templated image KV, every chunk at one tier (highest by default)
    UNIFORM_HIGH = "uniform_high"  # `uniform` at the highest tier
    QVPIC = "qvpic"  # templated image KV, relevance-routed dual resolution
    # qvpic's routing over the ablation prefixes (the paper's compile prefix × allocation grid); promotion
    # needs the variant at the target tier: `qvpic ingest --ablation-tiers every`
    QVPIC_PLAIN = "qvpic_plain"  # prefix-free image KV, relevance-routed dual resolution
    QVPIC_DUMMY = "qvpic_dummy"  # dummy-prefix image KV, relevance-routed dual resolution

    @property
    def shape(self) -> ModeShape:
        return _MODE_SHAPES[self]

    @property
    def source(self) -> Source:
        return self.shape.source

    @property
    def online(self) -> bool:
        """Its chunks are prefilled online (full_text, full_image), not linked."""
        return self.shape.source is Source.ONLINE

    @property
    def routed(self) -> bool:
        return self.shape.allocation is Allocation.ROUTED

    @property
    def variant(self) -> Variant | None:
        """The stored variant it links (full_image: prices its pages from); None: full_text (the catalog's text)."""
        return self.shape.variant

    @property
    def kind(self) -> ChunkKind:
        """Whether its chunks are in context as text or as pages."""
        return ChunkKind.TEXT if self.variant is None else self.variant.kind

    @property
    def takes_tier(self) -> bool:
        """Whether a request's `tier` applies: the tier of every chunk (uniform modes) or the promotion
        target (routed modes). Text modes have no tiers; uniform_high's is fixed."""
        return self.kind is ChunkKind.IMAGE and not self.shape.fixed_tier


_LINKED_UNIFORM, _LINKED_ROUTED = (Source.LINKED, Allocation.UNIFORM), (Source.LINKED, Allocation.ROUTED)
_MODE_SHAPES = {
    Mode.FULL_TEXT: ModeShape(Source.ONLINE, Allocation.UNIFORM, None),
    Mode.FULL_IMAGE: ModeShape(Source.ONLINE, Allocation.ROUTED, Variant.TEMPLATE, TierDefault.HIGHEST),
    Mode.TEXT_PIC: ModeShape(*_LINKED_UNIFORM, Variant.TEXT),
    Mode.TEXT_PIC_PLAIN: ModeShape(*_LINKED_UNIFORM, Variant.TEXT_PLAIN),
    Mode.IMAGE_PIC: ModeShape(*_LINKED_UNIFORM, Variant.PLAIN, TierDefault.LOWEST),
    Mode.IMAGE_PIC_DUMMY: ModeShape(*_LINKED_UNIFORM, Variant.DUMMY, TierDefault.LOWEST),
    Mode.UNIFORM: ModeShape(*_LINKED_UNIFORM, Variant.TEMPLATE, TierDefault.HIGHEST),
    Mode.UNIFORM_HIGH: ModeShape(*_LINKED_UNIFORM, Variant.TEMPLATE, TierDefault.HIGHEST, fixed_tier=True),
    Mode.QVPIC: ModeShape(*_LINKED_ROUTED, Variant.TEMPLATE, TierDefault.HIGHEST),
    Mode.QVPIC_PLAIN: ModeShape(*_LINKED_ROUTED, Variant.PLAIN, TierDefault.HIGHEST),
    Mode.QVPIC_DUMMY: ModeShape(*_LINKED_ROUTED, Variant.DUMMY, TierDefault.HIGHEST),
}


class AblationTiers(str, Enum):
    """The tiers a store compiles the ablation variants (`plain`, `dummy`) at (`qvpic ingest --ablation-tiers`)."""

    LOWEST = "lowest"  # the image_pic baselines at their default tier: the lean production store
    EVERY = "every"  # every tier, so each compile prefix can be served at every allocation (`qvpic eval --paper`)


class ChunkOrder(str, Enum):
    """The order retrieved (`top_k`) chunks are assembled in; named chunks and documents keep the request's."""

    RETRIEVAL = "retrieval"  # best first (ties by catalog order)
    SOURCE = "source"  # catalog order: each document's chunks as they appear in it
