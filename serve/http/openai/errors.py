"""Errors of the OpenAI-compatible routes, in OpenAI's shape: the official client reads `error.message`, `.param`
and `.code`, and raises `BadRequestError` only for a 400 — so an invalid request is a 400 here (FastAPI's 422
elsewhere), and `param` names the field as a path (`messages[0].content[1].image_url`)."""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

from schemas.chat import OpenAIError, OpenAIErrorBody

_NAMED = re.compile(r"^([a-z_]+(?:\[\d+\])?(?:\.[a-z_]+(?:\[\d+\])?)*): ")
# vLLM's /tokenize and /detokenize answer in OpenAI's shape too, as vLLM's do (serve/http/utility.py)
OPENAI_PATHS = ("/v1/chat/", "/v1/models", "/v1/completions", "/v1/embeddings", "/v1/responses", "/tokenize",
                "/detokenize")
# OpenAI's `type` and `code` strings by HTTP status (its API reference and client's error classes)
ERROR_KINDS: dict[int, tuple[str, str | None]] = {
    400: ("invalid_request_error", "invalid_value"),
    401: ("authentication_error", "invalid_api_key"),
    403: ("permission_error", None),
    404: ("invalid_request_error", "not_found"),
    408: ("timeout_error", "timeout"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    500: ("server_error", "internal_error"),
    503: ("server_error", "service_unavailable"),
    504: ("timeout_error", "timeout"),
}


def is_openai_path(path: str) -> bool:
    return path.startswith(OPENAI_PATHS)


def openai_error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> OpenAIErrorBody:
    kind, default_code = ERROR_KINDS.get(status, ("server_error" if status >= 500 else "invalid_request_error", None))
    return OpenAIErrorBody(error=OpenAIError(message=message, type=kind, param=param, code=code or default_code))


def openai_error(status: int, message: str, headers: dict[str, str] | None = None, param: str | None = None,
                 code: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=openai_error_body(status, message, param, code).model_dump(),
                        headers=headers)


def field_path(loc: tuple) -> str | None:
    """`("body", "messages", 0, "content", "list[…]", 1, "image_url", "image_url")` →
    `messages[0].content[1].image_url`: pydantic's names of union members, and the tag a tagged union adds after
    an item's index, are left out."""
    path, tagged, skip_tag = "", False, False
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            path += f"[{part}]"
            skip_tag, tagged = tagged, False
        elif skip_tag:
            skip_tag = False  # the discriminator's value: not a field
        elif "[" in str(part) or str(part) in ("str", "none", "int", "float", "bool"):
            tagged = "tagged-union" in str(part)  # a union member's name, not a field
        else:
            path += ("." if path else "") + str(part)
    return path or None


def openai_invalid(errors: list[dict], message: str) -> JSONResponse:
    """400 for a request that failed validation, naming the most specific failing field: a union (a message's
    content is a string or a list of parts) fails once per member, and the deepest path is the one that was meant.
    `message` (every field) is used only when no error carries a location."""
    if not errors:
        return openai_error(400, message)
    deepest = max(errors, key=lambda e: len(e["loc"]))
    param = field_path(tuple(deepest["loc"]))
    text = str(deepest["msg"]).removeprefix("Value error, ")
    if deepest["type"] == "extra_forbidden":  # pydantic's "Extra inputs are not permitted" says less than this
        text = "this server does not take this parameter (docs/OPENAI.md lists every parameter and its status)"
    if param is None and (named := _NAMED.match(text)):  # a check across fields names its field first
        param = named.group(1)
    return openai_error(400, f"{param}: {text}" if param and not text.startswith(param) else text, param=param)
