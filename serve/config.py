"""Typed configuration of the Serve application: one config per deployment, bound by keyword.

`AppConfig` is what `qvpic serve` flags and serve/config.yaml `args` fill in. It nests one config per
role — `router`, `loader`, `generator`, `ingress` — and the builder (serve/app.py) hands each to its
deployment whole, as `Deployment.bind(config=…, <handles>=…)`, Ray Serve LLM's builder style. What
several roles share (`store`, `model`, `reload`) is set once, at the top, and copied into the roles
that use it. The ingress's governance (auth, budgets and rate limits, response caches, request log)
nests in `IngressConfig` and is typed in serve/governance/config.py, which imports only `schemas`, so
that import points one way. This module imports no model stack, so the ingress replica can hold its own
config without loading torch.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator

from schemas.api import MAX_TIMEOUT_S
from schemas.config import (
    EngineConfig,
    EngineKind,
    Frozen,
    ImageUrlsSpec,
    ModelSpec,
    RecomputeSpec,
    RouterSpec,
    WeightsPlacement,
)
from schemas.generation import CollectionCounts, ReloadSpec, ScanSpec, counts_within, reads_all
from schemas.service import StoreInfo
from schemas.store import ImagesRoot, StoreSpec
from serve.deployment import DeploymentConfig, Placement
from serve.governance.config import GovernanceConfig, StateBackend


class StoreBound(Frozen):
    """A role over one store; a bare URI string is accepted for `store`."""

    store: StoreSpec

    @field_validator("store", mode="before")
    @classmethod
    def _uri(cls, store: object) -> object:
        return {"uri": store} if isinstance(store, str) else store


# ---- dispatch across generator replicas -----------------------------------------------------------------

class Dispatch(str, Enum):
    """Which generator replica a request goes to (serve/dispatch/)."""

    AFFINITY = "affinity"  # to the replica whose hot tier holds most of the plan's bytes, under a load cap
    DEFAULT = "default"  # Serve's power of two choices


class LoaderPlacement(str, Enum):
    """Where the host-memory KV tier (serve/kv/loader.py) runs."""

    DEPLOYMENT = "deployment"  # its own deployment (`loader_deployment`), a hop away, shared by every generator
    IN_GENERATOR = "in_generator"  # one in each generator replica's process, on its node: no hop, its own LRU


class AffinityConfig(Frozen):
    """The chunk-affinity dispatcher's knobs (serve/dispatch/affinity.py), used when `dispatch: affinity`."""

    max_load_ratio: float = Field(1.5, ge=1.0, description="no replica is sent a request that would put it above "
                                  "this multiple of the mean in-flight requests (counting the request)...")
    min_in_flight: int = Field(2, ge=1, description="...except up to this many in flight: at one or two requests "
                               "balance is noise (the engine batches them), a hot tier's miss is not")
    stats_period_s: float = Field(2.0, gt=0, description="how often Serve collects each replica's hot-tier sketch")
    stale_after_s: float = Field(10.0, gt=0, description="stats older than this are ignored (that replica is "
                                 "dispatched to as if it held nothing; with none fresh, power of two choices)")


# ---- one config per role ----------------------------------------------------------------------------------

class FramingSpec(Frozen):
    """Where the router frames a conversation (serve/routing/framer.py): a large one in a framing process of the
    replica's own, so its GIL-bound template rendering and tokenising never hold the replica's other requests."""

    processes: int = Field(1, ge=0, le=16)  # framing processes per router replica (0: every conversation on a thread)
    # a conversation of at least this many messages, content parts and tool calls together, or this many characters
    # of text and call arguments, is framed in a process (a 4-turn chat is a thread's ~1 ms; 256 messages ~45 ms)
    min_parts: int = Field(64, ge=1)
    min_chars: int = Field(32_768, ge=1)
    # a conversation still framing after this long is refused (400 naming `messages`) and its process replaced
    timeout_s: float = Field(10.0, gt=0, le=600)


