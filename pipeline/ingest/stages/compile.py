"""The compile stage: each distinct chunk text (a UNIT row, rendered upstream) in, its KV entries written out.

A Ray Data callable class (the VLM loads once per actor) over pipeline rows (pipeline/ingest/rows.py);
rows that are not units with work to do pass through. It batches: the entries of one (tier, variant)
slot across the units of a batch compile `batch_size` chunks per forward and land in one packed shard
(pipeline/store/shards.py). Shards are written first, then the batch's index rows are published as one part
named by the job and the batch's keys — a killed actor leaves at most orphan shards, and a retried batch
rewrites its part instead of adding one.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import ray

from pipeline.ingest.preload import Preload
from pipeline.ingest.rows import PAGES_TYPE, Kind, require_columns, rows_table, units_to_build, with_columns
from pipeline.ingest.stages.render import RenderStage
from pipeline.runtime import VLM, ChunkKV, page_legibility
from pipeline.store import (
    TEXT_SOURCED,
    Store,
    check_device,
    compile_entries,
    decode_png,
    index_row,
    required_keys,
    stored,
)
from schemas.config import ModelSpec
from schemas.corpus import RejectReason
from schemas.modes import Variant
from schemas.store import Manifest, StoreSpec

NEEDS = ("kind", "error", "chunk_key", "text", "slots_json", "pages")
ADDS = ("entries_json", "error")  # and `pages` emptied: they are done with


@dataclass(frozen=True)
class CompilePlan:
    """What the compile stage needs to build and fingerprint entries; travels to each actor."""

    model: ModelSpec
    store: StoreSpec
    manifest_json: str  # the manifest the entries are fingerprinted against
    batch_size: int = 8  # chunks per forward
    stamp_ns: int = 0  # the job's start: orders its index parts after earlier jobs'
    job_id: str = ""
    legibility: bool = False  # OCR each image entry's pages into its row (pipeline/runtime/ocr.py)


@dataclass
class _Item:
    chunk_key: str
    source: Any  # text, or the chunk's pages at the slot's tier
    sizes_px: list[list[int]]
    cost: int  # for sorting a batch into similar lengths (less padding)


class CompileStage:
    """Units → KV entries written to the store; each unit row gets `error` and per-entry `entries_json`."""

    def __init__(self, plan: CompilePlan, vlm: VLM | None = None, preload: bool = False):
        self.plan = plan
        self.manifest = Manifest.from_json(plan.manifest_json)
        self._vlm = vlm  # in-process callers may share a loaded model
        self.store = Store.open(plan.store)
        # The Ray node this actor runs on, in each entry's stats: the job summary counts work per node.
        self.node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
        # The job's actors preload (pipeline/ingest/preload.py); in-process callers load on the first batch
        # with work, or never (a rerun over a store that holds everything)
        self._loading = Preload("loading the VLM", self._load) if preload and vlm is None else None

    def _load(self) -> VLM:
        vlm = VLM(self.plan.model)
        check_device(self.manifest.kv_quant, vlm.device)  # fail on the first batch, not once per chunk
        return vlm

    @property
    def vlm(self) -> VLM:
        if self._vlm is None:
            self._vlm = self._loading.get() if self._loading else self._load()
        return self._vlm

    def __call__(self, batch: pa.Table) -> pa.Table:
        require_columns(batch, NEEDS, "compile")
        work, rest = units_to_build(batch, "slots_json")
        if work.num_rows == 0:
            return batch
        units = work.select(["chunk_key", "text", "slots_json", "pages"]).to_pylist()
        errors, stats = self.build(units)
        work = with_columns(work, error=[errors.get(u["chunk_key"], "") for u in units],
                            entries_json=[json.dumps(stats.get(u["chunk_key"], [])) for u in units],
                            pages=pa.nulls(work.num_rows, PAGES_TYPE))  # pages are done with: do not carry them on
        return pa.concat_tables([rest, work])

    def build(self, units: list[dict[str, Any]]) -> tuple[dict[str, str], dict[str, list[dict]]]:
        """Compile, write and publish every missing entry of `units`: (errors, entry stats) by chunk key."""
        errors: dict[str, str] = {}
        slots: dict[tuple[str | None, Variant], list[_Item]] = defaultdict(list)
        for unit in units:
            pages = {p["tier"]: p["png"] for p in unit["pages"] or []}
            for tier, variant in json.loads(unit["slots_json"]):
                variant = Variant(variant)
                if variant in TEXT_SOURCED:
                    slots[(tier, variant)].append(_Item(unit["chunk_key"], unit["text"], [], len(unit["text"])))
                    continue
                images = [decode_png(png) for png in pages.get(tier, [])]
                sizes = [[image.width, image.height] for image in images]
                slots[(tier, variant)].append(_Item(unit["chunk_key"], images, sizes, sum(w * h for w, h in sizes)))
        rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
        legibility = self.legibility(units, slots) if self.plan.legibility else {}
        for (tier, variant), items in slots.items():
            items.sort(key=lambda item: item.cost)
            for start in range(0, len(items), self.plan.batch_size):
                batch = [i for i in items[start:start + self.plan.batch_size] if i.chunk_key not in errors]
                built = [(i, kv) for i, kv in zip(batch, self.compile(variant, batch, errors)) if kv is not None]
                if not built:
                    continue
                # One shard per batch and slot: a recompile that replaces the slot frees whole files. The
                # store's KV format (as compiled, or quantised) is the manifest's.
                shards = self.store.write_shard({f"{i.chunk_key}.{tier or 'text'}.{variant.value}":
                                                 stored(kv.kv, self.manifest.kv_quant) for i, kv in built})
                for (item, kv), shard in zip(built, shards):
                    rows[item.chunk_key].append(
                        index_row(self.manifest, item.chunk_key, tier, variant, kv, item.sizes_px, shard,
                                  legibility.get((item.chunk_key, tier))))
        published = [r for key, entries in rows.items() if key not in errors for r in entries]
        if published:
            digest = hashlib.sha256("\n".join(sorted(r["chunk_key"] + r["variant"] + (r["tier"] or "")
                                                     for r in published))
                                    .encode()).hexdigest()[:16]
            self.store.publish_index(published, stamp_ns=self.plan.stamp_ns or None, token=digest)
        stats = {key: [{"tier": r["tier"], "variant": r["variant"], "nbytes": r["nbytes"],
                        "vision_tokens": r["vision_tokens"], "pages": len(r["image_sizes_px"]), "node": self.node_id}
                        for r in entries]
                 for key, entries in rows.items() if key not in errors}
        return errors, stats

    def legibility(self, units: list[dict[str, Any]], slots: dict[tuple[str | None, Variant], list[_Item]]
                   ) -> dict[tuple[str, str], float]:
        """OCR score of each (chunk key, tier) whose pages this batch compiles: once per tier, whatever the variants."""
        texts = {u["chunk_key"]: u["text"] for u in units}
        scores: dict[tuple[str, str], float] = {}
        for (tier, variant), items in slots.items():
            if variant in TEXT_SOURCED:
                continue
            dpi = self.manifest.render.tier(tier).dpi
            for item in items:
                if (item.chunk_key, tier) not in scores and item.source:
                    scores[(item.chunk_key, tier)] = page_legibility(texts[item.chunk_key], item.source, dpi)
        return scores

    def compile(self, variant: Variant, items: list[_Item], errors: dict[str, str]) -> list[ChunkKV | None]:
        """One batched forward; when it fails, each item alone, so one bad chunk fails only itself."""
        if not items:
            return []
        try:
            return list(compile_entries(self.vlm, variant, [i.source for i in items]))
        except (ValueError, RuntimeError) as e:  # a chunk the model cannot take: quarantine it, go on
            if len(items) == 1:
                errors[items[0].chunk_key] = f"{RejectReason.COMPILE_FAILED.value}: {e}"
                return [None]
        return [self.compile(variant, [item], errors)[0] for item in items]


def compile_in_process(store: Store, manifest: Manifest, vlm: VLM, sources: list[tuple[str, str, str | None]],
                       batch_size: int = 8, legibility: bool = False, images_root: str | None = None) -> dict[str, str]:
    """Render and compile the entries the manifest needs and the store lacks for `(chunk_key, text,
    image_path)` sources in this process, through the pipeline's own stages (tests and benchmarks that
    build stores without Ray; scanned pages read only under `images_root`). Returns the errors by chunk key."""
    units = []
    for key, text, image_path in dict.fromkeys(sources):
        keys = required_keys(manifest, key, manifest.variants)
        present = store.has_entries(keys)
        slots = [[k.tier, k.variant.value] for k in keys if k not in present]
        if slots:
            units.append({"kind": Kind.UNIT.value, "key": key, "chunk_key": key, "text": text,
                          "image_path": image_path, "slots_json": json.dumps(slots), "error": ""})
    if not units:
        return {}
    plan = CompilePlan(vlm.spec, store.spec, manifest.to_json(), batch_size, legibility=legibility)
    built = CompileStage(plan, vlm=vlm)(RenderStage(manifest.render, images_root)(rows_table(units)))
    return {row["chunk_key"]: row["error"] for row in built.select(["chunk_key", "error"]).to_pylist() if row["error"]}
