"""The prefix KV cache around linked chunks (serve/engine/qvpic/prefix_cache.py, linked_prompt.py) in the engine.

Each claim is checked on the engine's own counts (prompt columns served from the cache) and against the answer
with the cache off (greedy tokens identical, logits within 1e-4 in float32):
- an identical request runs no forward for its prompt (the cache kept its last column's logits; with
  `final_logits` off it prefills one token, as vLLM's does); its answer equals the uncached one; a prompt that
  differs only in its last token, or whose blocks were evicted, does not take those logits;
- a follow-up turn (the earlier prompt, the decoded answer and a new question) finds the earlier turn's whole
  stream, the decoded tokens and the partial block it ended in included; one whose history says something else
  after the earlier prompt (a client's own text for the answer) finds that prompt whole, its last partial block too;
- a shared system prompt (the text before the chunks) is computed once, then found, even with other chunks;
- a changed earlier token, another chunk set or another tenant's salt misses from where they differ;
- bytes stay within the device bound, evicted blocks move to the host tier, and a hit brings them back.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from pipeline.runtime.conversation import PreparedSegment
from schemas.config import EngineConfig, PrefixCacheSpec
from schemas.sampling import Sampling
from serve.engine.prepared import LinkedContext, LinkedPrompt
from serve.engine.qvpic.engine import QvpicEngine
from serve.engine.qvpic.linked_prompt import native_prompt
from serve.engine.qvpic.prefix_cache import PrefixCache, StreamKeys, block_hashes
from serve.engine.sequence import Sequence

TOLERANCE = 1e-4
TENANT_A, TENANT_B = b"salt-of-tenant-a", b"salt-of-tenant-b"


def page(text: str, size=(280, 112)) -> Image.Image:
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).text((6, 6), text, fill="black")
    return image


@pytest.fixture(scope="module")
def chunks(vlm):
    return [vlm.compile_images([page("Invoice 4471 ships on 12 March")]),
            vlm.compile_text("The warranty covers two years of normal use."),
            vlm.compile_text("Part QZ-19 ships on 3 April.")]


class Driver:
    """An engine stepped in this thread; what each request saw."""

    def __init__(self, vlm, cache_nbytes: int = 1 << 30, host_nbytes: int = 1 << 30, block_tokens: int = 16,
                 final_logits: bool = True):
        spec = EngineConfig(prefix_cache=PrefixCacheSpec(block_tokens=block_tokens, device_nbytes=cache_nbytes,
                                                       host_nbytes=host_nbytes, final_logits=final_logits))
        self.logits: dict[int, list[torch.Tensor]] = {}
        self.engine = QvpicEngine(vlm, spec, start=False,
                                  on_logits=lambda s, row: self.logits[s.id].append(row.clone()))

    def run(self, prompt: LinkedPrompt, salt: bytes = TENANT_A, max_new_tokens: int = 6) -> Sequence:
        seq = Sequence(Sampling(max_new_tokens=max_new_tokens), LinkedContext(prompt, salt), prompt.num_tokens,
                       prompt.after.num_tokens, emit=lambda e: None)
        self.logits[seq.id] = []
        self.engine.add(seq)
        while self.engine.scheduler.busy:
            self.engine.step()
        return seq


def same_answer(driver_a: Driver, a: Sequence, driver_b: Driver, b: Sequence) -> None:
    assert a.token_ids == b.token_ids
    for x, y in zip(driver_a.logits[a.id], driver_b.logits[b.id]):
        assert (x - y).abs().max().item() < TOLERANCE


@pytest.fixture
def forwards(monkeypatch):
    """How many batched forwards (query prefills and decode steps) the engine ran."""
    from serve.engine.qvpic import batch

    calls, real = [], batch.forward
    monkeypatch.setattr(batch, "forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def counted(forwards: list, run) -> tuple[Sequence, int]:
    before = len(forwards)
    seq = run()
    return seq, len(forwards) - before


def test_an_identical_request_runs_no_prompt_forward_and_answers_the_same(vlm, chunks, forwards):
    cold, warm = Driver(vlm, cache_nbytes=0), Driver(vlm)
    prompt = native_prompt(vlm, chunks, "When does invoice 4471 ship?")
    reference = cold.run(prompt)
    (first, first_forwards), (second, second_forwards) = (counted(forwards, lambda: warm.run(prompt)) for _ in "ab")
    assert reference.prefix_cached_tokens == 0 and first.prefix_cached_tokens == 0
    assert second.prefix_cached_tokens == prompt.num_tokens  # every column, and the logits after the last
    assert warm.engine.prefix_cache.stats.logits_hits == 1
    assert len(first.token_ids) == len(second.token_ids) > 1
    assert second_forwards == first_forwards - 1  # the decode steps only: no prefill forward
    same_answer(cold, reference, warm, first)
    same_answer(cold, reference, warm, second)


def test_without_final_logits_an_identical_request_prefills_one_token(vlm, chunks, forwards):
    warm = Driver(vlm, final_logits=False)
    prompt = native_prompt(vlm, chunks, "When does invoice 4471 ship?")
    (first, first_forwards), (second, second_forwards) = (counted(forwards, lambda: warm.run(prompt)) for _ in "ab")
    assert second.prefix_cached_tokens == prompt.num_tokens - 1  # every column but the one whose logits it needs
    assert second_forwards == first_forwards and warm.engine.prefix_cache.stats.logits_hits == 0
    same_answer(warm, first, warm, second)


def test_a_prompt_differing_only_in_its_last_token_does_not_take_the_cached_logits(vlm, chunks):
    cold, warm = Driver(vlm, cache_nbytes=0), Driver(vlm)
    prompt = native_prompt(vlm, chunks, "When does invoice 4471 ship?")
    warm.run(prompt)
    last = prompt.after.ids[-1]
    other = LinkedPrompt.single(prompt.before, prompt.chunks, prompt.identities[0],
                                PreparedSegment(prompt.after.ids[:-1] + [(last + 1) % vlm.tokenizer.vocab_size]))
    seq = warm.run(other)
    block = warm.engine.prefix_cache.block_tokens
    assert other.num_tokens % block  # the last token sits in a partial block, whose key it changes:
    assert seq.prefix_cached_tokens == (other.num_tokens // block) * block  # the full blocks are found, not it
    assert warm.engine.prefix_cache.stats.logits_hits == 0
    same_answer(cold, cold.run(other), warm, seq)


def test_cached_logits_whose_blocks_were_evicted_are_not_used(vlm, chunks):
    """The logits entry is the newest, so the LRU drops a prompt's first blocks before it: they are found, the
    blocks are not, and the prompt is prefilled as if nothing were cached."""
    prompt = native_prompt(vlm, chunks, "When does invoice 4471 ship?")
    probe = Driver(vlm)
    probe.run(prompt)
    block_nbytes = probe.engine.prefix_cache.stats.device_nbytes // len(probe.engine.prefix_cache)  # roughly
    cold, small = Driver(vlm, cache_nbytes=0), Driver(vlm, cache_nbytes=4 * block_nbytes, host_nbytes=0)
    small.run(prompt)
    seq = small.run(prompt)
    assert small.engine.prefix_cache.stats.logits_hits == 1  # found...
    # ...but the first full block is gone: at most a text before the chunks shorter than a block (its own partial
    # entry) is used, and the rest is prefilled
    assert seq.prefix_cached_tokens <= (prompt.before.num_tokens if prompt.before.num_tokens < 16 else 0)
    same_answer(cold, cold.run(prompt), small, seq)


def test_cached_logits_are_not_used_when_only_the_prompts_last_partial_block_is_gone(vlm, chunks):
    """Every full block found, the prompt's last partial block evicted alone (another prompt sharing the rest kept
    those recent): the logits after it must not be used on a base that lacks those columns."""
    prompt = native_prompt(vlm, chunks, "When does invoice 4471 ship?")
    cold, warm = Driver(vlm, cache_nbytes=0), Driver(vlm)
    warm.run(prompt, max_new_tokens=1)  # no decoded token fed back: the newest partial block ends the prompt
    cache = warm.engine.prefix_cache
    block = cache.block_tokens
    partials = [key for key, entry in cache._device.items() if 0 < len(entry.next_positions) < block]
    del cache._device[partials[-1]]  # the newest partial block: the one at the prompt's end
    seq = warm.run(prompt)
    assert cache.stats.logits_hits == 1 and seq.prefix_cached_tokens == (prompt.num_tokens // block) * block
    same_answer(cold, cold.run(prompt), warm, seq)


def test_a_follow_up_turn_finds_the_earlier_turn_and_its_decoded_tokens(vlm, chunks):
    cold, warm = Driver(vlm, cache_nbytes=0), Driver(vlm)
    first_prompt = native_prompt(vlm, chunks, "When does invoice 4471 ship?")
    block = warm.engine.prefix_cache.block_tokens
    # 11 or 12 decoded tokens fed back, so that the earlier stream ends inside a block
    first = warm.run(first_prompt, max_new_tokens=12 if (first_prompt.num_tokens + 11) % block else 13)
    # The next turn, as the template renders it: the earlier turn's stream, its answer, then a new question.
    follow_up_ids = (first_prompt.after.ids + first.token_ids + vlm.adapter.encode("<|im_end|>\n")
                     + vlm.adapter.encode(" And the warranty?") + vlm.adapter.turn_suffix_ids)
    follow_up = LinkedPrompt.single(first_prompt.before, first_prompt.chunks, first_prompt.identities[0],
                             PreparedSegment(follow_up_ids))
    second = warm.run(follow_up)
    earlier_columns = first_prompt.num_tokens + len(first.token_ids) - 1  # the last token was never fed back
    assert earlier_columns % block  # it ends inside a block: that block is found too
    assert second.prefix_cached_tokens == earlier_columns  # every column the earlier turn wrote, decoded ones too
    same_answer(cold, cold.run(follow_up), warm, second)


def test_a_follow_up_whose_history_differs_after_the_earlier_prompt_finds_that_prompt_whole(vlm, chunks):
    """The client sends its own text as the earlier answer (a one-token probe, an edited reply): the follow-up's
    stream leaves the earlier one right where that prompt ended, inside a block — a column no text of the
    follow-up ends at — and still finds every column of it."""
    cold, warm = Driver(vlm, cache_nbytes=0), Driver(vlm)
    first_prompt = native_prompt(vlm, chunks, "When does invoice 4471 ship?")
    warm.run(first_prompt, max_new_tokens=1)
    follow_up_ids = (first_prompt.after.ids + vlm.adapter.encode("Noted.<|im_end|>\n")
                     + vlm.adapter.encode(" And the warranty?") + vlm.adapter.turn_suffix_ids)
    follow_up = LinkedPrompt.single(first_prompt.before, first_prompt.chunks, first_prompt.identities[0],
                                    PreparedSegment(follow_up_ids))
    block = warm.engine.prefix_cache.block_tokens
    assert first_prompt.num_tokens % block and first_prompt.num_tokens not in follow_up.starts()
    second = warm.run(follow_up)
    assert second.prefix_cached_tokens == first_prompt.num_tokens
    same_answer(cold, cold.run(follow_up), warm, second)


def test_a_shared_system_prompt_is_computed_once_then_found_beside_other_chunks(vlm, chunks):
    warm = Driver(vlm)
    instruction = "You answer in one short sentence, citing the document you used."
    warm.run(native_prompt(vlm, chunks[:2], "When does invoice 4471 ship?", instruction))
    other = native_prompt(vlm, chunks[2:], "Which part ships in April?", instruction)
    seq = warm.run(other)
    assert seq.prefix_cached_tokens == other.before.num_tokens  # the whole text before the chunks, partial block too
    fresh = Driver(vlm).run(other)
    assert fresh.prefix_cached_tokens == 0


def test_a_changed_earlier_token_another_chunk_set_or_another_tenant_misses(vlm, chunks):
    warm = Driver(vlm)
    prompt = native_prompt(vlm, chunks, "When does invoice 4471 ship?")
    warm.run(prompt)
    assert warm.run(prompt, salt=TENANT_B).prefix_cached_tokens == 0  # the attacker's first block already differs
    assert warm.engine.prefix_cache.stats.logits_hits == 0  # nor are tenant A's logits after that prompt found
    reordered = native_prompt(vlm, [chunks[1], chunks[0], chunks[2]], "When does invoice 4471 ship?")
    seq = warm.run(reordered)
    assert 0 < seq.prefix_cached_tokens <= prompt.before.num_tokens  # only the text before the chunks
    changed_ids = list(prompt.before.ids)
    changed_ids[2] = (changed_ids[2] + 1) % vlm.tokenizer.vocab_size
    changed = LinkedPrompt.single(PreparedSegment(changed_ids), prompt.chunks, prompt.identities[0], prompt.after)
    assert warm.run(changed).prefix_cached_tokens == 0  # the change is in the first block: nothing after it matches


def test_a_chunk_of_the_same_size_in_the_same_place_is_not_taken_for_another(vlm):
    """Only the chunk's identity tells these apart: same token count, same span, same position."""
    one, other = vlm.compile_text("Part QZ-19 ships on 3 April."), vlm.compile_text("Part QZ-20 ships on 4 April.")
    assert (one.num_tokens, one.position_span) == (other.num_tokens, other.position_span)
    cold, warm = Driver(vlm, cache_nbytes=0), Driver(vlm)
    warm.run(native_prompt(vlm, [one], "Which part ships in April?"))
    prompt = native_prompt(vlm, [other], "Which part ships in April?")
    seq = warm.run(prompt)
    assert seq.prefix_cached_tokens <= prompt.before.num_tokens
    same_answer(cold, cold.run(prompt), warm, seq)


