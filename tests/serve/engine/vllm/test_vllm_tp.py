"""qvpic on vLLM under tensor parallelism (issue 58): `engine.tensor_parallel_size: 2` runs vLLM's two ranks as worker
processes of the generator (vLLM's multiprocessing executor; on a CPU each bound to one of its cores), and qvpic's
connector's worker side in each of them: each rank writes its share of the claim's KV heads.

The checkpoint is `tp-qwen`: the oracle's size with two KV heads, so that the two ranks hold different heads (with
one, vLLM replicates it on both and a rank writing the other's share would go unseen). The reference is qvpic's own
forward over the same re-anchored KV (pipeline.runtime: transformers' layers), as for the oracle's 2–3 chunks in
test_vllm_engine.py: one to three linked chunks, and a follow-up turn (vLLM's history pass, its blocks copied on each
rank). Control: the claim's two heads swapped before the ranks take their shares — the agreement goes.

Startup spawns two vLLM workers (~1 min on 2 cores). Runs where vLLM imports (`make test-vllm`); skipped elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from pipeline.eval import oracle  # noqa: E402
from pipeline.runtime import VLM  # noqa: E402
from pipeline.runtime.conversation import PreparedSegment  # noqa: E402
from pipeline.runtime.kv import assemble  # noqa: E402
from schemas.config import EngineConfig, EngineKind, ModelSpec  # noqa: E402
from serve.engine.prepared import LinkedContext, LinkedPrompt  # noqa: E402
from serve.engine.vllm import prompt as prompt_module  # noqa: E402
from serve.engine.vllm.arguments import cpu_binding  # noqa: E402
from serve.engine.vllm.engine import VllmEngine  # noqa: E402
from tests.serve.engine.vllm.conftest import KV_NBYTES  # noqa: E402
from tests.serve.engine.vllm.test_vllm_engine import answer  # noqa: E402

pytestmark = pytest.mark.vllm
MODEL = ModelSpec(path="tp-qwen", device="cpu")
CASES = [(0,), (1, 3), (5, 2, 4)]  # oracle chunks (text), in request order


@pytest.fixture(scope="module")
def vlm() -> VLM:
    vlm = VLM(MODEL)
    assert vlm.model.config.text_config.num_key_value_heads == 2
    return vlm


@pytest.fixture(scope="module")
def engine(vlm):
    shm = Path("/dev/shm")
    before = set(shm.glob("vllm_dist_*"))
    engine = VllmEngine(vlm, EngineConfig(kind=EngineKind.VLLM, tensor_parallel_size=2, max_batch_size=4,
                                          max_kv_nbytes=KV_NBYTES))
    assert engine.engine.vllm_config.parallel_config.tensor_parallel_size == 2
    yield engine
    engine.engine.engine_core.shutdown()
    for left in set(shm.glob("vllm_dist_*")) - before:  # vLLM's all-reduce buffers outlive its shutdown
        left.unlink(missing_ok=True)


def context(vlm: VLM, chunks: tuple[int, ...], before: list[int]) -> LinkedContext:
    kvs = [vlm.compile_text(oracle.CHUNKS[c]) for c in chunks]
    texts = [PreparedSegment(before), PreparedSegment(vlm.query_turn_ids(oracle.QUERIES[0]))]
    return LinkedContext(LinkedPrompt(texts, [kvs], [[f"tp:{c}".encode() for c in chunks]]))


def history(vlm: VLM) -> list[int]:
    """The template prefix, a finished user turn and its answer: what a follow-up's chunks come after."""
    return (list(vlm.adapter.prefix_ids) + vlm.query_turn_ids("Which part is it?")
            + vlm.adapter.encode("The pump, part 7.") + sorted(vlm.adapter.end_of_turn_ids))


def reference(vlm: VLM, linked: LinkedContext) -> list[int]:
    """qvpic's own greedy tokens over the same layout: texts[0] by its forward, the chunks re-anchored after it."""
    prompt = linked.prompt
    assembled = assemble(vlm.text_kv(prompt.before.ids), prompt.groups[0], vlm.rotations)
    out = oracle.greedy(vlm, vlm.prefill_query(assembled, oracle.QUERIES[0]))["output_ids"]
    return [t for t in out if t not in vlm.adapter.end_of_turn_ids]


def test_two_ranks_give_qvpics_own_tokens(engine, vlm):
    for chunks in CASES:
        for before in (list(vlm.adapter.prefix_ids), history(vlm)):  # a first turn, then a follow-up
            linked = context(vlm, chunks, before)
            assert prompt_module.has_history(vlm, before) == (len(before) > len(vlm.adapter.prefix_ids))
            assert answer(engine, linked) == reference(vlm, linked), (chunks, len(before))


def test_control_the_heads_swapped_lose_the_agreement(engine, vlm, monkeypatch):
    real = prompt_module.assemble

    def swapped(prefix, chunks, rotations, out=None):
        made = real(prefix, chunks, rotations, out=out)
        out.copy_(out.flip(2))  # [layers, 2, kv_heads, tokens, head_dim]: each rank is handed the other's head
        return made

    monkeypatch.setattr(prompt_module, "assemble", swapped)
    engine.clear_prefix_cache()
    same = sum(answer(engine, linked) == reference(vlm, linked)
               for linked in (context(vlm, chunks, list(vlm.adapter.prefix_ids)) for chunks in CASES))
    monkeypatch.undo()
    engine.clear_prefix_cache()
    assert same <= len(CASES) // 2, f"{same} of {len(CASES)} still agree with the heads swapped"


def test_cpu_ranks_split_the_replicas_cores(monkeypatch):
    """vLLM's own "auto" binding gives each rank a NUMA node and refuses more ranks than nodes (CI has one)."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3, 5})
    assert cpu_binding(2) == "0,1|2,3" and cpu_binding(1) == "0,1,2,3,5"
    with pytest.raises(ValueError, match="a core a rank"):
        cpu_binding(8)
