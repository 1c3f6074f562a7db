"""vLLM's utility routes, which health probes and tooling written for vLLM call, and the 404 of a path no route
serves.

    GET  /health      a probe (no key, like /healthz: `auth.open_paths`): 200 while the ingress answers
    GET  /version     qvpic's version, in vLLM's shape
    POST /tokenize    `prompt` or `messages` → `tokens`, `count`, `max_model_len` (the router's tokenizer and
                      chat template: exactly the tokens a chat request's prompt holds, less the store's chunks)
    POST /detokenize  `tokens` → `prompt`

Tokenize and detokenize sit behind the API key as every route but the probes; they are not governed turns
(no rate charge, no request log), as `/v1/models` and `/v1/store` are not: each is bounded (schemas/utility.py)
and costs a tokenizer call. Their errors are OpenAI's shape, as vLLM's are (serve/http/openai/errors.py).
"""

from __future__ import annotations

import importlib.metadata

from fastapi import APIRouter

from schemas.chat import OpenAIErrorBody
from schemas.errors import UnknownModelError
from schemas.service import Health
from schemas.utility import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse, Version
from serve.config import ApiSpec
from serve.http.backend import Backend
from serve.http.parsing import WorkerParsedRoute


def qvpic_version() -> str:
    try:
        return importlib.metadata.version("qvpic")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def utility_routes(backend: Backend, api: ApiSpec, model_ids: list[str]) -> APIRouter:
    routes = APIRouter(tags=["vllm"], route_class=WorkerParsedRoute)
    errors = {status: {"model": OpenAIErrorBody} for status in (400, 401, 404, 413, 503)}

    def require_model(model: str | None) -> None:
        if model is not None and model not in model_ids:
            raise UnknownModelError(f"model {model[:256]!r} is not served here; available: {model_ids}")

    @routes.get("/health")
    async def health() -> Health:
        return Health()

    @routes.get("/version")
    async def version() -> Version:
        return Version(version=qvpic_version())

    @routes.post("/tokenize", responses=errors)
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        require_model(request.model)
        tokenized = await backend.tokenize(request)
        return TokenizeResponse(tokens=tokenized.tokens, count=len(tokenized.tokens),
                                max_model_len=tokenized.max_model_len)

    @routes.post("/detokenize", responses=errors)
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        require_model(request.model)
        return DetokenizeResponse(prompt=await backend.detokenize(request.tokens))

    return routes
