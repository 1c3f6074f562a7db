"""The OpenAI-compatible surface: `/v1/chat/completions`, `/v1/responses`, `/v1/completions` (plain and streamed),
`/v1/embeddings`, `/v1/models` and OpenAI's error shape.

    chat.py         the chat route: a conversation in OpenAI's message shape → the native request → the governed turn
    completions.py  legacy completions: each prompt the chat of one user message, answered as chat answers it
    embeddings.py   the store's own embedder, so a user's retriever gets exactly the vectors the router uses
    errors.py       `{"error": {message, type, param, code}}` with OpenAI's strings; 400 (not 422) for invalid requests
    responses.py    the Responses API: a chat turn in OpenAI's Response shape (responses_stream.py: its events), and
                    stored responses per tenant (response_store.py: memory; response_store_redis.py: shared)
"""

from serve.http.openai.chat import openai_routes
from serve.http.openai.completions import completion_routes
from serve.http.openai.embeddings import embedding_routes
from serve.http.openai.errors import is_openai_path, openai_error, openai_error_body, openai_invalid
from serve.http.openai.response_store import MemoryResponseStore, ResponseStore
from serve.http.openai.response_store_redis import RedisResponseStore, response_store
from serve.http.openai.responses import response_routes

__all__ = ["MemoryResponseStore", "RedisResponseStore", "ResponseStore", "completion_routes", "embedding_routes",
           "is_openai_path", "openai_error", "openai_error_body", "openai_invalid", "openai_routes", "response_routes",
           "response_store"]