class RouterConfig(StoreBound):
    model: ModelSpec
    defaults: RouterSpec = RouterSpec()  # a request's τ, B, normalisation, hybrid rule unless it sets them
    max_chunks: int = Field(64, ge=1)  # per request, after doc_ids expand (413 beyond)
    max_context_tokens: int | None = Field(None, ge=1)  # default: the model's max_position_embeddings
    embedder_dir: str | None = None  # default: the packaged all-MiniLM-L6-v2
    reload: ReloadSpec = ReloadSpec()  # how it follows the store's published generations
    scan: ScanSpec = ScanSpec()  # how one query searches the vector index
    carry_sources: bool = False  # linked plans carry each chunk's text and page image (recompute needs them)
    # false on vLLM's engine, whose connector supplies one group of chunks: a conversation's earlier user messages
    # then retrieve nothing (their text stays), whatever a request's `history_chunks` says (docs/DEPLOY.md, Engines)
    history_chunks: bool = True
    # with history_chunks, the earlier user messages that retrieve: the latest this many (older ones keep their text,
    # no chunks). Each is a query embedded and searched; unbounded, one 256-message request was 255 (issue 60)
    max_history_queries: int = Field(8, ge=0, le=255)
    query_cache_entries: int = Field(4096, ge=0)  # query vectors remembered per router replica, keyed per tenant
    # threads of a query's embedding forward (None: the replica's torch threads, 1 for a fractional CPU); 2 took a
    # new query's route from 11.3 to 7.8 ms p50 (docs/BENCHMARKS.md `routing`): give the replica the cores
    embed_threads: int | None = Field(None, ge=1, le=64)
    hmac_key_file: Path | None = None  # AppConfig.hmac_key_file: only generations sealed with it are served
    framing: FramingSpec = FramingSpec()  # large conversations framed in a process of their own


class LoaderConfig(StoreBound):
    max_nbytes: int = Field(2 << 30, ge=0)  # host-memory LRU per loader replica
    reload: ReloadSpec = ReloadSpec()


class GeneratorConfig(StoreBound):
    model: ModelSpec
    engine: EngineConfig = EngineConfig()  # the batch: caps, queue, device hot tier
    recompute: RecomputeSpec = RecomputeSpec()  # linked chunks' tokens recomputed on the context (off by default)
    images_root: ImagesRoot | None = None  # scanned pages are read only under it (AppConfig.images_root)

    @model_validator(mode="after")
    def _engine_serves_it(self) -> GeneratorConfig:
        """What only qvpic's engine does is refused at start-up on vLLM's, naming it (docs/DEPLOY.md, Engines)."""
        if self.engine.kind is EngineKind.VLLM and self.recompute.enabled:
            raise ValueError("recompute: selective recompute runs on qvpic's engine only (engine.kind: qvpic)")
        if self.engine.kind is EngineKind.QVPIC and self.engine.tensor_parallel_size > 1:
            raise ValueError("engine.tensor_parallel_size: tensor parallelism runs on vLLM's engine only "
                             "(engine.kind: vllm)")
        if self.engine.kind is EngineKind.QVPIC and self.model.weights is WeightsPlacement.HOST:
            raise ValueError("model.weights: host serves vLLM's engine only: qvpic's engine runs every forward on the "
                             "model's device (weights: device, or leave it unset)")
        return self


class ResponseStoreConfig(Frozen):
    """`/v1/responses` with `store`: by default each ingress replica keeps its tenants' responses in memory (a
    replica's own: `previous_response_id` reaches a response stored by the same replica); `backend: redis` keeps them
    in the governance's `redis_url`, shared by every replica. Bounded per tenant in count and bytes (the oldest go
    first) and in tenants (the least recently used go first), each expiring `ttl_s` after it was stored."""

    backend: StateBackend = StateBackend.MEMORY  # redis: needs `governance.redis_url`
    max_responses_per_tenant: int = Field(256, ge=1)
    max_bytes_per_tenant: int = Field(32 << 20, ge=1024)  # the response and its conversation, as JSON
    max_tenants: int = Field(1024, ge=1)
    ttl_s: float = Field(3600.0, gt=0)


class IngressConfig(Frozen):
    served_model_name: str = Field("qvpic", min_length=1, max_length=256)  # model id of /v1/models and chat requests
    # a second model id that never retrieves: chat UIs' side calls (titles, tags) and chains that bring their own
    # context get exactly their prompt (None: `<served_model_name>-chat`)
    chat_model_name: str | None = Field(None, min_length=1, max_length=256)
    default_top_k: int = Field(8, ge=1)  # chat requests that name no chunks retrieve this many
    request_timeout_s: float = Field(300.0, gt=0, le=MAX_TIMEOUT_S)  # deadline of a request that sets none (504)
    image_urls: ImageUrlsSpec = ImageUrlsSpec()  # chat images by http(s) URL: off, the server fetches nothing
    governance: GovernanceConfig = GovernanceConfig()
    responses: ResponseStoreConfig = ResponseStoreConfig()  # stored `/v1/responses` answers

    @model_validator(mode="after")
    def _redis_for_responses(self) -> IngressConfig:
        if self.responses.backend is StateBackend.REDIS and self.governance.redis_url is None:
            raise ValueError("responses use backend 'redis' but governance.redis_url is not set")
        return self


