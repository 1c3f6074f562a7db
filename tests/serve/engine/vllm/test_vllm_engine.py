"""qvpic on vLLM (issue 58): vLLM's engine with qvpic's KV connector gives vLLM's own tokens.

The oracle is outside the code under test: tests/data/vllm_oracle.json, vLLM 0.32.0's recorded answers to the
oracle requests (pipeline/eval/oracle.py), each a full prefill vLLM templated, tokenised and preprocessed itself.
- One linked chunk is exact: the chunk was compiled where it sits (after the template prefix), so the connector's
  KV is the KV vLLM computes; vLLM on the connector must give the recorded tokens, text and image chunks alike.
- Full prefill (the online modes) through the same engine gives the recorded tokens too.
- 2–3 linked chunks are the position-independent approximation: each later chunk re-anchored without having
  attended to the ones before it. They must give qvpic's own engine's tokens (the same KV, the same layout).
- A square page (several rows of patches: the positions after it are fewer than its tokens) linked gives vLLM's own
  full prefill's tokens: vLLM's M-RoPE positions after a claimed image are qvpic's layout.
Controls — each breaks what it names and must lose the agreement: the chunk KV written without re-anchoring, one
slot off, and an image chunk whose query positions are counted as text after it.

Runs where vLLM imports (the vLLM venv: `make test-vllm`); skipped elsewhere.
"""

from __future__ import annotations

import json
import threading

import pytest
from PIL import Image, ImageDraw

vllm = pytest.importorskip("vllm")

from pipeline.eval import oracle  # noqa: E402
from pipeline.runtime import VLM  # noqa: E402
from pipeline.runtime.conversation import PreparedSegment  # noqa: E402
from schemas.modes import Mode  # noqa: E402
from schemas.sampling import Sampling  # noqa: E402
from serve.engine.prepared import LinkedContext, LinkedPrompt, OnlineContext  # noqa: E402
from serve.engine.sequence import Finished, Sequence  # noqa: E402
from serve.engine.vllm import connector as connector_module  # noqa: E402
from serve.engine.vllm import prompt as prompt_module  # noqa: E402
from serve.engine.vllm.engine import VllmEngine  # noqa: E402
from tests.support.paths import TESTS  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def recorded() -> dict:
    return json.loads((TESTS / "data" / "vllm_oracle.json").read_text())


@pytest.fixture(scope="module")
def vlm(stacks) -> VLM:
    """The vLLM stack's generator's VLM: oracle-qwen, float32, as the recording's (the same checkpoint)."""
    assert stacks[1].generator.vlm.spec.path == oracle.spec().path
    return stacks[1].generator.vlm


@pytest.fixture(scope="module")
def pages():
    return oracle.pages()


@pytest.fixture(scope="module")
def engine(stacks) -> VllmEngine:
    """The vLLM stack's engine, driven directly (one vLLM engine per test process)."""
    assert isinstance(stacks[1].generator.engine, VllmEngine)
    return stacks[1].generator.engine


@pytest.fixture(scope="module")
def compiled(vlm, pages) -> dict:
    return {}


def chunk_kv(vlm, compiled: dict, pages, mode: Mode, c: int):
    if (mode, c) not in compiled:
        compiled[mode, c] = (vlm.compile_text(oracle.CHUNKS[c]) if mode is Mode.FULL_TEXT
                             else vlm.compile_images(pages[c]))
    return compiled[mode, c]


def linked(vlm, compiled, pages, request: oracle.OracleRequest) -> LinkedContext:
    kvs = [chunk_kv(vlm, compiled, pages, request.mode, c) for c in request.chunks]
    texts = [PreparedSegment(list(vlm.adapter.prefix_ids)), PreparedSegment(vlm.query_turn_ids(request.query))]
    identities = [f"{request.mode.value}:{c}".encode() for c in request.chunks]
    return LinkedContext(LinkedPrompt(texts, [kvs], [identities]))


def online(vlm, pages, request: oracle.OracleRequest) -> OnlineContext:
    texts = [PreparedSegment(list(vlm.adapter.prefix_ids)), PreparedSegment(vlm.query_turn_ids(request.query))]
    return OnlineContext(texts, [oracle.pieces(request, pages)])


def answer(engine: VllmEngine, context, max_new_tokens: int = oracle.NEW_TOKENS, **sampling) -> list[int]:
    """Greedy tokens of one request on `engine`, ended by its turn or its length."""
    done, tokens = threading.Event(), []

    def emit(event):
        if isinstance(event, Finished):
            done.set()
        else:
            tokens.append(event)

    seq = Sequence(Sampling(max_new_tokens=max_new_tokens, **sampling), context, context.num_prompt_tokens,
                   context.num_query_tokens, emit=emit)
    engine.add(seq)
    assert done.wait(300), "the vLLM engine did not answer"
    assert seq.end is not None and seq.end.value in ("stop", "length"), seq.end
    return tokens


