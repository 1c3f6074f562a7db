"""A conversation's follow-up turn on vLLM's engine: vLLM computes the earlier turns (the history pass), the
connector supplies the chunks after them, vLLM computes the question and decodes (serve/engine/vllm/engine.py).

The reference is qvpic's own engine over the same store and plan (its exactness: tests/serve/engine/test_engine.py):
the same history, chunks re-anchored at the same columns, so the same greedy tokens. Controls — each breaks one
thing the path needs and must lose that agreement: the history's partial last block not copied into the follow-up's
(its earlier turns' KV missing), and the chunks re-anchored as if the history were one token long. The held blocks
are handed back to vLLM once the answer ends (control: the claims never release them).

Runs where vLLM imports (`make test-vllm`); skipped elsewhere.
"""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("vllm")

from pipeline.runtime import VLM  # noqa: E402
from schemas.api import AnswerRequest
from serve.engine.vllm import claims as claims_module  # noqa: E402
from serve.engine.vllm import connector as connector_module  # noqa: E402
from serve.engine.vllm import prompt as prompt_module  # noqa: E402
from serve.engine.vllm.engine import VllmEngine  # noqa: E402

pytestmark = pytest.mark.vllm
OPENINGS = [("Which part is it?", "The pump, part 7."), ("Who makes the valve?", "Acme, since 2019."),
            ("Is the order late?", "No, it ships on day 3.")]
QUESTION = "When does the part ship?"


def conversation(opening: tuple[str, str]) -> list[dict]:
    return [{"role": "user", "content": opening[0]}, {"role": "assistant", "content": opening[1]},
            {"role": "user", "content": QUESTION}]


def follow_ups(stack, max_new_tokens: int = 8) -> list:
    """Each opening's follow-up turn on `stack`, from a cold prefix cache (nothing reused but what the turn made)."""
    out = []
    for opening in OPENINGS:
        stack.generator.clear_prefix_cache()
        request = AnswerRequest(query=QUESTION, messages=conversation(opening), top_k=2, max_new_tokens=max_new_tokens)
        out.append(asyncio.run(stack.answer(request)))
    return out


@pytest.fixture(scope="module")
def on_qvpic(stacks) -> list:
    return follow_ups(stacks[0])


def count_passes(monkeypatch) -> list[str]:
    """The history passes' vLLM ids, as the engine ends each one."""
    passes, real = [], VllmEngine._history_done
    monkeypatch.setattr(VllmEngine, "_history_done", lambda self, rid, out: passes.append(rid) or real(self, rid, out))
    return passes


def engine_of(stack) -> VllmEngine:
    assert isinstance(stack.generator.engine, VllmEngine)
    return stack.generator.engine


def test_a_follow_up_answers_as_on_qvpics_engine_with_its_history_computed_by_vllm(stacks, on_qvpic, monkeypatch):
    _, on_vllm = stacks
    vlm = on_vllm.generator.vlm
    computed, real_text_kv = [], VLM.text_kv
    monkeypatch.setattr(VLM, "text_kv", lambda self, ids: computed.append(len(ids)) or real_text_kv(self, ids))
    passes = count_passes(monkeypatch)
    got = follow_ups(on_vllm)
    assert [a.text for a in got] == [a.text for a in on_qvpic]
    assert len(passes) == len(OPENINGS)  # one history pass a turn
    assert all(n <= len(vlm.adapter.prefix_ids) for n in computed)  # qvpic's own forward ran no history
    # cold caches: what was not computed is the chunks alone on both engines (the history was, by either)
    assert [a.report.usage.cached_tokens for a in got] == [a.report.usage.cached_tokens for a in on_qvpic]
    assert all(a.report.usage.prefix_cached_tokens == 0 for a in got)


def test_a_first_turn_takes_no_history_pass(stacks, monkeypatch):
    """The template prefix and instruction repeat across requests: qvpic keeps their KV, vLLM runs one prefill."""
    _, on_vllm = stacks
    passes = count_passes(monkeypatch)
    asyncio.run(on_vllm.answer(AnswerRequest(query=QUESTION, top_k=2, max_new_tokens=2)))
    assert passes == []


@pytest.mark.parametrize("control", ["last history block not copied", "chunks placed after one token"])
def test_controls_lose_the_agreement(stacks, on_qvpic, monkeypatch, control):
    _, on_vllm = stacks
    if control == "last history block not copied":
        monkeypatch.setattr(connector_module.QvpicConnector, "_copies", lambda self, claim, blocks, start: None)
    else:
        real = prompt_module.ChunkKV
        monkeypatch.setattr(prompt_module, "ChunkKV", lambda kv, position_span, **k: real(kv, position_span=1, **k))
    got = follow_ups(on_vllm)
    monkeypatch.undo()
    on_vllm.generator.clear_prefix_cache()  # nothing the control computed is found again
    same = sum(a.text == b.text for a, b in zip(got, on_qvpic))
    assert same <= len(OPENINGS) // 2, f"{control}: {same} of {len(OPENINGS)} still agree"


def free_blocks(stack) -> int:
    return engine_of(stack).engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def settled(stack, timeout_s: float = 10.0) -> int:
    """The free blocks once the engine's thread has handed back what it can."""
    deadline = time.monotonic() + timeout_s
    while claims_module.CLAIMS.releasable and time.monotonic() < deadline:
        time.sleep(0.02)
    return free_blocks(stack)


def test_the_history_blocks_are_handed_back_once_the_answer_ends(stacks, monkeypatch):
    _, on_vllm = stacks
    on_vllm.generator.clear_prefix_cache()
    idle = settled(on_vllm)
    follow_ups(on_vllm)
    assert settled(on_vllm) == idle and not claims_module.CLAIMS.holding
    # control: claims that never release their history pass keep its blocks out of vLLM's pool
    monkeypatch.setattr(claims_module.Claims, "released", lambda self: set())
    request = AnswerRequest(query=QUESTION, messages=conversation(OPENINGS[0]), top_k=2, max_new_tokens=2)
    asyncio.run(on_vllm.answer(request))
    assert settled(on_vllm, timeout_s=0.5) < idle
    monkeypatch.undo()
    assert settled(on_vllm) == idle
