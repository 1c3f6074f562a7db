"""The fuzz suite's explicit hostile values, on every POST route of the served OpenAPI document (in-process,
no Ray; the `app` of tests/serve/http/test_fuzz_api.py): numbers and strings JSON cannot carry back (FastAPI's own 422
handler crashed echoing them: a plain-text 500), values of the wrong JSON type (lax validation coerced
them), and hostile values of the headers the server parses.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.serve.http.test_api import QUERY, call, conforms
from tests.serve.http.test_fuzz_api import app  # noqa: F401  (pytest fixture)
from tests.support.store_factory import roles, serving_store  # noqa: F401  (pytest fixtures)

# ---- values JSON cannot echo, and values of the wrong JSON type, on every POST route ------------------
VALID_BODIES = {"/v1/answer": {"query": QUERY, "top_k": 1, "max_new_tokens": 2},
                "/v1/estimate": {"query": QUERY, "top_k": 1},
                "/v1/chat/completions": {"model": "qvpic", "messages": [{"role": "user", "content": QUERY}],
                                         "max_tokens": 2, "qvpic": {"top_k": 1}, "stream_options": {}},
                "/v1/completions": {"model": "qvpic", "prompt": QUERY, "max_tokens": 2, "qvpic": {"top_k": 1}},
                "/v1/embeddings": {"model": "qvpic", "input": QUERY},
                "/v1/responses": {"model": "qvpic", "input": QUERY, "max_output_tokens": 2, "qvpic": {"top_k": 1}},
                "/tokenize": {"model": "qvpic", "prompt": QUERY}, "/detokenize": {"model": "qvpic", "tokens": [1, 2]}}
# The routes that speak OpenAI's error shape (a 400 `OpenAIErrorBody`); the native ones answer FastAPI's 422.
OPENAI_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/tokenize",
                 "/detokenize")
# vLLM's utility routes (serve/http/utility.py) are not governed turns: they read no governance header
UNGOVERNED = ("/tokenize", "/detokenize")
# The free-text field of each route's body: where a lone surrogate or a JSON-only token goes.
TEXT_FIELD = {"/v1/answer": "query", "/v1/estimate": "query", "/v1/chat/completions": "messages",
              "/v1/completions": "prompt", "/v1/embeddings": "input", "/v1/responses": "input", "/tokenize": "prompt",
              "/detokenize": "model"}
# Tokens Python's JSON parser takes but JSON cannot carry back (`1e400` parses to infinity; 5000 digits
# are over Python's int-parsing limit), and strings no UTF-8 encoder takes.
NOT_ECHOABLE = ["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "9" * 5000, '"\\ud800"', '"a\\udfffb"']
# Valid JSON of the wrong type for an integer, number or boolean field: the schema refuses each, so must we.
WRONG_TYPE = {"integer": [True, False, "1", 1.5, [], {}], "number": [True, "0.5", [], {}],
              "boolean": [0, 1, "true", "false", [], {}]}
HOSTILE_KEYS = ["\\ud800", "\\udfff\\ud800"]


def post_routes(spec: dict) -> list[str]:
    return sorted(path for path, ops in spec["paths"].items() if "post" in ops)


def scalar_fields(spec: dict, schema: dict, prefix: tuple = ()) -> dict[tuple, str]:
    """(field path -> JSON type) of every integer, number and boolean field of a request body, nested
    objects included ($refs resolved; `X | null` read as X)."""
    if "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    fields = {}
    for name, prop in schema.get("properties", {}).items():
        choices = [c for c in prop.get("anyOf", [prop]) if c.get("type") != "null"]
        for choice in choices:
            if choice.get("type") in WRONG_TYPE:
                fields[(*prefix, name)] = choice["type"]
            elif "$ref" in choice:
                fields |= scalar_fields(spec, choice, (*prefix, name))
    return fields


def with_field(body: dict, path: tuple, value) -> dict:
    body = json.loads(json.dumps(body))
    node = body
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    return body


def raw_with_token(body: dict, path: tuple, token: str) -> bytes:
    """`body` as JSON text with the raw `token` at `path`: how a client sends what json.dumps would not."""
    return json.dumps(with_field(body, path, "__TOKEN__")).replace('"__TOKEN__"', token).encode()


def refused_in_route_shape(spec: dict, path: str, response) -> None:
    """A 422 (OpenAI's routes: a 400) whose body is strict JSON (no NaN) in the error shape the route documents."""
    status = 400 if path in OPENAI_ROUTES else 422
    assert response.status_code == status, (path, response.status_code, response.text[:300])
    assert response.headers["content-type"] == "application/json"
    body = json.loads(response.content, parse_constant=lambda token: pytest.fail(f"{token} in a response"))
    conforms(spec, "OpenAIErrorBody" if path in OPENAI_ROUTES else "HTTPValidationError", body)


def test_every_post_route_has_a_valid_body_here(app):
    """A new POST route must join the hostile-value tests below."""
    assert post_routes(call(app, "GET", "/openapi.json").json()) == sorted(VALID_BODIES)
    for path, body in VALID_BODIES.items():
        assert call(app, "POST", path, json=body).status_code == 200, path


@pytest.mark.parametrize("path", sorted(VALID_BODIES))
def test_values_json_cannot_carry_are_a_json_422_on_every_route(app, path):
    """NaN, ±Infinity, huge exponents and digit strings in every numeric field, lone surrogates in every
    field and as keys: each a JSON 422 (FastAPI's own handler answered a plain-text 500 echoing them)."""
    spec = call(app, "GET", "/openapi.json").json()
    body = VALID_BODIES[path]
    fields = [*scalar_fields(spec, spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]),
              (TEXT_FIELD[path],)]
    assert {("temperature",), ("seed",), ("top_k",)} & set(fields) or path in ("/v1/estimate", "/v1/embeddings",
                                                                                *UNGOVERNED), fields
    raw = [raw_with_token(body, field, token) for field in fields for token in NOT_ECHOABLE]
    if path == "/v1/chat/completions":
        parts = '[{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]'
        raw += [raw_with_token(body, ("messages",), '[{"role": "user", "content": "\\ud800"}]'),
                raw_with_token(body, ("messages",), parts)]
    elif path in OPENAI_ROUTES:  # prompt and input also take a list of texts
        raw += [raw_with_token(body, (TEXT_FIELD[path],), '["ok", "\\ud800"]')]
    raw += [json.dumps(body).replace("{", f'{{"{key}": 1, ', 1).encode() for key in HOSTILE_KEYS]
    raw += [token.encode() for token in NOT_ECHOABLE]  # as the whole body
    for content in raw:
        response = call(app, "POST", path, content=content, headers={"content-type": "application/json"})
        refused_in_route_shape(spec, path, response)