def recorded_tokens(recorded: dict, i: int) -> list[int]:
    """vLLM's recorded greedy tokens, without the end-of-turn token it stops at (qvpic never delivers it)."""
    ids = recorded["results"][i]["output_ids"]
    return ids[:-1] if len(ids) < oracle.NEW_TOKENS else ids


def requests_with(chunks: set[int]) -> list[tuple[int, oracle.OracleRequest]]:
    return [(i, r) for i, r in enumerate(oracle.requests()) if len(r.chunks) in chunks]


def test_one_linked_chunk_gives_vllms_recorded_tokens(engine, vlm, compiled, pages, recorded):
    """The claim (template prefix + the chunk) loaded through the connector; vLLM computes the query and decodes."""
    cases = requests_with({1})
    assert len(cases) == 6
    for i, request in cases:
        assert answer(engine, linked(vlm, compiled, pages, request)) == recorded_tokens(recorded, i), request


def test_full_prefill_gives_vllms_recorded_tokens(engine, vlm, pages, recorded):
    for i, request in requests_with({1, 2, 3}):
        assert answer(engine, online(vlm, pages, request)) == recorded_tokens(recorded, i), request


def qvpic_linked_tokens(vlm, compiled, pages, request) -> list[int]:
    kvs = [chunk_kv(vlm, compiled, pages, request.mode, c) for c in request.chunks]
    out = oracle.greedy(vlm, vlm.prefill_query(vlm.assemble(kvs), request.query))["output_ids"]
    return [t for t in out if t not in vlm.adapter.end_of_turn_ids]


def test_several_linked_chunks_give_qvpics_own_tokens(engine, vlm, compiled, pages):
    """The approximation itself is qvpic's: both engines prefill the query over the same re-anchored KV."""
    for _, request in requests_with({2, 3}):
        assert answer(engine, linked(vlm, compiled, pages, request)) == \
            qvpic_linked_tokens(vlm, compiled, pages, request), request


def agreement(engine, vlm, compiled, pages, recorded, cases) -> int:
    return sum(answer(engine, linked(vlm, compiled, pages, r)) == recorded_tokens(recorded, i) for i, r in cases)


@pytest.mark.parametrize("control", ["not re-anchored", "one slot off"])
def test_controls_lose_the_agreement(engine, vlm, compiled, pages, recorded, monkeypatch, control):
    """Each control breaks one thing the exact path needs; the prefix cache is cleared so that every request
    reloads its claim."""
    if control == "not re-anchored":
        cases = [(i, r) for i, r in requests_with({2, 3})]

        def shifted(prefix, chunks, rotations, out=None):  # every chunk at its compile-time positions
            from pipeline.runtime.kv import AssembledContext
            column = prefix.num_tokens
            out[:, :, :, :column] = prefix.kv
            for chunk in chunks:
                out[:, :, :, column:column + chunk.num_tokens] = chunk.kv
                column += chunk.num_tokens
            return AssembledContext([], 0, [])

        monkeypatch.setattr(prompt_module, "assemble", shifted)
        expected = [qvpic_linked_tokens(vlm, compiled, pages, r) for _, r in cases]
    else:
        cases = requests_with({1})
        expected = [recorded_tokens(recorded, i) for i, _ in cases]
        if control == "one slot off":
            real = connector_module.slots_of
            monkeypatch.setattr(connector_module, "slots_of", lambda *a: real(*a) + 1)
    engine.clear_prefix_cache()
    got = [answer(engine, linked(vlm, compiled, pages, r)) for _, r in cases]
    engine.clear_prefix_cache()
    same = sum(g == e for g, e in zip(got, expected))
    assert same <= len(cases) // 2, f"{control}: {same} of {len(cases)} still agree"


def tall_page(text: str) -> Image.Image:
    """A square page: its image spans several rows of merged patches, so the positions after it (t, h, w: the
    largest axis) are fewer than its tokens. The oracle's pages are one row high, where the two coincide."""
    image = Image.new("RGB", (224, 224), "white")
    draw = ImageDraw.Draw(image)
    for row, start in enumerate(range(0, len(text), 24)):
        draw.text((6, 8 + 20 * row), text[start:start + 24], fill="black")
    return image


@pytest.fixture(scope="module")
def tall(vlm) -> list[tuple[OnlineContext, LinkedContext]]:
    """Requests over one square page each: online (vLLM computes it) and linked (the connector supplies it)."""
    out = []
    for c, query in zip((0, 2, 4, 5), oracle.QUERIES):
        page = tall_page(oracle.CHUNKS[c])
        texts = [PreparedSegment(list(vlm.adapter.prefix_ids)), PreparedSegment(vlm.query_turn_ids(query))]
        kv = vlm.compile_images([page])
        assert kv.position_span < kv.num_tokens  # what makes this control able to fail
        linked_context = LinkedContext(LinkedPrompt(texts, [[kv]], [[f"tall{c}".encode()]]))
        out.append((OnlineContext(texts, [[[page]]]), linked_context))
    return out


