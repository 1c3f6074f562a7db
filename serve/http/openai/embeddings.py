"""`/v1/embeddings`: the store's own embedder (the router's), so a user's retriever embeds with exactly the
vectors qvpic retrieves with.

`model` is the served model name or the embedder's (the store's manifest names it; `GET /v1/store`
`embedder`), anything else a 404 `model_not_found`; the response names the embedder. Vectors are float32
and unit length (cosine = dot product), as the ingest stored the chunks'; `encoding_format: "base64"` sends
each as its little-endian float32 bytes, as OpenAI does. `dimensions` other than the embedder's is a 400 (no
truncation of these vectors is meaningful). Each text is read up to the embedder's window, as the ingest
and the router read theirs; `usage.prompt_tokens` counts the tokens read. One governed turn: the key, the
tenant's request rate, the in-flight cap, the request log (route `embeddings`, tokens as `query_tokens`).
"""

from __future__ import annotations

import base64

import numpy as np
from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError

from schemas.chat import OpenAIErrorBody
from schemas.embeddings import Embedding, EmbeddingList, EmbeddingRequest, EmbeddingUsage
from schemas.errors import UnknownModelError
from serve.config import ApiSpec
from serve.http.exchange import Turns
from serve.http.parsing import WorkerParsedRoute


def encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.ascontiguousarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector.astype(np.float32).tolist()


def embedding_routes(turns: Turns, api: ApiSpec) -> APIRouter:
    routes = APIRouter(tags=["openai"], route_class=WorkerParsedRoute)
    embedder, dim = api.store.embedder, api.store.embedding_dim

    @routes.post("/v1/embeddings", response_model=EmbeddingList, responses={
        status: {"model": OpenAIErrorBody} for status in (400, 401, 404, 413, 429, 503)})
    async def embeddings(request: EmbeddingRequest, http: Request, response: Response) -> EmbeddingList:
        if request.model not in (api.served_model_name, embedder):
            available = [api.served_model_name, embedder]
            raise UnknownModelError(f"model {request.model!r} is not served here; available: {available}")
        if request.dimensions is not None and request.dimensions != dim:
            raise RequestValidationError([{
                "type": "value_error", "loc": ("body", "dimensions"), "input": request.dimensions,
                "msg": f"the embedder's vectors have {dim} dimensions; got {request.dimensions}"}])
        texts = request.texts
        embedded = await turns.embed(http, response, texts, request.user)
        data = [Embedding(index=i, embedding=encoded(v, request.encoding_format))
                for i, v in enumerate(embedded.vectors)]
        tokens = embedded.prompt_tokens
        return EmbeddingList(data=data, model=embedder, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))

    return routes