def test_block_hashes_chain_every_token_chunk_and_salt_before_them():
    def stream(ids, chunk: bytes) -> StreamKeys:
        keys = StreamKeys()
        keys.add_tokens(ids[:20], np.arange(20))
        keys.add_item(chunk, 30, 50)
        keys.add_tokens(ids[20:], np.arange(50, 50 + len(ids) - 20))
        return keys

    ids = list(range(100, 160))
    base = block_hashes(b"t", stream(ids, b"chunk-a"), 16)
    assert len(base) == (20 + 30 + 40) // 16  # full blocks only: 5
    other_chunk = block_hashes(b"t", stream(ids, b"chunk-b"), 16)
    assert other_chunk[0] == base[0] and all(x != y for x, y in zip(other_chunk[1:], base[1:]))  # from its block on
    other_salt = block_hashes(b"u", stream(ids, b"chunk-a"), 16)
    assert all(x != y for x, y in zip(other_salt, base))
    changed = list(ids)
    changed[55] += 1  # column 20 + 30 + 35 = 85: block 5, past the full blocks; 45 -> column 75: block 4
    changed[45] += 1
    edited = block_hashes(b"t", stream(changed, b"chunk-a"), 16)
    assert edited[:4] == base[:4] and edited[4] != base[4]


def test_bytes_stay_bounded_and_evicted_blocks_come_back_from_the_host_tier():
    block_nbytes = 2 * 2 * 1 * 4 * 8 * 4  # [layers 2, 2, heads 1, 4 tokens, head_dim 8] float32
    cache = PrefixCache(block_tokens=4, device_nbytes=3 * block_nbytes, host_nbytes=2 * block_nbytes,
                        device=torch.device("cpu"))
    hashes = [bytes([i]) * 32 for i in range(8)]
    kv = torch.arange(2 * 2 * 1 * 32 * 8, dtype=torch.float32).view(2, 2, 1, 32, 8)
    cache.insert(hashes, kv, np.arange(1, 33))
    assert cache.stats.device_nbytes <= 3 * block_nbytes and cache.stats.host_nbytes <= 2 * block_nbytes
    assert len(cache) == 5 and cache.stats.evicted_blocks == 3 and cache.stats.demoted_blocks == 5
    assert cache.match(hashes) == []  # block 0 was dropped: nothing after it can be used
    found = cache.match(hashes[3:5])  # on the host tier: promoted back, values intact
    assert len(found) == 2 and torch.equal(found[1].kv, kv[:, :, :, 16:20])
    assert cache.stats.device_nbytes <= 3 * block_nbytes


