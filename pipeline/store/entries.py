"""How a KV entry is built — one definition for the compile stage and for the generator's repair path.

An entry is one (tier, variant) of one chunk text. Its source is the chunk's text or its pages at the
tier (rendered from the text, or its scanned page image scaled to the page width); `compile_entries`
is the single place that maps a variant to a runtime compile call, and `index_row` the single place
that turns a compiled entry into its index row. Ingest compiles a batch of sources per call; the repair
path compiles one through `build_sized_entry`. Same source, same call, same bytes on the same hardware.
"""

from __future__ import annotations

import io
import os
import stat
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from PIL import Image

from pipeline.store.slots import entry_slots, required_keys, slot_name  # noqa: F401  (re-exported)
from schemas.errors import Fault
from schemas.modes import CompilePrefix, Variant
from schemas.render import RenderSpec, TierSpec
from schemas.store import Manifest, ShardEntry

if TYPE_CHECKING:  # annotations only: the render stage imports this module, and must not import torch with it
    from pipeline.runtime import VLM, ChunkKV, Renderer

Source = str | Sequence[Image.Image]  # a text, or one chunk's pages in order
TEXT_SOURCED = frozenset({Variant.TEXT, Variant.TEXT_PLAIN})  # variants compiled from the chunk's text, not its pages


class PageImageError(ValueError):
    """A chunk's page image cannot be read here. The message names the path (for logs and ingest's quarantine);
    `fault` is what a response says instead (schemas.errors.public_reason)."""

    def __init__(self, message: str, fault: Fault = Fault.PAGE_IMAGE_UNREADABLE):
        super().__init__(message)
        self.fault = fault


class PageImageRefused(PageImageError):
    """A chunk's `image_path` names a file outside the images root (or no root is configured): never opened.
    The path comes from the store, whose checksums prove integrity, not authenticity: whoever can write the
    store must not be able to make a serving host read (and return the pixels of) any file it can open."""


def page_image_file(image_path: str, images_root: str | None) -> str:
    """The file `image_path` names, symlinks and `..` resolved, when it is a regular file under `images_root`
    (a relative path is taken relative to the root); `PageImageRefused` otherwise, before anything is opened.
    A path swapped for a link between this check and the open needs write access under the root itself."""
    if images_root is None:
        raise PageImageRefused("page images are not read here: no images_root is configured", Fault.NO_IMAGES_ROOT)
    if "\x00" in image_path:
        raise PageImageRefused("page image path holds a NUL byte: not read", Fault.OUTSIDE_IMAGES_ROOT)
    root = os.path.realpath(images_root)
    resolved = os.path.realpath(os.path.join(root, image_path))
    if os.path.commonpath([root, resolved]) != root:
        raise PageImageRefused(f"page image {image_path!r} lies outside images_root: not read",
                               Fault.OUTSIDE_IMAGES_ROOT)
    try:
        mode = os.stat(resolved).st_mode
    except OSError as error:
        raise PageImageError(f"page image {image_path!r} is not readable here: {error.strerror}") from None
    if not stat.S_ISREG(mode):  # a FIFO or device under the root would hang or stream without end
        raise PageImageRefused(f"page image {image_path!r} is not a regular file: not read",
                               Fault.NOT_A_REGULAR_FILE)
    return resolved


def compile_entries(vlm: VLM, variant: Variant, sources: Sequence[Source]) -> list[ChunkKV]:
    """KV entries of one variant for several sources, in one batched forward.

    The one map from a variant to the runtime: a new variant is a line here (and, if it compiles
    text, a member of TEXT_SOURCED); its prefix is `variant.prefix`."""
    calls = {
        Variant.TEMPLATE: CompilePrefix.TEMPLATE,  # pages under the chat-template prefix
        Variant.PLAIN: CompilePrefix.NONE,  # pages at position 0
        Variant.DUMMY: CompilePrefix.DUMMY,  # pages under a dummy prefix of the template's length
        Variant.TEXT: CompilePrefix.TEMPLATE,  # text under the chat-template prefix
        Variant.TEXT_PLAIN: CompilePrefix.NONE,  # text at position 0
    }
    if variant not in calls:
        raise ValueError(f"no compile call for variant {variant!r}")
    if any(isinstance(s, str) != (variant in TEXT_SOURCED) for s in sources):
        raise ValueError(f"variant {variant.value} compiles {'texts' if variant in TEXT_SOURCED else 'pages'} only")
    return vlm.compile_many(sources, calls[variant])


def scale_page(image: Image.Image, render: RenderSpec, tier: TierSpec) -> Image.Image:
    """An input page image at a tier's resolution, taking its width as the configured page width."""
    width_px = round(render.page_width_pt * tier.dpi / 72)
    height_px = max(1, round(image.height * width_px / image.width))
    return image.convert("RGB").resize((width_px, height_px), Image.Resampling.LANCZOS)


def page_images(renderer: Renderer, text: str, image_path: str | None, tier: TierSpec, *,
                images_root: str | None) -> tuple[list[Image.Image], int]:
    """A chunk's pages at `tier` and how many glyphs its fonts lack: its text rendered, or, for a
    scanned page, the page image scaled — read only under `images_root` (`page_image_file`). Raises
    RenderError (a ValueError) or PageImageError (PageImageRefused for a path outside the root)."""
    if not image_path:
        rendered = renderer.render(text, tier)
        return rendered.pages, rendered.missing_glyphs
    path = page_image_file(image_path, images_root)
    try:
        with Image.open(path) as image:
            return [scale_page(image, renderer.spec, tier)], 0
    except OSError as error:
        raise PageImageError(f"page image {image_path} is not readable here: {error}") from error


def build_sized_entry(vlm: VLM, renderer: Renderer, text: str, image_path: str | None, tier: str | None,
                      variant: Variant, *, images_root: str | None) -> tuple[ChunkKV, list[list[int]]]:
    """One entry from its chunk's stored source, exactly as ingest builds it, and the [width, height] of each
    page it compiled (its index row's `image_sizes_px`)."""
    if variant in TEXT_SOURCED:
        return compile_entries(vlm, variant, [text])[0], []
    pages, _ = page_images(renderer, text, image_path, renderer.spec.tier(tier or ""), images_root=images_root)
    return compile_entries(vlm, variant, [pages])[0], [[p.width, p.height] for p in pages]


def encode_png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=False)
    return buffer.getvalue()


def decode_png(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data))


def index_row(manifest: Manifest, chunk_key: str, tier: str | None, variant: Variant, kv: ChunkKV,
              sizes_px: list[list[int]], shard: ShardEntry, legibility: float | None = None) -> dict[str, Any]:
    """The index row of one written entry (created_at is stamped at publish; `legibility`: its pages'
    OCR score, pipeline/runtime/ocr.py, when the job measured it)."""
    return {
        "chunk_key": chunk_key, "tier": tier, "variant": variant.value,
        "fingerprint": manifest.entry_fingerprint(variant, tier), "kind": kv.kind.value,
        "num_tokens": kv.num_tokens, "position_span": kv.position_span, "compile_start": kv.compile_start,
        "grid_thw": [list(g) for g in kv.grid_thw], "image_sizes_px": sizes_px,
        "vision_tokens": kv.vision_tokens, "legibility": legibility, **shard.index_fields(),
    }
