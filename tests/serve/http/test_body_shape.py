"""A body's JSON containers (objects and arrays) are bounded and charged before it is parsed (serve/http/body_shape.py):
validation costs per container (~3 µs each, with the GIL held), so past MAX_BODY_CONTAINERS a body is a 400 naming
the limit, and each CONTAINERS_PER_REQUEST beyond a request's own are one more request charged to its tenant's rate
— a tenant's validation time is bounded by its rate. The expected counts come from walking the parsed JSON."""

from __future__ import annotations

import json
import random

import pytest

from serve.governance import key_digest
from serve.http.body_shape import BYTES_PER_REQUEST, CONTAINERS_PER_REQUEST, MAX_BODY_CONTAINERS, body_shape
from tests.serve.governance.test_arrival_charge import asgi
from tests.serve.governance.test_budget import governed_app
from tests.serve.http.test_api import call
from tests.serve.http.test_request_guards import JSON_ROUTES, keyless  # noqa: F401  (a fixture)
from tests.support.store_factory import roles, serving_store  # noqa: F401  (fixtures)

KEY = "key-shape-1"


def containers(value: object) -> int:
    """The objects and arrays of a parsed JSON value: the reference count."""
    if isinstance(value, dict):
        return 1 + sum(containers(v) for v in value.values())
    if isinstance(value, list):
        return 1 + sum(containers(v) for v in value)
    return 0


def random_json(rng: random.Random, depth: int) -> object:
    kind = rng.random()
    if depth == 0 or kind < 0.3:
        return rng.choice([1, 2.5, None, True, "plain", "[{ in a string }]", 'a \\"[" quoted', "}}]]"])
    if kind < 0.65:
        return [random_json(rng, depth - 1) for _ in range(rng.randint(0, 6))]
    return {f"k{i}[": random_json(rng, depth - 1) for i in range(rng.randint(0, 6))}


@pytest.mark.parametrize("seed", range(20))
def test_the_containers_counted_are_the_objects_and_arrays_outside_strings(seed):
    """Against a walk of the parsed value, for bodies whose strings hold brackets. Mutation: counting the raw
    brackets (strings not removed) fails most seeds."""
    value = random_json(random.Random(seed), 7)
    body = json.dumps(value).encode()
    expected = containers(value)
    if expected > CONTAINERS_PER_REQUEST:  # exact wherever a count is charged or refused
        assert body_shape(body).containers == expected
    padded = json.dumps({"pad": [[]] * CONTAINERS_PER_REQUEST, "value": value}).encode()  # over the free count
    assert body_shape(padded).containers == 2 + CONTAINERS_PER_REQUEST + expected


def test_a_body_past_the_container_limit_is_a_400_naming_it_on_every_json_route(keyless):  # noqa: F811
    """At the limit the body reaches its route (whatever the route then says of it); one more is refused."""
    for path in sorted(JSON_ROUTES):
        for extra, refused in ((1, True), (0, False)):
            body = json.dumps({"pad": [[]] * (MAX_BODY_CONTAINERS - 2 + extra)})  # + the object and the array
            response = call(keyless, "POST", path, content=body, headers={"Content-Type": "application/json"})
            named = f"holds {MAX_BODY_CONTAINERS + extra} JSON objects and arrays; the limit is {MAX_BODY_CONTAINERS}"
            assert (response.status_code == 400 and named in response.text) is refused, (path, response.text[:300])


def chat_of(parts_per_message: int, messages: int) -> bytes:
    """A chat request of `messages` user messages of `parts_per_message` text parts: each message is 2 + its parts
    containers, the request 2 more."""
    content = [{"type": "text", "text": "ab"}] * parts_per_message
    return json.dumps({"model": "qvpic-chat", "max_tokens": 1, "messages": [
        {"role": "user", "content": content} for _ in range(messages)]}).encode()


def test_containers_past_a_request_s_share_are_charged_before_the_body_is_parsed(roles, serving_store, monkeypatch):  # noqa: F811
    """A body of 2,050 containers is charged 1 + 2 requests: with a burst of 3 it reaches its route and the next
    request is refused on arrival; with a burst of 2 it is refused (429) after its body is read and before it is
    parsed. Control: a body of 36 containers costs 1, and the next request is admitted. Mutation: `charge_shape`
    not passed to `install_guards` (serve/http/ingress.py) → the next request is admitted."""
    large, small = chat_of(62, 32), chat_of(15, 2)
    assert containers(json.loads(large)) == 2 + 32 * 64 == 2_050 and containers(json.loads(small)) == 36
    parsed: list[int] = []
    loads = json.loads

    def recording(text, *args, **kwargs):
        parsed.append(len(text))
        return loads(text, *args, **kwargs)

    monkeypatch.setattr(json, "loads", recording)

    def limited(burst: int):
        return governed_app(roles, serving_store, auth={"api_key_sha256": {key_digest(KEY): "acme"}},
                            limits={"tenants": {"acme": {"requests_per_s": 0.01, "request_burst": burst}},
                                    "refusal_hold_s": 0},
                            response_cache={"levels": []})[0]

    app = limited(3)
    status, read, _ = asgi(app, "POST", "/v1/chat/completions", large, key=KEY)
    assert status != 429 and read and len(large) in parsed
    assert asgi(app, "POST", "/v1/chat/completions", small, key=KEY)[:2] == (429, False)  # 3 spent

    parsed.clear()
    app = limited(2)
    status, read, headers = asgi(app, "POST", "/v1/chat/completions", large, key=KEY)
    assert (status, read) == (429, True) and int(headers["retry-after"]) > 0
    assert len(large) not in parsed  # refused before it was parsed

    app = limited(2)  # the control: a small body costs one request
    assert asgi(app, "POST", "/v1/chat/completions", small, key=KEY)[0] != 429
    assert asgi(app, "POST", "/v1/chat/completions", small, key=KEY)[0] != 429
    assert asgi(app, "POST", "/v1/chat/completions", small, key=KEY)[:2] == (429, False)


def test_each_mebibyte_past_a_request_s_first_is_charged_before_the_body_is_parsed(roles, serving_store):  # noqa: F811
    """A body of 2.5 MiB (one long text, 4 containers) is charged 1 + 2 requests: with a burst of 3 the next request
    is refused on arrival. Control: with a burst of 4 the next one is admitted. Mutation: bytes left out of
    `extra_requests` → the next request is admitted at a burst of 3."""
    text = "word " * ((5 << 19) // 5)  # 2.5 MiB
    large = json.dumps({"model": "qvpic-chat", "max_tokens": 1, "messages": [{"role": "user", "content": text}]})
    assert 2 * BYTES_PER_REQUEST < len(large) < 3 * BYTES_PER_REQUEST
    small = chat_of(1, 1)
    outcomes = []
    for burst in (3, 4):
        app = governed_app(roles, serving_store, auth={"api_key_sha256": {key_digest(KEY): "acme"}},
                           limits={"tenants": {"acme": {"requests_per_s": 0.01, "request_burst": burst}},
                                   "refusal_hold_s": 0},
                           response_cache={"levels": []})[0]
        status, read, _ = asgi(app, "POST", "/v1/chat/completions", large.encode(), key=KEY)
        assert status != 429 and read  # a 400 (past MAX_TEXT_CHARS), after the charge
        outcomes.append(asgi(app, "POST", "/v1/chat/completions", small, key=KEY)[:2])
    assert outcomes[0] == (429, False) and outcomes[1][0] != 429
