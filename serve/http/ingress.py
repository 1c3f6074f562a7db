"""The ingress: the HTTP surface (FastAPI) of the Serve application and the deployment that serves it.

Each request reads as route → generate (see serve/http/backend.py for how the roles are reached), as one
governed turn (serve/http/exchange.py) within its lifetime (serve/http/lifetime.py: a deadline, and
cancellation when the client goes away); the OpenAI surface (serve/http/openai/) runs the same turn. This module
and everything it imports stay clear of the model stack (no torch, no transformers): the ingress
replica is a light web server; serve/app.py builds the application.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from schemas.api import AnswerRequest, BudgetErrorBody, ErrorBody
from schemas.errors import ApiError
from schemas.report import AnswerResponse, EstimateResponse, StreamDelta, StreamDone, StreamError
from schemas.service import Health, StoreStatus
from serve.config import ApiSpec, IngressConfig
from serve.governance import Governor, Route
from serve.governance.auth import exposure
from serve.http.backend import Backend, HandleBackend, api_error, error_cause, sse
from serve.http.exchange import Turns
from serve.http.guards import ReleaseTurn, install_guards
from serve.http.health import ReadinessProbe, fetch_gate_readiness, install_readiness
from serve.http.image_urls import ImageFetcher
from serve.http.openai import (
    completion_routes,
    embedding_routes,
    is_openai_path,
    openai_error,
    openai_routes,
    response_routes,
    response_store,
)
from serve.http.parsing import WorkerParsedRoute
from serve.http.utility import utility_routes
from serve.metrics import CONTENT_TYPE, serve_metrics
from serve.plan import Answer
from serve.ui import install_ui

logger = logging.getLogger(__name__)


def make_api(backend: Backend, api: ApiSpec, governor: Governor | None = None,
             config: IngressConfig = IngressConfig(), images: ImageFetcher | None = None) -> FastAPI:
    """The HTTP surface; `governor` defaults to one of `config.governance` (by default, an in-process l1
    response cache only), `images` to the fetcher of `config.image_urls` (tests give one with their resolver)."""
    governor = governor or Governor(config.governance, api.store)
    turns = Turns(backend, governor, config.request_timeout_s, images or ImageFetcher(config.image_urls))
    app = FastAPI(title="qvpic", version="1", description="Query-aware visual PIC over a precompiled KV store.")
    app.router.route_class = WorkerParsedRoute  # a large body is parsed and validated off the event loop

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, error: ApiError) -> JSONResponse:
        status, detail = api_error(error)
        governor.rejected(request, status)
        cause = error_cause(error)
        headers = cause.headers() if isinstance(cause, ApiError) else {}
        if is_openai_path(request.url.path):
            return openai_error(getattr(cause, "openai_status", status), detail, headers,
                                param=getattr(cause, "param", None), code=getattr(cause, "openai_code", None))
        fields = cause.body_fields() if isinstance(cause, ApiError) else {}
        return JSONResponse(status_code=status, content={"detail": detail, **fields}, headers=headers)

    @app.get("/healthz")
    async def healthz() -> Health:
        return Health()

    @app.get("/v1/store")
    async def store_status(http: Request) -> StoreStatus:
        """What the store holds, counted within the collections the caller's key reads."""
        store = api.store_for(governor.collections(http))
        return StoreStatus(**store.model_dump(), cache=await backend.cache_stats(),
                           device_cache=await backend.device_cache_stats())

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        """This replica's metrics in Prometheus text format (cluster-wide: Ray's metrics export port)."""
        return Response(serve_metrics().exposition(), media_type=CONTENT_TYPE)

    @app.post("/v1/estimate", response_model=EstimateResponse,
              responses={status: {"model": ErrorBody} for status in (401, 404, 413, 429, 503)})
    async def estimate(request: AnswerRequest, http: Request, response: Response):
        """Route only: what the request would put in context and whether it fits its budget. No KV is loaded."""
        exchange = await turns.begin(http, request, Route.ESTIMATE)
        await exchange.route()
        await exchange.turn.charge_estimate()  # the prompt text the router read, to the tenant's token rate
        response.headers.update(exchange.headers)
        return exchange.turn.estimate()

    @app.post("/v1/answer", response_model=AnswerResponse,
              responses={200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream=true"},
                         413: {"model": BudgetErrorBody | ErrorBody},  # a token budget, or any other limit
                         **{status: {"model": ErrorBody} for status in (401, 404, 429, 503)}})
    async def answer(request: AnswerRequest, http: Request, response: Response):
        started = time.perf_counter()
        answer_id = f"ans-{uuid.uuid4().hex}"
        exchange = await turns.begin(http, request, Route.ANSWER)
        await exchange.admit()
        if not request.stream:
            return respond(answer_id, await exchange.answer(response), started)

        async def events() -> AsyncIterator[str]:
            try:
                async for event in exchange.stream():
                    if isinstance(event, str):
                        yield sse(StreamDelta(text=event))
                    else:
                        yield sse(StreamDone(response=respond(answer_id, event, started)))
            except Exception as error:  # noqa: BLE001  after the 200 is sent, any error travels as an event
                status, detail = api_error(error, exchange.turn.record.request_id)
                yield sse(StreamError(status_code=status, detail=detail))

        return StreamingResponse(events(), media_type="text/event-stream", headers=exchange.headers)

    for routes in (openai_routes, completion_routes, embedding_routes):
        app.include_router(routes(turns, api))
    # stored responses: this replica's memory, or the governance's Redis (`responses.backend`)
    app.include_router(response_routes(turns, api, response_store(config.responses, governor.redis)))
    app.include_router(utility_routes(backend, api, api.model_ids))  # vLLM's /health, /version, /tokenize, …
    # 401 without a key (when keys exist), 413 over 16 MiB, JSON 422 for any input, 503 when a replica dies
    async def charge_on_arrival(request: Request) -> Response | None:
        try:
            await governor.arrive(request)
        except ApiError as error:
            return await _api_error(request, error)
        return None

    async def charge_shape(request: Request, extra_requests: int) -> Response | None:
        try:
            await governor.charge_shape(request, extra_requests)
        except ApiError as error:
            return await _api_error(request, error)
        return None

    install_guards(app, governor.rejected, governor.auth, charge=charge_on_arrival, charge_shape=charge_shape)
    app.add_middleware(ReleaseTurn, release=governor.release)  # a tenant's in-flight slot, back when it ends
    return app


