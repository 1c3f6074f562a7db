"""The OpenAI-compatible surface: `/v1/chat/completions` (plain and streamed), `/v1/models` and OpenAI's error shape.

    chat.py    the chat route: a conversation in OpenAI's message shape → the native request → the governed turn
    errors.py  `{"error": {message, type, param, code}}` with OpenAI's strings; 400 (not 422) for invalid requests
"""

from serve.http.openai.chat import openai_routes
from serve.http.openai.errors import is_openai_path, openai_error, openai_error_body, openai_invalid

__all__ = ["is_openai_path", "openai_error", "openai_error_body", "openai_invalid", "openai_routes"]
