"""The ingress: the HTTP surface (FastAPI) of the Serve application and the deployment that serves it.

Each request reads as route → generate (see serve/http/backend.py for how the roles are reached), within
its lifetime (serve/http/lifetime.py: a deadline, and cancellation when the client goes away). This module
and everything it imports stay clear of the model stack (no torch, no transformers): the ingress
replica is a light web server; serve/app.py builds the application.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from schemas.api import (
    AnswerRequest,
    AnswerResponse,
    BudgetErrorBody,
    ErrorBody,
    EstimateResponse,
    Health,
    StoreStatus,
    StreamDelta,
    StreamDone,
    StreamError,
)
from schemas.errors import ApiError
from schemas.sampling import Sampling
from serve.http import openai_api
from serve.http.backend import Backend, HandleBackend, api_error, error_cause, sse
from serve.config import ApiSpec, IngressConfig
from serve.governance import GovernanceConfig, Governor, Route
from serve.http.health import ReadinessProbe, install_readiness
from serve.http.lifetime import Lifetime, request_timeout_s
from serve.http.guards import install_limits
from serve.metrics import CONTENT_TYPE, serve_metrics
from serve.http.openai_api import openai_error, openai_routes
from serve.plan import Answer

DEFAULT_TIMEOUT_S = 300.0


def make_api(backend: Backend, settings: ApiSpec, governor: Governor | None = None,
             timeout_s: float = DEFAULT_TIMEOUT_S) -> FastAPI:
    """The HTTP surface; `governor` defaults to GovernanceConfig() (in-process l1 response cache only);
    `timeout_s` is the deadline of a request that sets none."""
    governor = governor or Governor(GovernanceConfig(), settings.store)
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
        return StoreStatus(**settings.store.model_dump(), cache=await backend.cache_stats(),
                           device_cache=await backend.device_cache_stats())

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        """This replica's metrics in Prometheus text format (cluster-wide: Ray's metrics export port)."""
        return Response(serve_metrics().exposition(), media_type=CONTENT_TYPE)

    @app.post("/v1/estimate", response_model=EstimateResponse,
              responses={status: {"model": ErrorBody} for status in (401, 404, 413, 429, 503)})
    async def estimate(request: AnswerRequest, http: Request, response: Response):
        """Route only: what the request would put in context and whether it fits its budget. No KV is loaded."""
        turn = await governor.begin(http, request, Route.ESTIMATE)
        await Lifetime(http, request_timeout_s(http, request.timeout_s, timeout_s)).run(turn.route(backend))
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
        life = Lifetime(http, request_timeout_s(http, request.timeout_s, timeout_s))
        hit = await life.run(turn.admit(backend, sampling))
        if not request.stream:
            response.headers.update(turn.headers)
            answer = await life.run(turn.generate(backend, sampling, hit, life.remaining_s()))
            return respond(answer_id, answer, started)

        async def events() -> AsyncIterator[str]:
            try:
                async for event in life.stream(turn.stream(backend, sampling, hit, life.remaining_s())):
                    if isinstance(event, str):
                        yield sse(StreamDelta(text=event))
                    else:
                        yield sse(StreamDone(response=respond(answer_id, event, started)))
            except Exception as error:  # noqa: BLE001  after the 200 is sent, any error travels as an event
                status, detail = api_error(error)
                yield sse(StreamError(status_code=status, detail=detail))

        return StreamingResponse(events(), media_type="text/event-stream", headers=turn.headers)

    app.include_router(openai_routes(backend, settings, governor, timeout_s))
    install_limits(app, governor.rejected)  # 413 over 1 MiB, JSON 422 for any input, 503 when a replica dies
    return app


def respond(answer_id: str, answer: Answer, started: float) -> AnswerResponse:
    report = answer.report.with_total_ms((time.perf_counter() - started) * 1e3)
    return AnswerResponse(id=answer_id, answer=answer.text, **report.model_dump())


@serve.ingress()
class Ingress:
    def __init__(self, router: DeploymentHandle, loader: DeploymentHandle, generator: DeploymentHandle,
                 config: IngressConfig):
        self.backend = HandleBackend(router, loader, generator)
        self.config = config
        self.governor = Governor(config.governance, config.settings.store)
        self.readiness = ReadinessProbe(serve.get_replica_context().app_name)

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = make_api(self.backend, self.config.settings, self.governor, self.config.request_timeout_s)
        install_readiness(app, self.readiness, self.governor.rejected)  # GET /readyz; 503 while a deployment is pending
        return app

    def __del__(self) -> None:  # Serve calls it on graceful shutdown: write the buffered request log
        if hasattr(self, "governor"):  # not when __init__ failed before creating it
            self.governor.close()
