"""The whole serving path on vLLM's engine (`generator.engine.kind: vllm`): router, loader, tiers and generator as
they are, the forwards vLLM's. The same requests over one store answer as on qvpic's engine — every linked mode
and the online ones, several chunks, n choices, stop strings, logprobs — and what only qvpic's engine serves is
refused by name. The reference is the other engine, whose own exactness tests/serve/engine/test_engine.py and
tests/pipeline/eval/test_vllm_oracle.py hold.

Runs where vLLM imports (`make test-vllm`); skipped elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest

pytest.importorskip("vllm")

from schemas.api import AnswerRequest
from schemas.errors import InvalidRequestError  # noqa: E402
from schemas.extras import StructuredOutputs  # noqa: E402
from schemas.modes import Mode  # noqa: E402
from schemas.sampling import Sampling  # noqa: E402
from serve import build_local  # noqa: E402
from tests.serve.engine.vllm.conftest import MODEL  # noqa: E402

pytestmark = pytest.mark.vllm
QUERY = "When does the part ship?"


def answers(stacks, **fields):
    request = AnswerRequest(query=QUERY, max_new_tokens=8, **fields)
    return [asyncio.run(s.answer(request)) for s in stacks]


@pytest.mark.parametrize("mode", [Mode.QVPIC, Mode.IMAGE_PIC, Mode.TEXT_PIC, Mode.UNIFORM, Mode.FULL_TEXT,
                                  Mode.FULL_IMAGE])
@pytest.mark.parametrize("top_k", [1, 3])
def test_every_mode_answers_as_on_qvpics_engine(stacks, mode, top_k):
    on_qvpic, on_vllm = answers(stacks, top_k=top_k, mode=mode)
    assert on_vllm.text == on_qvpic.text
    assert on_vllm.report.usage.context_tokens == on_qvpic.report.usage.context_tokens
    assert on_vllm.report.usage.query_tokens == on_qvpic.report.usage.query_tokens
    assert on_vllm.report.usage.completion_tokens == on_qvpic.report.usage.completion_tokens


def generated(stacks, sampling: Sampling, top_k: int = 2) -> list:
    """Each stack's answer to one plan under `sampling` (n, stop strings, logprobs: what `Sampling` carries)."""
    request = AnswerRequest(query=QUERY, top_k=top_k, max_new_tokens=8)
    return [asyncio.run(s.generator.generate(asyncio.run(s.router.plan(request)), sampling)) for s in stacks]


def test_stop_strings_and_logprobs_as_on_qvpics_engine(stacks):
    greedy = generated(stacks, Sampling(max_new_tokens=8, logprobs=2))
    assert greedy[1].text == greedy[0].text
    pairs = list(zip(greedy[1].logprobs.content, greedy[0].logprobs.content))
    assert pairs and all(mine.token == theirs.token for mine, theirs in pairs)
    assert max(abs(mine.logprob - theirs.logprob) for mine, theirs in pairs) < 1e-3
    assert [[t.token for t in mine.top_logprobs] for mine, _ in pairs] == \
        [[t.token for t in theirs.top_logprobs] for _, theirs in pairs]
    words = greedy[0].text.split()
    assert len(words) >= 2, greedy[0].text
    stopped = generated(stacks, Sampling(max_new_tokens=8, stop=(words[1],)))
    assert stopped[1].text == stopped[0].text and stopped[1].report.finish_reason == "stop"
    assert words[1] not in stopped[1].text


def test_n_seeded_choices_are_each_reproducible(stacks):
    _, on_vllm = stacks
    sampling = Sampling(max_new_tokens=8, temperature=0.9, seed=11, n=3)
    first, again = generated([on_vllm, on_vllm], sampling)
    texts = [c.text for c in first.every_choice]
    assert len(texts) == 3 and texts == [c.text for c in again.every_choice]
    assert len(set(texts)) > 1  # seeds seed + i: the choices differ


SCHEMA = {"type": "object", "properties": {"part": {"type": "string", "maxLength": 6}, "day": {"enum": [3, 12]}},
          "required": ["part", "day"], "additionalProperties": False}


