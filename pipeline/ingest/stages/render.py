"""The render stage: each UNIT whose missing slots need pages gets them, PNG per page per tier.

A Ray Data callable class (the renderer's fonts load once per actor) over pipeline rows
(pipeline/ingest/rows.py); rows that are not units with work to do pass through. A unit whose text
cannot be rendered (or whose page image cannot be read) is marked with its error, not dropped.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from pipeline.ingest.rows import PAGES_TYPE, require_columns, units_to_build, with_columns
from pipeline.runtime import Renderer
from pipeline.store import TEXT_SOURCED, encode_png, page_images
from schemas.corpus import RejectReason
from schemas.modes import Variant
from schemas.render import RenderSpec

NEEDS = ("kind", "error", "text", "image_path", "slots_json")
ADDS = ("pages", "missing_glyphs", "error")


class RenderStage:
    """Units → the same units with the pages (PNG per page, per tier) their missing slots need."""

    def __init__(self, render: RenderSpec, images_root: str | None):
        self.renderer = Renderer(render)
        self.images_root = images_root  # scanned page images are read only under it

    def pages(self, unit: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
        tiers = {tier for tier, variant in json.loads(unit["slots_json"]) if Variant(variant) not in TEXT_SOURCED}
        out, missing = [], 0
        for tier in (t for t in self.renderer.spec.tiers if t.name in tiers):
            pages, lacking = page_images(self.renderer, unit["text"], unit["image_path"], tier,
                                         images_root=self.images_root)
            out.append({"tier": tier.name, "png": [encode_png(p) for p in pages]})
            missing = max(missing, lacking)
        return out, missing

    def __call__(self, batch: pa.Table) -> pa.Table:
        require_columns(batch, NEEDS, "render")
        work, rest = units_to_build(batch, "slots_json")
        if work.num_rows == 0:
            return batch
        pages, missing, errors = [], [], []
        for unit in work.select(["text", "image_path", "slots_json"]).to_pylist():
            try:
                rendered, lacking = self.pages(unit)
                pages.append(rendered), missing.append(lacking), errors.append("")
            except (ValueError, OSError) as e:  # RenderError and PageImageError are ValueErrors
                pages.append([]), missing.append(0), errors.append(f"{RejectReason.RENDER_FAILED.value}: {e}")
        work = with_columns(work, pages=pa.array(pages, PAGES_TYPE), missing_glyphs=missing, error=errors)
        return pa.concat_tables([rest, work])