class ApiSpec(Frozen):
    """What the HTTP surface states: the ingress's model name and default top-k, and the store it serves
    (read by the builder, so the ingress replica never opens the store)."""

    served_model_name: str
    default_top_k: int
    chat_model_name: str | None = None  # the id that never retrieves (None: `<served_model_name>-chat`)
    max_model_len: int | None = None  # the context the router fills (`/v1/models`, vLLM's field); None: unknown
    store: StoreInfo  # as a key reading every collection sees it
    created: int  # unix seconds: when the store was created
    collections: dict[str, CollectionCounts] = Field(default_factory=dict)  # the serving generation's, per collection

    @property
    def plain_chat_model(self) -> str:
        """The model id whose requests never retrieve (plain chat over the messages alone)."""
        return self.chat_model_name or f"{self.served_model_name}-chat"

    @property
    def model_ids(self) -> list[str]:
        """What `/v1/models` lists: the served model (retrieves from the store) and its plain-chat id."""
        return [self.served_model_name, self.plain_chat_model]

    def store_for(self, grant: frozenset[str]) -> StoreInfo:
        """`store` as a key reading the collections of `grant` sees it: the counts of those collections only
        (the whole store's when it reads every collection the store holds)."""
        if reads_all(grant) or set(self.collections) <= grant:
            return self.store
        counts = counts_within(self.collections, grant)
        return self.store.model_copy(update={"num_chunks": counts.num_chunks, "num_documents": counts.num_documents,
                                            "num_entries": None})


# Keys renamed since they were shipped: still read, with a deprecation warning naming the new one.
RENAMED = {"routing": "dispatch"}  # issue 57: "routing" is the relevance router's alone