def two_group_prompt(vlm, chunks, first_answer: list[int]) -> LinkedPrompt:
    """Turn 2 as the conversation layout renders it: `[system][turn 1's chunks][turn 1's question, its answer,
    the next user header][turn 2's chunks][turn 2's question]` — two groups, a text run between them."""
    first = native_prompt(vlm, chunks[:2], "When does invoice 4471 ship?")
    between = (first.after.ids + first_answer + vlm.adapter.encode("<|im_end|>\n<|im_start|>user\n"))
    return LinkedPrompt([first.before, PreparedSegment(between), PreparedSegment(vlm.query_turn_ids("And QZ-19?"))],
                        [first.chunks, [chunks[2]]], [first.identities[0], [b"qz-19"]])


def sequential_logits(vlm, prompt: LinkedPrompt) -> torch.Tensor:
    """The reference: transformers' own forward over a DynamicCache, one part after another (each text run
    forwarded, each group re-anchored after it by `assemble`), the first answer token's logits `[vocab]`."""
    from transformers import DynamicCache

    from pipeline.runtime.kv import ChunkKV, assemble
    from schemas.modes import ChunkKind

    cache, position, kv = DynamicCache(), 0, None
    for i, text in enumerate(prompt.texts):
        state = vlm._forward(torch.tensor([text.ids]), cache, position)
        cache, position = state.cache, state.next_position
        if i == len(prompt.groups):
            return state.logits[0, -1]
        kv = torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers])
        context = assemble(ChunkKV(kv, position, 0, ChunkKind.TEXT), prompt.groups[i], vlm.rotations)
        cache = DynamicCache(ddp_cache_data=[(k, v) for k, v in context.layers])
        position = context.next_position


