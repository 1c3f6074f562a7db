"""Each linked chunk's source at serve time, as its served entry was compiled from it.

Selective recompute (pipeline/runtime/selective_recompute.py) rebuilds some chunk tokens on the assembled context,
so it needs their inputs: the chunk's text for a text entry, or its pages at the entry's tier — the
stored text rendered again with the store's RenderSpec (or a scanned page's image scaled), exactly as
ingest and the repair path make them. The router carries text and image path in the plan when recompute
is on (`RouterConfig.carry_sources`); nothing else is stored for it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pipeline.runtime import VLM, ChunkInputs, Renderer, chunk_inputs
from pipeline.store import TEXT_SOURCED, PageImageError, PageImageRefused, page_images
from schemas.errors import PageImageRefusedError, UnservableError, public_reason
from serve.plan import Entry, PlannedChunk

log = logging.getLogger(__name__)


def recompute_inputs(vlm: VLM, renderer: Renderer, chunks: Sequence[PlannedChunk],
                     served: Sequence[Entry], images_root: str | None) -> list[ChunkInputs]:
    """The inputs of every linked chunk, from its planned source and the entry it is served from (a scanned
    page read only under `images_root`)."""
    if any(c.text is None for c in chunks):
        raise UnservableError("recompute needs the chunks' text: the router must carry it (RouterConfig.carry_sources)")
    inputs = []
    for chunk, entry in zip(chunks, served):
        if entry.variant in TEXT_SOURCED:
            inputs.append(chunk_inputs(vlm, chunk.text))
            continue
        try:
            pages = page_images(renderer, chunk.text, chunk.image_path, renderer.spec.tier(entry.tier or ""),
                                images_root=images_root)[0]
        except PageImageError as error:  # the response names the chunk and a code; the log has the path
            log.warning("cannot recompute chunk %s: %s", chunk.chunk_id, error)
            failure = PageImageRefusedError if isinstance(error, PageImageRefused) else UnservableError
            raise failure(f"cannot recompute chunk {chunk.chunk_id}: {public_reason(error)}") from None
        inputs.append(chunk_inputs(vlm, pages))
    return inputs