@pytest.mark.parametrize("path", sorted(set(VALID_BODIES) - set(UNGOVERNED)))
def test_hostile_header_values_are_a_json_4xx_on_every_route(app, path):
    """Headers the server parses (budget, tenant, task type), holding what their parsers choke on."""
    values = {"X-Max-Token-Budget": ["NaN", "Infinity", "-1", "1e400", "9" * 5000, "9" * 19, b"\xb2", b"\xff\xfe",
                                     "1.5"],
              "X-Tenant": [b"\xc3\x28", b"\xed\xa0\x80", "a" * 65, "../x"], "X-Task-Type": [b"\x80", "a b"]}
    for name, hostile in values.items():
        for value in hostile:
            response = call(app, "POST", path, json=VALID_BODIES[path], headers={name: value})
            assert response.status_code == 400, (name, value, response.status_code, response.text[:200])
            assert response.headers["content-type"] == "application/json"
            assert name in json.dumps(response.json()), response.text[:200]


@pytest.mark.parametrize("path", sorted(VALID_BODIES))
def test_numbers_and_booleans_take_only_what_the_schema_allows(app, path):
    """Lax validation took `{"tau": true, "top_k": true}` (booleans coerced to numbers) though the schema
    says number and integer: every value of the wrong JSON type is refused by the schema and the server."""
    spec = call(app, "GET", "/openapi.json").json()
    request_schema = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    validator = jsonschema.Draft202012Validator({**request_schema, "components": spec["components"]})
    fields = scalar_fields(spec, request_schema)
    # embeddings: `dimensions` alone; tokenize and detokenize: none outside their lists
    assert len(fields) >= {"/v1/embeddings": 1, "/tokenize": 0, "/detokenize": 0}.get(path, 2), fields
    for field, json_type in fields.items():
        for value in WRONG_TYPE[json_type]:
            body = with_field(VALID_BODIES[path], field, value)
            assert not validator.is_valid(body), (field, value)
            refused_in_route_shape(spec, path, call(app, "POST", path, json=body))