def renamed_keys(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with each renamed top-level key under its new name (both given: the new one wins, the old is dropped)."""
    for old, new in RENAMED.items():
        if old in data:
            value = data.pop(old)
            warnings.warn(f"serve config: `{old}` is now `{new}`; `{old}` is read for now and will be refused in a "
                          "later release", DeprecationWarning, stacklevel=4)
            data.setdefault(new, value)
    return data


# The top-level fields each role gets a copy of; a role section may not set them itself.
SHARED = {"router": ("store", "model", "reload", "hmac_key_file"), "loader": ("store", "reload"),
          "generator": ("store", "model", "images_root")}
# router.carry_sources = generator.recompute.enabled; router.history_chunks = the generator's engine takes them
DERIVED = {"router": ("carry_sources", "history_chunks")}


class AppConfig(StoreBound):
    """Typed arguments of `build_app`: what `qvpic serve` flags and serve/config.yaml `args` fill in."""

    model: ModelSpec = ModelSpec()
    reload: ReloadSpec = ReloadSpec()  # how router and loader follow the store's published generations
    # The directory scanned page images are read from (full_image, recompute, repair, the inspector's pages); a
    # chunk's stored `image_path` outside it is refused unread. None: no page image is read (docs/SECURITY.md).
    images_root: ImagesRoot | None = None
    # A file holding the key generations are sealed with (pipeline/store/seal.py), on every router host: the app
    # refuses to start on, and routers refuse to switch to, a generation whose seal is missing or wrong. Unset:
    # the QVPIC_HMAC_KEY environment variable if set, else seals are not checked. Never the key itself.
    hmac_key_file: Path | None = None
    router: RouterConfig
    loader: LoaderConfig
    generator: GeneratorConfig
    ingress: IngressConfig = IngressConfig()
    dispatch: Dispatch = Dispatch.AFFINITY  # across generator replicas (docs/BENCHMARKS.md `affinity`)
    affinity: AffinityConfig = AffinityConfig()
    # The defaults are serve/config-gpu.yaml's topology (docs/DEPLOY.md "Topology"), so `qvpic serve` without
    # --config places replicas as the shipped config does: the host LRU in each generator (no loader deployment to
    # lose; docs/BENCHMARKS.md `affinity` measures both), the CPU deployments on the head, whose loss loses the
    # cluster anyway — never the only router on a worker whose loss answers 503 until Serve restarts it elsewhere.
    loader_placement: LoaderPlacement = LoaderPlacement.IN_GENERATOR
    drain_timeout_s: float = Field(20.0, ge=0)  # how long a stopping replica finishes in-flight requests
    ingress_deployment: DeploymentConfig = DeploymentConfig(placement=Placement.HEAD)
    inspector_deployment: DeploymentConfig = DeploymentConfig(placement=Placement.HEAD)  # the /ui pages' store side
    router_deployment: DeploymentConfig = DeploymentConfig(placement=Placement.HEAD)
    loader_deployment: DeploymentConfig = DeploymentConfig(placement=Placement.HEAD)
    # Serve holds what the engine cannot take yet: a full batch plus its queue
    generator_deployment: DeploymentConfig = DeploymentConfig(max_ongoing_requests=80)

    @model_validator(mode="before")
    @classmethod
    def _share(cls, data: Any) -> Any:
        """Each role section, completed with the shared fields (and what is derived from other roles)."""
        if not isinstance(data, Mapping):
            return data
        data = renamed_keys(dict(data))
        shared = {name: data[name] if name in data else cls.model_fields[name].get_default(call_default_factory=True)
                  for name in ("model", "reload")}
        shared |= {name: data[name] for name in ("store", "images_root", "hmac_key_file") if name in data}
        sections = {role: data.get(role) or {} for role in SHARED}
        if not all(isinstance(section, Mapping) for section in sections.values()):
            return data  # pydantic names the section that is not a mapping
        try:
            recompute = RecomputeSpec.model_validate(sections["generator"].get("recompute", RecomputeSpec()))
        except ValidationError:
            recompute = RecomputeSpec()  # the generator section's own validation reports it
        engine = sections["generator"].get("engine") or {}
        kind = engine.get("kind", EngineKind.QVPIC) if isinstance(engine, Mapping) else getattr(engine, "kind", None)
        derived = {"carry_sources": recompute.enabled, "history_chunks": kind != EngineKind.VLLM}  # a str enum
        for role, section in sections.items():
            if repeated := sorted(set(section) & set(SHARED[role])):
                raise ValueError(f"{role}: set {repeated} once, at the top level, for every role")
            if repeated := sorted(set(section) & set(DERIVED.get(role, ()))):
                raise ValueError(f"{role}: {repeated} follow the generator section (recompute, engine.kind); set "
                                 "that instead")
            data[role] = {**section, **{n: shared[n] for n in SHARED[role] if n in shared},
                          **{n: derived[n] for n in DERIVED.get(role, ())}}
        return data

    @model_validator(mode="after")
    def _top_k_fits(self) -> AppConfig:
        if self.ingress.default_top_k > self.router.max_chunks:
            raise ValueError(f"ingress.default_top_k {self.ingress.default_top_k} exceeds router.max_chunks "
                             f"{self.router.max_chunks}")
        return self

    @model_validator(mode="after")
    def _holds_leave_room(self) -> AppConfig:
        """Held refusals (serve/governance/governor.py `_hold`) occupy ingress slots: all of them held would leave
        no slot for any other request."""
        held = self.ingress.governance.limits.max_held_refusals_total
        slots = self.ingress_deployment.max_ongoing_requests
        if held >= slots:
            raise ValueError(f"ingress.governance.limits.max_held_refusals_total {held} must be below "
                             f"ingress_deployment.max_ongoing_requests {slots}: refusals held at once would take "
                             f"every slot of the ingress replica")
        return self

    @model_validator(mode="after")
    def _ranks_have_gpus(self) -> AppConfig:
        """vLLM's tensor-parallel ranks are worker processes of the generator replica: on GPUs, one of the replica's
        each (Ray gives the replica its GPUs; the ranks inherit them)."""
        ranks, gpus = self.generator.engine.tensor_parallel_size, self.generator_deployment.num_gpus
        if ranks > 1 and gpus and gpus != ranks:
            raise ValueError(f"generator_deployment.num_gpus {gpus:g} must be generator.engine.tensor_parallel_size "
                             f"{ranks}: each tensor-parallel rank runs on one of the replica's GPUs")
        return self
