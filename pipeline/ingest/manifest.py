"""The manifest an ingest job writes: a new store's (`new_manifest`), or the store's own extended by this job
(`target_manifest`), which refuses a store built for another model, page layout, embedder or KV format."""

from __future__ import annotations

import os
from datetime import datetime, timezone
from functools import lru_cache
from typing import TYPE_CHECKING

from pipeline.runtime import Embedder, model_identity
from pipeline.store import Store
from schemas.config import KVQuant, ModelSpec
from schemas.modes import AblationTiers, Variant
from schemas.render import RenderSpec
from schemas.store import Manifest, StoredModel

if TYPE_CHECKING:
    from pipeline.ingest.ingest_job import IngestConfig


def new_manifest(model: ModelSpec, render: RenderSpec, variants: tuple[Variant, ...], embedder_name: str,
                 embedding_dim: int, job_id: str, lazy_high_tier: bool = False,
                 kv_quant: KVQuant = KVQuant.NONE, ablation_tiers: AblationTiers = AblationTiers.LOWEST) -> Manifest:
    model_id, revision, family, template_prefix = model_identity(model)
    now = datetime.now(timezone.utc)
    return Manifest.create(
        StoredModel(id=model_id, revision=revision, dtype=model.dtype, family=family), template_prefix,
        render=render, variants=variants, embedder=embedder_name, embedding_dim=embedding_dim, kv_quant=kv_quant,
        created_at=now, updated_at=now, job_ids=(job_id,),
        lazy_tiers=(render.highest_tier.name,) if lazy_high_tier and len(render.tiers) > 1 else (),
        ablation_tiers=ablation_tiers,
    )


def embedder_identity(model_dir: str | None) -> tuple[str, int]:
    """(name, width) of the embedder, which go into the manifest. Loaded once per process and directory
    state: a job asks twice (for its rerun key, then under the store's lease); a directory whose files
    changed since is loaded again (its name is a fingerprint of those files)."""
    stamp = None if model_dir is None else tuple(
        (os.path.join(folder, name), os.stat(os.path.join(folder, name)).st_mtime_ns)
        for folder, _, names in sorted(os.walk(model_dir)) for name in sorted(names))
    return _embedder_identity(model_dir, stamp)


@lru_cache(maxsize=4)
def _embedder_identity(model_dir: str | None, stamp: object) -> tuple[str, int]:
    embedder = Embedder(model_dir)
    return embedder.model_name, embedder.dim


def target_manifest(store: Store, cfg: IngestConfig) -> Manifest:
    """The store's manifest extended by this job; refuses a store built for another model, page layout or embedder."""
    embedder_name, embedding_dim = embedder_identity(cfg.embedder_dir)
    fresh = new_manifest(cfg.model, cfg.render, cfg.variants, embedder_name, embedding_dim, cfg.job_id,
                         cfg.lazy_high_tier, cfg.kv_quant or KVQuant.NONE, cfg.ablation_tiers)
    manifest = store.read_manifest()
    if manifest is None:
        return fresh
    manifest.check_model(fresh.model.id, fresh.model.revision, fresh.model.dtype, fresh.template_prefix)
    if manifest.render != cfg.render:
        raise ValueError("the store was rendered with another page layout or tiers: run `qvpic recompile`")
    if manifest.embedder != embedder_name:
        raise ValueError(f"the store's chunks were embedded with {manifest.embedder}, not {embedder_name}")
    if cfg.kv_quant is not None and cfg.kv_quant is not manifest.kv_quant:  # its entries would mix two formats
        raise ValueError(f"the store keeps its KV as {manifest.kv_quant.value}, not {cfg.kv_quant.value}: "
                         f"run `qvpic recompile --kv-quant {cfg.kv_quant.value}` to convert it")
    return manifest.model_copy(update={
        "variants": tuple(dict.fromkeys(manifest.variants + cfg.variants)), "updated_at": fresh.updated_at,
        "job_ids": manifest.job_ids + (cfg.job_id,), "lazy_tiers": fresh.lazy_tiers,  # this job's choice
        "ablation_tiers": max(manifest.ablation_tiers, cfg.ablation_tiers, key=list(AblationTiers).index)})
