"""Hostile requests against the HTTP API, in-process (no Ray): schemathesis fuzzes every operation of the
served OpenAPI document; bodies over the cap are 413; field limits, unknown fields and anything that
looks like a path or URI are refused before any work starts.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import positive_data_acceptance

from serve.app import AppArgs, api_settings, make_api
from serve.backend import InProcessBackend
from serve.limits import DEFAULT_MAX_BODY_NBYTES
from tests.store_factory import MAX_CHUNKS, roles, serving_store  # noqa: F401  (pytest fixtures)
from tests.test_api import QUERY, call

MAX_FUZZED_NEW_TOKENS = 2  # fuzzed bodies ask for up to 4096; decoding them all would take minutes


class ShortDecode(InProcessBackend):
    """The real roles, with each answer cut to a few tokens so hundreds of fuzzed requests stay fast."""

    async def generate(self, plan, loaded, sampling):
        return await super().generate(plan, loaded, short(sampling))

    def stream(self, plan, loaded, sampling):
        return super().stream(plan, loaded, short(sampling))


def short(sampling):
    return dataclasses.replace(sampling, max_new_tokens=min(sampling.max_new_tokens, MAX_FUZZED_NEW_TOKENS))


@pytest.fixture(scope="module")
def app(roles, serving_store):
    args = AppArgs(store={"uri": serving_store.uri}, model=serving_store.model, max_chunks=MAX_CHUNKS, default_top_k=2)
    return make_api(ShortDecode(roles.router, roles.loader, roles.generator), api_settings(args))


@pytest.fixture(scope="module")
def api_schema(app):
    return schemathesis.openapi.from_asgi("/openapi.json", app)


fuzzed = schemathesis.pytest.from_fixture("api_schema")


@fuzzed.parametrize()
@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_fuzzed_requests_are_answered_or_refused_never_crash(case):
    """Valid and invalid bodies, headers and parameters from the spec: no 5xx, every status and body as
    documented, and every schema-invalid request refused. Schema-valid requests may still be refused by
    rules across fields that OpenAPI cannot state (exactly one of chunk_ids, doc_ids or top_k; a chat
    of one user message), so that one check is left out."""
    case.call_and_validate(excluded_checks=[positive_data_acceptance])
