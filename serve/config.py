"""Typed configuration of the Serve application: one config per deployment, bound by keyword.

`AppConfig` is what `qvpic serve` flags and serve/config.yaml `args` fill in; the builder (serve/app.py)
splits it into `RouterConfig`, `LoaderConfig`, `GeneratorConfig` and `IngressConfig`, and binds each
deployment as `Deployment.bind(config=…, <handles>=…)`, Ray Serve LLM's builder style. This module
imports no model stack, so the ingress replica can hold its own config without loading torch.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, field_validator, model_validator

from schemas.api import MAX_TIMEOUT_S, StoreInfo
from schemas.config import EngineSpec, Frozen, ModelSpec, RecomputeSpec, RouterSpec
from schemas.generation import ReloadSpec, ScanSpec
from schemas.store import StoreSpec
from serve.governance import GovernanceConfig


class DeploymentConfig(Frozen):
    """Replicas and resources of one deployment. CPU deployments take a fraction of a CPU so the whole
    graph fits a 2-core box (Serve's default of 1 CPU per replica would not)."""

    num_replicas: int | None = Field(1, ge=1)
    autoscaling_config: dict[str, Any] | None = None  # Serve AutoscalingConfig fields
    num_cpus: float = Field(0.1, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    max_ongoing_requests: int = Field(16, ge=1)

    @model_validator(mode="after")
    def _replicas_or_autoscaling(self) -> DeploymentConfig:
        if self.autoscaling_config is not None and self.num_replicas not in (None, 1):
            raise ValueError("set either num_replicas or autoscaling_config, not both")
        return self

    def options(self) -> dict[str, Any]:
        scale = ({"autoscaling_config": self.autoscaling_config} if self.autoscaling_config is not None
                 else {"num_replicas": self.num_replicas or 1})
        return {**scale, "max_ongoing_requests": self.max_ongoing_requests,
                "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}}


class StoreBound(Frozen):
    """A role over one store; a bare URI string is accepted for `store`."""

    store: StoreSpec

    @field_validator("store", mode="before")
    @classmethod
    def _uri(cls, store: object) -> object:
        return {"uri": store} if isinstance(store, str) else store


class RouterConfig(StoreBound):
    model: ModelSpec
    defaults: RouterSpec = RouterSpec()
    max_chunks: int = Field(64, ge=1)
    max_context_tokens: int | None = Field(None, ge=1)
    embedder_dir: str | None = None
    reload: ReloadSpec = ReloadSpec()  # how it follows the store's published generations
    scan: ScanSpec = ScanSpec()  # how one query searches the vector index
    carry_sources: bool = False  # linked plans carry each chunk's text and page image (recompute needs them)


class LoaderConfig(StoreBound):
    max_nbytes: int = Field(2 << 30, ge=0)  # host-memory LRU
    reload: ReloadSpec = ReloadSpec()


class GeneratorConfig(StoreBound):
    model: ModelSpec
    engine: EngineSpec = EngineSpec()
    recompute: RecomputeSpec = RecomputeSpec()  # linked chunks' tokens recomputed on the context (off by default)


class ApiSpec(BaseModel):
    served_model_name: str
    default_top_k: int
    store: StoreInfo
    created: int  # unix seconds: when the store was created


class IngressConfig(Frozen):
    settings: ApiSpec  # what the HTTP surface says about the store, read by the builder
    governance: GovernanceConfig = GovernanceConfig()
    request_timeout_s: float = Field(300.0, gt=0, le=MAX_TIMEOUT_S)  # deadline of a request that sets none


class AppConfig(Frozen):
    """Typed arguments of `build_app`: what `qvpic serve` flags and serve/config.yaml `args` fill in."""

    store: StoreSpec
    model: ModelSpec = ModelSpec()
    router: RouterSpec = RouterSpec()
    cache_max_nbytes: int = Field(2 << 30, ge=0)  # host-memory LRU per loader replica
    max_chunks: int = Field(64, ge=1)  # per request, after doc_ids expand (413 beyond)
    max_context_tokens: int | None = Field(None, ge=1)  # default: the model's max_position_embeddings
    default_top_k: int = Field(8, ge=1)  # chat requests that name no chunks retrieve this many
    served_model_name: str = Field("qvpic", min_length=1, max_length=256)
    embedder_dir: str | None = None  # default: the packaged all-MiniLM-L6-v2
    engine: EngineSpec = EngineSpec()  # the generator's batch: caps, queue, device hot tier
    request_timeout_s: float = Field(300.0, gt=0, le=MAX_TIMEOUT_S)  # default deadline (504 past it)
    ingress_deployment: DeploymentConfig = DeploymentConfig()
    router_deployment: DeploymentConfig = DeploymentConfig()
    loader_deployment: DeploymentConfig = DeploymentConfig()
    # Serve holds what the engine cannot take yet: a full batch plus its queue
    generator_deployment: DeploymentConfig = DeploymentConfig(max_ongoing_requests=80)
    governance: GovernanceConfig = GovernanceConfig()  # budgets, rate limits, response caches, request log, auth
    drain_timeout_s: float = Field(20.0, ge=0)  # how long a stopping replica finishes in-flight requests
    reload: ReloadSpec = ReloadSpec()  # how router and loader follow the store's published generations
    router_search_threads: int = Field(1, ge=1, le=256)  # per query, over an exhaustive index's shards
    recompute: RecomputeSpec = RecomputeSpec()  # selective recompute across linked chunks (off by default)

    @model_validator(mode="after")
    def _top_k_fits(self) -> AppConfig:
        if self.default_top_k > self.max_chunks:
            raise ValueError(f"default_top_k {self.default_top_k} exceeds max_chunks {self.max_chunks}")
        return self

    def router_config(self) -> RouterConfig:
        return RouterConfig(store=self.store, model=self.model, defaults=self.router, max_chunks=self.max_chunks,
                            max_context_tokens=self.max_context_tokens, embedder_dir=self.embedder_dir,
                            reload=self.reload, scan=ScanSpec(search_threads=self.router_search_threads),
                            carry_sources=self.recompute.enabled)

    def loader_config(self) -> LoaderConfig:
        return LoaderConfig(store=self.store, max_nbytes=self.cache_max_nbytes, reload=self.reload)

    def generator_config(self) -> GeneratorConfig:
        return GeneratorConfig(store=self.store, model=self.model, engine=self.engine, recompute=self.recompute)

    def ingress_config(self, settings: ApiSpec) -> IngressConfig:
        return IngressConfig(settings=settings, governance=self.governance, request_timeout_s=self.request_timeout_s)
