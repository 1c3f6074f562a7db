"""Work a hostile body costs the ingress, kept off its event loop (issue 60 item 5: `/healthz` within 100 ms beside a
tenant looping schema bombs). Counted, not timed: which thread ran the costly step of a request. The app runs in this
test's event loop (httpx's ASGI transport), so the loop's thread is the one that calls `asyncio.run`."""

from __future__ import annotations

import threading

import pytest

import schemas.api
import schemas.decoding
from tests.serve.http.test_api import app, call  # noqa: F401  (a fixture)
from tests.support.store_factory import roles, serving_store  # noqa: F401  (fixtures)

QUESTION = [{"role": "user", "content": "When does part XK-4471-B ship?"}]
# within every limit (so the request is answered), but the grammar is built from 300 subschemas: tens of kB of JSON
SCHEMA = {"anyOf": [{"const": i} for i in range(300)]}
# a tool's schema is shown to the model too: small enough for the test store's 1,024-token context
TOOL = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"i": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["i"]}}}
GRAMMARS = {
    "response_format": {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}},
    "forced tool": {"tools": [TOOL], "tool_choice": "required"}}


@pytest.mark.parametrize("grammar", GRAMMARS)
def test_a_requests_grammar_is_built_on_a_worker_not_the_event_loop(app, monkeypatch, grammar):
    """The grammar text (JSON dumped, parsed and dumped again from the client's schema) was built on the loop: under
    a 3,000-subschema response_format loop, over half the loop's time (py-spy --gil), `/healthz` at seconds. Control:
    `Sampling.of(request)` in place of `await sampling_of(request)` in serve/http/exchange.py → built on the loop."""
    built_on: list[int] = []

    def recording(build):
        def built(*args):
            built_on.append(threading.get_ident())
            return build(*args)
        return built

    for module, name in ((schemas.decoding, "json_grammar"), (schemas.api, "call_grammar")):
        monkeypatch.setattr(module, name, recording(getattr(module, name)))
    body = {"model": "qvpic", "messages": QUESTION, "max_tokens": 4, "temperature": 0, **GRAMMARS[grammar]}
    response = call(app, "POST", "/v1/chat/completions", json=body, headers={"Cache-Control": "no-cache"})
    assert response.status_code == 200, response.text
    assert built_on and threading.get_ident() not in built_on  # the loop's thread built none of them


def test_a_response_format_schema_is_measured_once_per_request(app, monkeypatch):
    """The schema's size (a JSON dump of it) is checked where the client's body is validated, once: the native
    request took a dumped copy of the chat request's decoding fields and validated — dumped — it again, on the loop
    (py-spy --gil under a 3,000-subschema loop: the copy and the second dump, over half the loop's time). Control:
    `request.model_dump(include=set(Decoding.model_fields))` for `decoding_fields(request)` in serve/http/openai/chat.py
    → measured twice."""
    measured: list[int] = []
    check = schemas.decoding.schema_chars_error

    def counting(schema):
        measured.append(len(schema.get("anyOf", ())))
        return check(schema)

    monkeypatch.setattr(schemas.decoding, "schema_chars_error", counting)
    body = {"model": "qvpic", "messages": QUESTION, "max_tokens": 4, "temperature": 0, **GRAMMARS["response_format"]}
    response = call(app, "POST", "/v1/chat/completions", json=body, headers={"Cache-Control": "no-cache"})
    assert response.status_code == 200, response.text
    assert measured == [len(SCHEMA["anyOf"])]