def respond(answer_id: str, answer: Answer, started: float) -> AnswerResponse:
    report = answer.report.with_total_ms((time.perf_counter() - started) * 1e3)
    return AnswerResponse(id=answer_id, answer=answer.text, logprobs=answer.logprobs, **report.model_dump())


def serve_http_host() -> str | None:
    """The interface Serve's HTTP proxies bind (the config's `http_options.host`), asked of the Serve controller
    through Ray's client (`ray.serve.context._get_global_client().http_config`, Ray-internal: checked on 2.60);
    None where that is unavailable, and then no check is made (logged)."""
    try:
        from ray.serve.context import _get_global_client

        return _get_global_client().http_config.host
    except Exception as error:  # noqa: BLE001 - a Ray-internal call: its absence must not stop serving
        logger.warning("could not read Serve's http_options.host (%s): the open-bind check is skipped", error)
        return None


def refuse_open_bind(config: IngressConfig) -> None:
    """Fail the replica (so the deploy) when the proxies listen beyond loopback with no API keys, unless
    `auth.insecure_no_auth` accepts it — then warn at every start (serve/governance/auth.py `exposure`)."""
    host = serve_http_host()
    if host is not None and (warning := exposure(host, config.governance.auth)):
        logger.warning(warning)


@serve.ingress()
class Ingress:
    def __init__(self, router: DeploymentHandle, loader: DeploymentHandle | None, generator: DeploymentHandle,
                 inspector: DeploymentHandle, config: IngressConfig, api: ApiSpec):
        self.backend = HandleBackend(router, loader, generator)
        self.inspector = inspector  # page images and the store overview of the /ui pages (serve/ui/)
        self.config, self.api = config, api
        self.governor = Governor(config.governance, api.store)
        refuse_open_bind(config)  # `serve run` / `serve deploy` of an edited config get qvpic serve's check too
        app_name = serve.get_replica_context().app_name
        self.readiness = ReadinessProbe(app_name, fetch_gate_readiness)  # before every request: cheap while healthy
        self.readiness_detail = ReadinessProbe(app_name)  # GET /readyz: every deployment's replicas and resources

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = make_api(self.backend, self.api, self.governor, self.config)
        # GET /readyz; 503 while a deployment is pending
        install_readiness(app, self.readiness, self.governor.rejected, self.readiness_detail, self.governor.auth)
        install_ui(app, self.inspector, self.backend, self.governor)  # GET /ui, /ui/store and their data
        return app

    def __del__(self) -> None:  # Serve calls it on graceful shutdown: write the buffered request log
        if hasattr(self, "governor"):  # not when __init__ failed before creating it
            self.governor.close()