def test_structured_output_is_valid_json_of_the_schema_on_vllms_engine(stacks):
    """vLLM's guidance backend decodes under the grammar qvpic's engine builds: the answer is JSON of the schema
    whatever the weights. Control: the same request unconstrained is not."""
    _, on_vllm = stacks
    fmt = {"type": "json_schema", "json_schema": {"name": "shipping", "schema": SCHEMA}}
    request = AnswerRequest(query=QUERY, top_k=1, max_new_tokens=48, response_format=fmt)
    answer = asyncio.run(on_vllm.answer(request))
    assert answer.report.finish_reason == "stop", answer.text
    value = json.loads(answer.text)
    assert set(value) == {"part", "day"} and value["day"] in (3, 12) and len(value["part"]) <= 6
    plain = asyncio.run(on_vllm.answer(AnswerRequest(query=QUERY, top_k=1, max_new_tokens=48)))
    with pytest.raises(ValueError):
        json.loads(plain.text)


def test_a_grammar_that_does_not_compile_is_a_400_naming_the_field(stacks):
    _, on_vllm = stacks
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "object", "properties": {
        "a": {"$ref": "#/definitions/missing"}}}}}
    with pytest.raises(InvalidRequestError) as error:
        asyncio.run(on_vllm.answer(AnswerRequest(query=QUERY, top_k=1, max_new_tokens=8, response_format=bad)))
    assert error.value.param == "response_format"


def test_recompute_on_vllms_engine_is_refused_at_start_up(store_uri):
    with pytest.raises(ValueError, match="recompute"):
        build_local({"store": store_uri, "model": MODEL.model_dump(),
                     "generator": {"engine": {"kind": "vllm"}, "recompute": {"kind": "leading"}}})


def test_cached_tokens_are_the_claim_on_a_cold_cache(stacks):
    """usage.cached_tokens counts what was not computed: on a cold prefix cache, the connector's whole claim (the
    template prefix and the chunks), none of it from vLLM's prefix cache (vLLM reports the two as one count)."""
    _, on_vllm = stacks
    on_vllm.generator.clear_prefix_cache()
    usage = asyncio.run(on_vllm.answer(AnswerRequest(query=QUERY, top_k=2, max_new_tokens=2))).report.usage
    assert usage.prefix_cached_tokens == 0
    assert usage.cached_tokens == usage.context_tokens > 0


def test_vllms_sampling_extras_as_on_qvpics_engine(stacks):
    """Each extra mapped onto vLLM's SamplingParams answers as qvpic's sampler does: greedy under a repetition
    penalty (no chunks: qvpic's engine counts a prompt's text tokens only), top_k 1 and min_p 1 at temperature 1.5
    (both greedy), min_tokens holding a forced end of turn back, ignore_eos past it, a stop token id, and
    structured_outputs' regex."""
    vlm = stacks[0].generator.vlm
    end = min(vlm.adapter.end_of_turn_ids)
    other = vlm.tokenizer.encode(" zebra", add_special_tokens=False)[0]
    cases = [(Sampling(max_new_tokens=8, repetition_penalty=1.8), 0, None),
             (Sampling(max_new_tokens=8, temperature=1.5, seed=3, top_k=1), 2, None),
             (Sampling(max_new_tokens=8, temperature=1.5, seed=3, min_p=1.0), 2, None),
             (Sampling(max_new_tokens=6, min_tokens=3, logit_bias=((end, 100.0),)), 2, (3, "stop")),
             (Sampling(max_new_tokens=5, ignore_eos=True, logit_bias=((end, 100.0),)), 2, (5, "length")),
             (Sampling(max_new_tokens=5, stop_token_ids=(other,), logit_bias=((other, 100.0),)), 2, (0, "stop")),
             (Sampling(max_new_tokens=16, grammar=StructuredOutputs(regex="[0-9]{3}-x").lark), 2, None)]
    greedy = generated(stacks, Sampling(max_new_tokens=8), top_k=2)[0].text
    for sampling, top_k, expected in cases:
        on_qvpic, on_vllm = generated(stacks, sampling, top_k=top_k)
        assert on_vllm.text == on_qvpic.text, sampling
        # a completed grammar: vLLM's guidance backend ends on the tokenizer's eos (<|endoftext|>), not delivered
        assert on_vllm.report.usage.completion_tokens == on_qvpic.report.usage.completion_tokens, sampling
        if expected is not None:
            assert (on_vllm.report.usage.completion_tokens, on_vllm.report.finish_reason) == expected, sampling
    assert generated(stacks, cases[1][0], top_k=2)[1].text == greedy
    assert re.fullmatch("[0-9]{3}-x", generated(stacks, cases[-1][0], top_k=2)[1].text)
