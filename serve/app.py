"""The Serve application's builder: ingress (serve/http/ingress.py) → router, generator (→ cache loader), and
the inspector behind the ingress's /ui pages (serve/ui/).

`build_app` (`import_path: serve.app:build_app`) validates `AppConfig`, checks the store against the
model before any replica starts, and binds each deployment by keyword with its own typed config, the
one nested in `AppConfig` (serve/config.py). The generator reads what its device hot tier lacks through its
KV source (serve/kv/source.py): the loader deployment's handle; the ingress holds the loader's handle only for
`/v1/store`'s cache statistics. With `loader_placement: in_generator` there is no loader deployment: each
generator replica keeps its own host LRU in its process and answers those statistics itself. With
`dispatch: affinity` every handle to the generator sends a plan to the replica whose hot tier holds most
of it (serve/dispatch/affinity.py).
"""

from __future__ import annotations

import json
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from pipeline.runtime import check_store
from pipeline.runtime.checkpoint import resolve_path
from pipeline.store import (
    Store,
    check_seal,
    current_generation_number,
    ensure_generation,
    hmac_key,
    read_generation,
    require_recorded_parts,
)
from schemas.service import StoreInfo
from serve.config import ApiSpec, AppConfig, DeploymentConfig, Dispatch, LoaderPlacement
from serve.dispatch import AffinityDispatcher
from serve.engine import Generator
from serve.http import Ingress
from serve.kv import CacheLoader, LoaderDeployment, LocalLoader
from serve.routing import BatchingRouter, servable_modes
from serve.ui import Inspector, InspectorConfig


def api_spec(args: AppConfig) -> ApiSpec:
    """What the ingress states about itself and the store, read here so its replica never opens the store."""
    store = Store.open(args.store)
    generation = read_generation(store, ensure_generation(store))
    manifest = generation.manifest  # counts from the generation record: nothing re-reads the tables
    info = StoreInfo(fingerprint=manifest.fingerprint, model_id=manifest.model.id,
                     tiers={t.name: t.dpi for t in manifest.tiers}, variants=list(manifest.variants),
                     embedder=manifest.embedder, embedding_dim=manifest.embedding_dim,
                     num_chunks=generation.num_chunks, num_documents=generation.num_documents,
                     num_entries=generation.num_entries,
                     modes=servable_modes(manifest.variants), kv_quant=manifest.kv_quant)
    return ApiSpec(served_model_name=args.ingress.served_model_name, default_top_k=args.ingress.default_top_k,
                   chat_model_name=args.ingress.chat_model_name, max_model_len=context_size(args),
                   store=info, created=int(manifest.created_at.timestamp()),
                   collections=generation.collection_counts())


def context_size(args: AppConfig) -> int | None:
    """The context the router fills (serve/routing/router.py: `router.max_context_tokens`, capped by the checkpoint's
    positions), from the checkpoint's config.json: the builder and the ingress load no model stack. None: unread."""
    try:
        config = json.loads((resolve_path(args.model) / "config.json").read_text())
        positions = int((config.get("text_config") or config)["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return args.router.max_context_tokens
    return min(args.router.max_context_tokens or positions, positions)


def preflight(args: AppConfig) -> None:
    """Fail fast, before any replica starts, when the store was compiled for another model or has lost
    table parts since its current generation (a listing per table, O(parts)), or, with an HMAC key configured,
    when its current generation's seal is missing or wrong (`SealError`); publish a serving generation once
    when no job has (so replicas never race to build one; unsealed, so a keyed app then refuses it)."""
    store = Store.open(args.store)
    check_store(store.load_manifest_or_raise(), args.model)
    require_recorded_parts(store, "not serving (docs/RELIABILITY.md: a store one publish away from losing entries)")
    key = hmac_key(args.hmac_key_file)
    ensure_generation(store)
    if key is not None:
        check_seal(store, read_generation(store, current_generation_number(store)), key)


def generator_dispatch(args: AppConfig) -> dict[str, Any]:
    """The Generator's request router: chunk affinity (serve/dispatch/affinity.py), or Serve's default."""
    if args.dispatch is Dispatch.DEFAULT:
        return {}
    spec = args.affinity
    return {"request_router_config": RequestRouterConfig(
        request_router_class=AffinityDispatcher, request_router_kwargs=spec.model_dump(mode="json"),
        request_routing_stats_period_s=spec.stats_period_s, request_routing_stats_timeout_s=spec.stale_after_s)}


def build_app(args: AppConfig | dict[str, Any]) -> serve.Application:
    """Serve application builder. Serve passes YAML `args` as a dict (it only converts them itself for a
    non-string annotation), so they are validated here."""
    args = args if isinstance(args, AppConfig) else AppConfig.model_validate(args)
    preflight(args)

    def deployment(cls: type, name: str, resources: DeploymentConfig, **options: Any):
        return serve.deployment(cls, name=name).options(**resources.options(), **options,
                                                        graceful_shutdown_timeout_s=args.drain_timeout_s)

    router = deployment(BatchingRouter, "Router", args.router_deployment).bind(config=args.router)
    # in_generator: each generator replica builds its own loader from the config (no CacheLoader deployment)
    loader = (None if args.loader_placement is LoaderPlacement.IN_GENERATOR
              else deployment(CacheLoader, "CacheLoader", args.loader_deployment).bind(config=args.loader))
    # the generator's KV source: its own loader, built in each replica from the config, or the deployment's handle
    source = LocalLoader(args.loader) if loader is None else LoaderDeployment(loader)
    generator = deployment(Generator, "Generator", args.generator_deployment, **generator_dispatch(args)).bind(
        config=args.generator, source=source)
    inspector = deployment(Inspector, "Inspector", args.inspector_deployment).bind(
        config=InspectorConfig(store=args.store, images_root=args.images_root))
    return deployment(Ingress, "Ingress", args.ingress_deployment).bind(
        router=router, loader=loader, generator=generator, inspector=inspector, config=args.ingress,
        api=api_spec(args))
