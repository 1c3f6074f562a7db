"""The response cache keys an answer on every decoding control (serve/governance/response_cache.py
`context_material`): two requests that differ in one of vLLM's sampling extras never share an entry."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from schemas.sampling import Sampling
from serve.governance.response_cache import context_material

PLAN = SimpleNamespace(mode=SimpleNamespace(value="qvpic"), instruction="", query_prompt=None, conversation="",
                       chunks=())
CHANGED = {"top_k": 1, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 2, "stop_token_ids": (7,),
           "ignore_eos": True, "skip_special_tokens": False, "include_stop_str_in_output": True}


@pytest.mark.parametrize("field", CHANGED)
def test_each_extra_changes_the_key(field):
    base = Sampling(max_new_tokens=8)
    assert context_material(PLAN, replace(base, **{field: CHANGED[field]})) != context_material(PLAN, base)
