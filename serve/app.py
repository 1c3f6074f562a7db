"""The Serve application: ingress (FastAPI) → router → cache loader → generator, and its builder.

Each request reads as route → load → generate (see serve/backend.py for how the roles are reached).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, model_validator
from ray import serve
from ray.serve.handle import DeploymentHandle

from schemas.sampling import Sampling
from pipeline.generations import ensure_generation, read_generation
from pipeline.store import Store
from schemas.api import (
    AnswerRequest,
    AnswerResponse,
    ApiError,
    BudgetErrorBody,
    ErrorBody,
    EstimateResponse,
    Health,
    StoreInfo,
    StoreStatus,
    StreamDelta,
    StreamDone,
    StreamError,
)
from schemas.config import Frozen, ModelSpec, RouterSpec
from schemas.generation import ReloadSpec
from schemas.store import StoreSpec
from serve import openai_api
from serve.backend import ApiSettings, Backend, HandleBackend, api_error, error_cause, sse
from serve.generator import Generator
from serve.plan import Answer
from serve.governance import GovernanceArgs, Governor, Route
from serve.health import ReadinessProbe, install_readiness
from serve.limits import install_limits
from serve.loader import CacheLoader
from serve.metrics import CONTENT_TYPE, serve_metrics
from serve.openai_api import openai_error, openai_routes
from serve.router import BatchingRouter, check_store, servable_modes


class DeploymentArgs(Frozen):
    """Replicas and resources of one deployment. CPU deployments take a fraction of a CPU so the whole
    graph fits a 2-core box (Serve's default of 1 CPU per replica would not)."""

    num_replicas: int | None = Field(1, ge=1)
    autoscaling_config: dict[str, Any] | None = None  # Serve AutoscalingConfig fields
    num_cpus: float = Field(0.1, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    max_ongoing_requests: int = Field(16, ge=1)

    @model_validator(mode="after")
    def _replicas_or_autoscaling(self) -> DeploymentArgs:
        if self.autoscaling_config is not None and self.num_replicas not in (None, 1):
            raise ValueError("set either num_replicas or autoscaling_config, not both")
        return self

    def options(self) -> dict[str, Any]:
        scale = ({"autoscaling_config": self.autoscaling_config} if self.autoscaling_config is not None
                 else {"num_replicas": self.num_replicas or 1})
        return {**scale, "max_ongoing_requests": self.max_ongoing_requests,
                "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}}


class AppArgs(Frozen):
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
    ingress_deployment: DeploymentArgs = DeploymentArgs()
    router_deployment: DeploymentArgs = DeploymentArgs()
    loader_deployment: DeploymentArgs = DeploymentArgs()
    generator_deployment: DeploymentArgs = DeploymentArgs(max_ongoing_requests=8)
    governance: GovernanceArgs = GovernanceArgs()  # budgets, rate limits, response caches, request log, auth
    drain_timeout_s: float = Field(20.0, ge=0)  # how long a stopping replica finishes in-flight requests
    reload: ReloadSpec = ReloadSpec()  # how router and loader follow the store's published generations

    @model_validator(mode="after")
    def _top_k_fits(self) -> AppArgs:
        if self.default_top_k > self.max_chunks:
            raise ValueError(f"default_top_k {self.default_top_k} exceeds max_chunks {self.max_chunks}")
        return self


def make_api(backend: Backend, settings: ApiSettings, governor: Governor | None = None) -> FastAPI:
    """The HTTP surface; `governor` defaults to GovernanceArgs() (in-process l1 response cache only)."""
    governor = governor or Governor(GovernanceArgs(), settings.store)
    app = FastAPI(title="qvpic", version="1", description="Query-aware visual PIC over a precompiled KV store.")

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, error: ApiError) -> JSONResponse:
        status, detail = api_error(error)
        governor.rejected(request, status)
        cause = error_cause(error)
        headers = cause.headers() if isinstance(cause, ApiError) else {}
        if request.url.path.startswith(openai_api.PATH_PREFIX):
            return openai_error(status, detail, headers)
        fields = cause.body_fields() if isinstance(cause, ApiError) else {}
        return JSONResponse(status_code=status, content={"detail": detail, **fields}, headers=headers)

    @app.get("/healthz")
    async def healthz() -> Health:
        return Health()

    @app.get("/v1/store")
    async def store_status() -> StoreStatus:
        return StoreStatus(**settings.store.model_dump(), cache=await backend.cache_stats())

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        """This replica's metrics in Prometheus text format (cluster-wide: Ray's metrics export port)."""
        return Response(serve_metrics().exposition(), media_type=CONTENT_TYPE)

    @app.post("/v1/estimate", response_model=EstimateResponse,
              responses={status: {"model": ErrorBody} for status in (401, 404, 413, 429, 503)})
    async def estimate(request: AnswerRequest, http: Request, response: Response):
        """Route only: what the request would put in context and whether it fits its budget. No KV is loaded."""
        turn = await governor.begin(http, request, Route.ESTIMATE)
        await turn.route(backend)
        response.headers.update(turn.headers)
        return turn.estimate()

    @app.post("/v1/answer", response_model=AnswerResponse,
              responses={200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream=true"},
                         413: {"model": BudgetErrorBody | ErrorBody},  # a token budget, or any other limit
                         **{status: {"model": ErrorBody} for status in (401, 404, 429, 503)}})
    async def answer(request: AnswerRequest, http: Request, response: Response):
        started = time.perf_counter()
        answer_id = f"ans-{uuid.uuid4().hex}"
        sampling = Sampling.of(request)
        turn = await governor.begin(http, request, Route.ANSWER)
        await turn.route(backend)
        hit = await turn.prepare(sampling)
        if not request.stream:
            response.headers.update(turn.headers)
            return respond(answer_id, await turn.generate(backend, sampling, hit), started)

        async def events() -> AsyncIterator[str]:
            try:
                async for event in turn.stream(backend, sampling, hit):
                    if isinstance(event, str):
                        yield sse(StreamDelta(text=event))
                    else:
                        yield sse(StreamDone(response=respond(answer_id, event, started)))
            except Exception as error:  # noqa: BLE001  after the 200 is sent, any error travels as an event
                status, detail = api_error(error)
                yield sse(StreamError(status_code=status, detail=detail))

        return StreamingResponse(events(), media_type="text/event-stream", headers=turn.headers)

    app.include_router(openai_routes(backend, settings, governor))
    install_limits(app, governor.rejected)  # 413 over 1 MiB, JSON 422 for any input, 503 when a replica dies
    return app


def respond(answer_id: str, answer: Answer, started: float) -> AnswerResponse:
    report = answer.report.with_total_ms((time.perf_counter() - started) * 1e3)
    return AnswerResponse(id=answer_id, answer=answer.text, **report.model_dump())


def api_settings(args: AppArgs) -> ApiSettings:
    store = Store.open(args.store)
    generation = read_generation(store, ensure_generation(store))
    manifest = generation.manifest  # counts from the generation record: nothing re-reads the tables
    info = StoreInfo(fingerprint=manifest.fingerprint, model_id=manifest.model.id,
                     tiers={t.name: t.dpi for t in manifest.tiers}, variants=list(manifest.variants),
                     embedder=manifest.embedder, num_chunks=generation.num_chunks,
                     num_documents=generation.num_documents, num_entries=generation.num_entries,
                     modes=servable_modes(manifest.variants))
    return ApiSettings(served_model_name=args.served_model_name, default_top_k=args.default_top_k, store=info,
                       created=int(manifest.created_at.timestamp()))


@serve.ingress()
class Ingress:
    def __init__(self, router: DeploymentHandle, loader: DeploymentHandle, generator: DeploymentHandle,
                 args: AppArgs):
        self.backend = HandleBackend(router, loader, generator)
        self.settings = api_settings(args)
        self.governor = Governor(args.governance, self.settings.store)
        self.readiness = ReadinessProbe(serve.get_replica_context().app_name)

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = make_api(self.backend, self.settings, self.governor)
        install_readiness(app, self.readiness, self.governor.rejected)  # GET /readyz; 503 while a deployment is pending
        return app

    def __del__(self) -> None:  # Serve calls it on graceful shutdown: write the buffered request log
        if hasattr(self, "governor"):  # not when __init__ failed before creating it
            self.governor.close()


def preflight(args: AppArgs) -> None:
    """Fail fast, before any replica starts, when the store was compiled for another model; publish a
    serving generation once when no job has (so replicas never race to build one)."""
    store = Store.open(args.store)
    check_store(store.load_manifest_or_raise(), args.model)
    ensure_generation(store)


def build_app(args: AppArgs | dict[str, Any]) -> serve.Application:
    """Serve application builder (`import_path: serve.app:build_app`). Serve passes YAML `args` as a
    dict (it only converts them itself for a non-string annotation), so they are validated here."""
    args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args)
    preflight(args)
    def deployment(cls: type, name: str, resources: DeploymentArgs):
        return serve.deployment(cls, name=name).options(**resources.options(),
                                                        graceful_shutdown_timeout_s=args.drain_timeout_s)

    router = deployment(BatchingRouter, "Router", args.router_deployment).bind(
        args.store, args.model, args.router, args.max_chunks, args.max_context_tokens, args.embedder_dir, args.reload)
    loader = deployment(CacheLoader, "CacheLoader", args.loader_deployment).bind(args.store, args.cache_max_nbytes,
                                                                                  args.reload)
    generator = deployment(Generator, "Generator", args.generator_deployment).bind(args.store, args.model)
    return deployment(Ingress, "Ingress", args.ingress_deployment).bind(router, loader, generator, args)