def test_a_tall_page_linked_gives_vllms_full_prefill_tokens_and_not_as_text(engine, vlm, tall, monkeypatch):
    """vLLM's M-RoPE positions after a claimed image chunk are qvpic's layout (the grid travels with the prompt):
    a square page linked gives the tokens of vLLM's own full prefill of it. Control: the chunk's tokens sent as
    text (no image input), so that vLLM counts the query's positions 1-D through it — the agreement goes."""
    full = [answer(engine, online_context) for online_context, _ in tall]
    assert [answer(engine, linked_context) for _, linked_context in tall] == full
    real_prompt = prompt_module.linked_prompt

    def as_text(vlm_, context, **kwargs):
        made = real_prompt(vlm_, context, **kwargs)
        made.prompt.pop("multi_modal_data")
        made.prompt.pop("multi_modal_uuids")
        pad, tokens = vlm_.adapter.image_token_id, context.chunks[0].vision_tokens
        made.prompt["prompt_token_ids"] = [t for i in made.prompt["prompt_token_ids"]
                                           for t in ([0] * tokens if i == pad else [i])]
        return made

    monkeypatch.setattr(prompt_module, "linked_prompt", as_text)
    engine.clear_prefix_cache()
    same = sum(answer(engine, linked_context) == f for (_, linked_context), f in zip(tall, full))
    engine.clear_prefix_cache()
    assert same <= len(tall) // 2, f"{same} of {len(tall)} still agree with the query counted as text"


def test_a_claim_is_dropped_when_its_request_ends(engine, vlm, compiled, pages):
    _, request = requests_with({1})[0]
    answer(engine, linked(vlm, compiled, pages, request), max_new_tokens=2)
    assert len(connector_module.CLAIMS) == 0


def test_what_only_qvpics_engine_serves_is_a_400_naming_it(engine, vlm, compiled, pages):
    """Chunks in two user turns: the second group would sit after text vLLM computes, which the connector cannot
    supply. Refused before anything is queued, naming the field."""
    _, request = requests_with({1})[0]
    context = linked(vlm, compiled, pages, request)
    prompt = context.prompt
    context.prompt = LinkedPrompt([prompt.texts[0], PreparedSegment([1, 2]), prompt.texts[1]],
                                  [prompt.groups[0], prompt.groups[0]], [prompt.identities[0], prompt.identities[0]])
    seq = Sequence(Sampling(), context, context.num_prompt_tokens, context.num_query_tokens, emit=lambda e: None)
    with pytest.raises(Exception, match="qvpic's engine only") as error:
        engine.add(seq)
    assert getattr(error.value, "param", None) == "history_chunks"


def test_a_request_vllm_refuses_fails_alone_and_the_engine_goes_on(engine, vlm, compiled, pages, monkeypatch,
                                                                   recorded):
    """vLLM's add_request raising (its own validation) ends that request FAILED with the error — no hang, no dead
    engine thread — and drops its claim; the next request is answered."""
    i, request = requests_with({1})[0]
    real = engine.engine.add_request

    def refuse_once(*args, **kwargs):
        monkeypatch.setattr(engine.engine, "add_request", real)
        raise ValueError("vLLM refused it")

    monkeypatch.setattr(engine.engine, "add_request", refuse_once)
    context = linked(vlm, compiled, pages, request)
    done, events = threading.Event(), []
    seq = Sequence(Sampling(max_new_tokens=4), context, context.num_prompt_tokens, context.num_query_tokens,
                   emit=lambda e: (events.append(e), done.set() if isinstance(e, Finished) else None))
    engine.add(seq)
    assert done.wait(60) and seq.end.value == "failed" and "vLLM refused it" in str(events[-1].error)
    assert len(connector_module.CLAIMS) == 0
    assert answer(engine, linked(vlm, compiled, pages, request)) == recorded_tokens(recorded, i)


def test_a_claim_partly_in_vllms_prefix_cache_is_loaded_after_the_shared_blocks(engine, vlm, compiled, pages):
    """Two requests whose claims share their first 3 chunks (past vLLM's first block: 128 tokens on the CPU) and
    differ in the 4th: the second finds that block in vLLM's prefix cache, and the connector must write the rest of
    its claim from there on (vLLM sets a request's computed tokens only after the connector's update_state_after_alloc,
    so the hit is the one get_num_new_matched_tokens was given). Its tokens are qvpic's own."""
    first = oracle.OracleRequest(Mode.FULL_TEXT, (5, 0, 4, 1), oracle.QUERIES[0])
    second = oracle.OracleRequest(Mode.FULL_TEXT, (5, 0, 4, 2), oracle.QUERIES[0])
    block = engine.engine.vllm_config.cache_config.block_size
    shared = len(vlm.adapter.prefix_ids) + sum(chunk_kv(vlm, compiled, pages, Mode.FULL_TEXT, c).num_tokens
                                               for c in (5, 0, 4))
    assert block <= shared < 2 * block  # what makes the second's hit one block, and its claim go on past it
    engine.clear_prefix_cache()
    answer(engine, linked(vlm, compiled, pages, first), max_new_tokens=1)
    assert answer(engine, linked(vlm, compiled, pages, second)) == qvpic_linked_tokens(vlm, compiled, pages, second)