def test_text_between_groups_is_computed_in_the_query_forward_and_equals_the_sequential_reference(vlm, chunks,
                                                                                                  monkeypatch):
    """A follow-up's text between its cached run and its new chunks is a hole in the row, forwarded with the
    question in one pass: transformers' own forward is never called (it was, once per text run), and the first
    token's logits equal the reference of forwarding each part in turn — cold (every text a hole) and warm (the
    earlier turn from the prefix cache)."""
    warm, cold = Driver(vlm), Driver(vlm, cache_nbytes=0)
    first = warm.run(native_prompt(vlm, chunks[:2], "When does invoice 4471 ship?"), max_new_tokens=4)
    prompt = two_group_prompt(vlm, chunks, first.token_ids)
    reference = sequential_logits(vlm, prompt)
    calls = []
    monkeypatch.setattr(vlm, "_forward", lambda *a, **k: calls.append(a) or pytest.fail("a separate forward ran"))
    seqs = {"cold": cold.run(prompt, max_new_tokens=1), "warm": warm.run(prompt, max_new_tokens=1)}
    assert not calls
    assert seqs["cold"].prefix_cached_tokens == 0
    assert seqs["warm"].prefix_cached_tokens >= prompt.starts()[2]  # turn 1's system and chunks at least
    for name, driver in (("cold", cold), ("warm", warm)):
        logits = driver.logits[seqs[name].id][0]
        assert (logits - reference).abs().max().item() < TOLERANCE, name
        assert int(logits.argmax()) == int(reference.argmax())
    # Control: turn 2's chunk linked before the text run instead of after it is told apart, by the engine too.
    moved = LinkedPrompt([prompt.texts[0], PreparedSegment(prompt.texts[1].ids + prompt.texts[2].ids)],
                         [prompt.groups[0] + prompt.groups[1]], [prompt.identities[0] + prompt.identities[1]])
    other = cold.run(moved, max_new_tokens=1)
    assert (cold.logits[other.id][0] - reference).abs().max().item() > 10 * TOLERANCE
