"""Render and compile stages of ingestion: one unique chunk in, its pages and KV entries out.

Both are Ray Data callable classes (heavy init once per actor). The compile stage writes each chunk's
shard and publishes its index rows itself, shard first: a killed actor leaves at most an orphan shard
(collected by `Store.remove_orphans`), never an index row pointing at nothing.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
from PIL import Image

from pipeline.render import Renderer
from pipeline.runtime.model import VLM
from pipeline.store import Store
from schemas.config import ModelSpec, RenderSpec, TierSpec, Variant
from schemas.corpus import RejectReason
from schemas.store import Manifest, StoreSpec

IMAGE_PATH = "image_path"  # chunk column: the original page image of an OCR'd document, or ""
ERROR = "error"  # "" when the stage succeeded; else "<RejectReason value>: <detail>"
SLOTS = "slots_json"  # the entries to build for a chunk: [[tier or null, variant], ...]
ENTRIES = "entries_json"  # per entry written: tier, variant, nbytes, vision_tokens, pages


def slots_json(slots: Iterable[tuple[str | None, Variant]]) -> str:
    """The SLOTS value naming which (tier, variant) entries to build."""
    return json.dumps([[tier, variant.value] for tier, variant in slots])


def pages_column(tier: str) -> str:
    return f"pages_{tier}"


def encode_png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=False)
    return buffer.getvalue()


def scale_page(image: Image.Image, render: RenderSpec, tier: TierSpec) -> Image.Image:
    """An input page image at a tier's resolution, taking its width as the configured page width."""
    width_px = round(render.page_width_pt * tier.dpi / 72)
    height_px = max(1, round(image.height * width_px / image.width))
    return image.convert("RGB").resize((width_px, height_px), Image.Resampling.LANCZOS)


class RenderStage:
    """Row → row with one `pages_<tier>` column (PNG bytes per page; empty for tiers no slot needs)."""

    def __init__(self, render: RenderSpec):
        self.render_spec = render
        self.renderer = Renderer(render)

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        out = dict(row)
        out[ERROR] = ""
        out["missing_glyphs"] = 0
        needed = {tier for tier, _ in json.loads(row[SLOTS]) if tier is not None}
        for tier in self.render_spec.tiers:
            out[pages_column(tier.name)] = []
        try:
            for tier in (t for t in self.render_spec.tiers if t.name in needed):
                if row.get(IMAGE_PATH):
                    with Image.open(row[IMAGE_PATH]) as image:
                        pages = [scale_page(image, self.render_spec, tier)]
                else:
                    rendered = self.renderer.render(row["text"], tier)
                    pages = rendered.pages
                    out["missing_glyphs"] = max(out["missing_glyphs"], rendered.missing_glyphs)
                out[pages_column(tier.name)] = [encode_png(p) for p in pages]
        except (ValueError, OSError) as e:  # RenderError is a ValueError; a vanished image an OSError
            out[ERROR] = f"{RejectReason.RENDER_FAILED.value}: {e}"
        return out


@dataclass(frozen=True)
class CompilePlan:
    """What the compile stage needs to build and fingerprint entries; travels to each actor."""

    model: ModelSpec
    store: StoreSpec
    manifest_json: str  # the manifest the entries are fingerprinted against


class CompileStage:
    """Batch of rendered chunks → KV entries written to the store; returns one summary row per chunk."""

    def __init__(self, plan: CompilePlan, vlm: VLM | None = None):
        self.plan = plan
        self.manifest = Manifest.from_json(plan.manifest_json)
        self.vlm = vlm or VLM(plan.model)  # in-process callers may share a loaded model
        self.store = Store.open(plan.store)

    def entries(self, row: dict[str, Any]) -> list[tuple[str | None, Variant, Any, list[list[int]]]]:
        """(tier, variant, ChunkKV, page sizes) for every slot the row asks for."""
        out = []
        for tier, variant_value in json.loads(row[SLOTS]):
            variant = Variant(variant_value)
            pages = [Image.open(io.BytesIO(png)) for png in row[pages_column(tier)]] if tier is not None else []
            kv = self.vlm.compile_variant(variant, row["text"], pages)
            out.append((tier, variant, kv, [[p.width, p.height] for p in pages]))
        return out

    def compile_row(self, row: dict[str, Any]) -> dict[str, Any]:
        entries = self.entries(row)
        rows = []
        for tier, variant, kv, sizes in entries:
            # One shard per entry: a remote load fetches exactly the tier it serves, and a recompile
            # that replaces image entries leaves their old shards unreferenced, hence collectable.
            shard, = self.store.write_shard({f"{tier or 'text'}.{variant.value}": kv.kv})
            rows.append({
                "chunk_key": row["chunk_key"], "tier": tier, "variant": variant.value,
                "fingerprint": self.manifest.entry_fingerprint(variant, tier), "kind": kv.kind.value,
                "num_tokens": kv.num_tokens, "position_span": kv.position_span, "compile_start": kv.compile_start,
                "grid_thw": [list(g) for g in kv.grid_thw], "image_sizes_px": sizes,
                "vision_tokens": kv.vision_tokens,
                **shard.index_fields(),
            })
        self.store.publish_index(rows)  # after the shard exists
        stats = [{"tier": r["tier"], "variant": r["variant"], "nbytes": r["nbytes"],
                  "vision_tokens": r["vision_tokens"], "pages": len(r["image_sizes_px"])} for r in rows]
        return {"chunk_key": row["chunk_key"], ERROR: "", ENTRIES: json.dumps(stats)}

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        results = []
        for i in range(len(batch["chunk_key"])):
            row = {k: v[i] for k, v in batch.items()}
            if row[ERROR]:
                results.append({"chunk_key": row["chunk_key"], ERROR: row[ERROR], ENTRIES: "[]"})
                continue
            try:
                results.append(self.compile_row(row))
            except (ValueError, RuntimeError) as e:  # a chunk the model cannot take: quarantine, go on
                error = f"{RejectReason.COMPILE_FAILED.value}: {e}"
                results.append({"chunk_key": row["chunk_key"], ERROR: error, ENTRIES: "[]"})
        return {k: [r[k] for r in results] for k in ("chunk_key", ERROR, ENTRIES)}
