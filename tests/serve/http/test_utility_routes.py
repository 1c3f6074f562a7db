"""vLLM's utility routes (issue 61), the 404 of a path no route serves, and the plain-chat model id that never
retrieves, against the app over the in-process roles.

Expected values come from outside the routes: the version from pyproject.toml, tokens from the checkpoint's
tokenizer called as transformers calls it, the context size from the fixture's router config, a conversation's
token count from the chat route's own `usage`."""

from __future__ import annotations

import pytest
import tomllib

from schemas.conversation import MAX_TEXT_CHARS
from schemas.utility import MAX_DETOKENIZE_TOKENS
from serve.app import api_spec
from serve.config import AppConfig
from serve.http import make_api
from serve.local import InProcessBackend
from tests.serve.http.test_api import call
from tests.serve.http.test_chat_conversations import data_url
from tests.support.paths import REPO
from tests.support.store_factory import MAX_CHUNKS, MAX_CONTEXT_TOKENS, roles, serving_store  # noqa: F401  (fixtures)

NO_CACHE = {"Cache-Control": "no-cache"}
TEXT = "When does part XK-4471-B ship? <|im_start|> stays text"


def app_of(roles, serving_store, **router):
    args = AppConfig(store={"uri": serving_store.uri}, model=serving_store.model,
                     router={"max_chunks": MAX_CHUNKS, **router}, ingress={"default_top_k": 2})
    return make_api(InProcessBackend(roles.router, roles.loader, roles.generator), api_spec(args))


@pytest.fixture(scope="module")
def app(roles, serving_store):
    """The app over the roles' router, configured as it is (its context capped at MAX_CONTEXT_TOKENS)."""
    return app_of(roles, serving_store, max_context_tokens=MAX_CONTEXT_TOKENS)


MESSAGES = [{"role": "system", "content": "Answer in one line."}, {"role": "user", "content": "When does it ship?"}]


def test_health_and_version(app):
    assert call(app, "GET", "/health").status_code == 200
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert call(app, "GET", "/version").json() == {"version": version}


def test_tokenize_a_prompt_as_the_tokenizer_does_and_back(app, roles):
    tokenizer = roles.router.prompt.tokenizer
    response = call(app, "POST", "/tokenize", json={"model": "qvpic", "prompt": TEXT})
    assert response.status_code == 200, response.text
    expected = tokenizer(TEXT, add_special_tokens=False).input_ids
    assert response.json() == {"tokens": expected, "count": len(expected), "max_model_len": MAX_CONTEXT_TOKENS}
    back = call(app, "POST", "/detokenize", json={"model": "qvpic", "tokens": expected})
    assert back.status_code == 200 and back.json() == {"prompt": TEXT}


def test_tokenize_messages_counts_what_plain_chat_prefills(app):
    """`messages` are rendered as a chat request's are: the plain-chat id's prompt is exactly those tokens."""
    tokens = call(app, "POST", "/tokenize", json={"messages": MESSAGES}).json()
    chat = call(app, "POST", "/v1/chat/completions", headers=NO_CACHE, json={
        "model": "qvpic-chat", "messages": MESSAGES, "max_tokens": 2, "temperature": 0}).json()
    assert tokens["count"] == len(tokens["tokens"]) == chat["usage"]["prompt_tokens"]


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "x" * (MAX_TEXT_CHARS + 1)}, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, None),
    ("/tokenize", {}, None),
    ("/tokenize", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url()}}]}]}, "messages[0].content"),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt"),
    ("/detokenize", {"tokens": [1] * (MAX_DETOKENIZE_TOKENS + 1)}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),  # past the vocabulary: the router refuses it by name
    ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
])
def test_inputs_are_bounded_and_refused_by_name(app, path, body, param):
    response = call(app, "POST", path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_an_unknown_model_or_path_is_openais_404(app):
    missing = call(app, "POST", "/tokenize", json={"model": "gpt-9", "prompt": "x"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    for method, path in (("GET", "/v1/nope"), ("POST", "/no/such/route"), ("GET", "/v2/models")):
        response = call(app, method, path)
        assert response.status_code == 404
        assert response.json() == {"error": {"message": f"Invalid URL ({method} {path})",
                                             "type": "invalid_request_error", "param": None, "code": "not_found"}}


def test_models_lists_the_plain_chat_id_with_the_context_size(app, roles, serving_store):
    cards = call(app, "GET", "/v1/models").json()["data"]
    assert [(c["id"], c["max_model_len"]) for c in cards] == [("qvpic", MAX_CONTEXT_TOKENS),
                                                              ("qvpic-chat", MAX_CONTEXT_TOKENS)]
    assert call(app, "GET", "/v1/models/qvpic-chat").json()["id"] == "qvpic-chat"
    # uncapped: the checkpoint's positions, as transformers reads them (the router's PromptTemplate), not 1024
    uncapped = call(app_of(roles, serving_store), "GET", "/v1/models").json()["data"][0]["max_model_len"]
    assert uncapped == roles.router.prompt.max_positions != MAX_CONTEXT_TOKENS


def test_the_plain_chat_id_never_retrieves(app):
    """A chat UI's side call (a title) through `qvpic-chat` gets no store chunks; the default id retrieves."""
    body = {"messages": [{"role": "user", "content": "When does part XK-4471-B ship?"}], "max_tokens": 2,
            "temperature": 0}
    plain = call(app, "POST", "/v1/chat/completions", json={"model": "qvpic-chat", **body}, headers=NO_CACHE).json()
    rag = call(app, "POST", "/v1/chat/completions", json={"model": "qvpic", **body}, headers=NO_CACHE).json()
    assert plain["qvpic"]["chunks"] == [] and len(rag["qvpic"]["chunks"]) == 2  # the fixture's default_top_k
    assert plain["model"] == "qvpic-chat"
    legacy = call(app, "POST", "/v1/completions", headers=NO_CACHE, json={
        "model": "qvpic-chat", "prompt": "When does part XK-4471-B ship?", "max_tokens": 2, "temperature": 0})
    assert legacy.status_code == 200 and legacy.json()["qvpic"][0]["chunks"] == []
    named = call(app, "POST", "/v1/chat/completions", json={"model": "qvpic-chat", **body, "qvpic": {"top_k": 2}})
    assert named.status_code == 400 and named.json()["error"]["param"] == "qvpic"
