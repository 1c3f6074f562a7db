"""vLLM's sampling extras on small logits vectors, each against a value worked by hand from vLLM's definition
(vllm/v1/sample: min-p keeps p >= min_p * p_max after temperature; top-k keeps the k largest and their ties; the
repetition penalty divides a positive logit and multiplies a negative one, for tokens of the prompt or the answer;
the logit bias comes before it), and the sampler's endings (min_tokens, stop_token_ids, ignore_eos)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from pipeline.runtime import adjust_logits, choose_token, sampling_distribution, token_mask
from schemas.sampling import Sampling
from serve.engine.qvpic.sampler import Sampler, prompt_token_ids
from serve.engine.sequence import Sequence

PROBS = [0.5, 0.3, 0.15, 0.05]
LOGITS = torch.tensor([[math.log(p) for p in PROBS]])  # at temperature 1 the distribution is PROBS itself


def distribution(logits: torch.Tensor, **fields) -> list[float]:
    return sampling_distribution(logits, Sampling(temperature=1.0, **fields)).tolist()


def test_min_p_keeps_exactly_the_tokens_at_or_above_min_p_times_the_best():
    # min_p 0.25: threshold 0.125 keeps 0.5, 0.3, 0.15, renormalised over 0.95; 0.7: threshold 0.35 keeps 0.5 alone
    assert distribution(LOGITS, min_p=0.25) == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])
    assert distribution(LOGITS, min_p=0.7) == pytest.approx([1.0, 0.0, 0.0, 0.0])
    assert distribution(LOGITS) == pytest.approx(PROBS)  # control: min_p 0 keeps every token


def test_min_p_reads_the_distribution_after_temperature():
    # temperature 0.5 squares and renormalises: 0.25, 0.09, 0.0225, 0.0025 (sum 0.365); min_p 0.3 keeps p >= 0.075
    squared = [p * p for p in PROBS]
    total = squared[0] + squared[1]
    got = sampling_distribution(LOGITS, Sampling(temperature=0.5, min_p=0.3)).tolist()
    assert got == pytest.approx([squared[0] / total, squared[1] / total, 0.0, 0.0])


def test_top_k_keeps_the_k_best_and_their_ties():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 0.0]])
    e = math.e
    assert distribution(logits, top_k=3) == pytest.approx([0.0, e / (2 * e + 1), 1 / (2 * e + 1), e / (2 * e + 1),
                                                            0.0])
    assert distribution(logits, top_k=1) == pytest.approx([0.0, 0.5, 0.0, 0.5, 0.0])  # a tie at the top stays
    assert distribution(logits, top_k=0) == distribution(logits, top_k=-1) == distribution(logits)  # off
    assert distribution(logits, top_k=9) == pytest.approx(distribution(logits))  # past the vocabulary: all


def test_top_k_1_at_temperature_1_5_is_greedy():
    torch.manual_seed(0)
    rows = torch.randn(64, 1, 50) * 0.5  # flat rows: at temperature 1.5 a sample is rarely the argmax
    drawn = []
    for top_k in (1, 0):
        generator = torch.Generator().manual_seed(1)
        drawn.append([int(choose_token(row, Sampling(temperature=1.5, top_k=top_k), generator)) for row in rows])
    greedy = rows.squeeze(1).argmax(-1).tolist()
    assert drawn[0] == greedy
    assert sum(a != b for a, b in zip(drawn[1], greedy)) > 32  # control: without top_k most draws are not greedy


def test_repetition_penalty_by_hand_after_the_logit_bias():
    """HF / vLLM: a seen token's logit l becomes l / r if l > 0 else l * r. Seen: prompt {0, 1}, answer [2].
    The bias applies first (vLLM's order): token 0's 2 - 3 = -1 is then multiplied (-2), token 3's -0.5 + 1 is
    unseen (0.5)."""
    logits = torch.tensor([2.0, -1.0, 0.5, -0.5, 3.0])
    prompt = token_mask([0, 1], 5, logits.device)
    sampling = Sampling(repetition_penalty=2.0)
    assert adjust_logits(logits, [2], sampling, prompt).tolist() == pytest.approx([1.0, -2.0, 0.25, -0.5, 3.0])
    biased = Sampling(repetition_penalty=2.0, logit_bias=((0, -3.0), (3, 1.0)))
    assert adjust_logits(logits, [2], biased, prompt).tolist() == pytest.approx([-2.0, -2.0, 0.25, 0.5, 3.0])
    assert adjust_logits(logits, [2], Sampling(), prompt).tolist() == logits.tolist()  # control: r = 1 is off
    assert Sampling(repetition_penalty=1.1).adjusts_logits and not Sampling(repetition_penalty=1.0).adjusts_logits


def prompt_of(ids: list[int]):
    return SimpleNamespace(prompt=SimpleNamespace(texts=[SimpleNamespace(ids=ids[:1]), SimpleNamespace(ids=ids[1:])]))


def sampler(end: int = 2) -> Sampler:
    adapter = SimpleNamespace(end_of_turn_ids=frozenset({end}))
    return Sampler(SimpleNamespace(device=torch.device("cpu"), adapter=adapter))


def sequence(sampling: Sampling, token_ids: list[int], context=None) -> Sequence:
    return Sequence(sampling=sampling, context=context, num_prompt_tokens=4, num_query_tokens=0,
                    emit=lambda t: None, token_ids=list(token_ids))


def pick(seq: Sequence, row: torch.Tensor) -> int:
    chosen = sampler().choose(seq, row)
    return int(row.argmax()) if chosen is None else int(chosen)


def test_the_engines_sampler_penalises_the_prompts_text_tokens():
    row = torch.tensor([0.0, 1.0, 0.5, 3.0, 2.9, 0.0])
    context = prompt_of([3, 5])
    assert prompt_token_ids(context) == [3, 5]
    assert pick(sequence(Sampling(repetition_penalty=1.5), [], context), row) == 4  # 3.0 / 1.5 = 2 < 2.9
    assert pick(sequence(Sampling(), [], context), row) == 3  # control: no penalty, the best logit
    assert pick(sequence(Sampling(repetition_penalty=1.5), [4], context), row) == 3  # 2.9 / 1.5 < 2 too


def test_min_tokens_masks_the_end_of_turn_and_stop_token_ids_until_reached():
    row = torch.tensor([0.0, 1.0, 5.0, 0.0, 0.0, 0.0, 0.0, 4.0, 3.0])  # the end token (2) is best, then 7, then 8
    early = Sampling(min_tokens=3, stop_token_ids=(7,))
    assert pick(sequence(early, [1, 1]), row) == 8  # two tokens so far: neither 2 nor 7 may end it yet
    assert pick(sequence(early, [1, 1, 1]), row) == 2  # the third is decoded: the end is allowed
    assert pick(sequence(Sampling(stop_token_ids=(7,)), [1]), row) == 2  # control: no min_tokens


def test_stop_token_ids_and_ignore_eos_decide_what_ends_the_turn():
    plain, ignoring = sequence(Sampling(stop_token_ids=(7,)), []), sequence(Sampling(ignore_eos=True), [])
    engine_sampler = sampler(end=2)
    assert engine_sampler.ends_turn(plain, 2) and engine_sampler.ends_turn(plain, 7)
    assert not engine_sampler.ends_turn(plain, 8)
    assert not engine_sampler.ends_turn(ignoring, 2)  # ignore_eos: the end token is an ordinary token


@pytest.mark.parametrize("fields", [dict(top_k=-2), dict(min_p=1.5), dict(min_p=-0.1), dict(repetition_penalty=0.0),
                                    dict(min_tokens=40, max_new_tokens=32), dict(stop_token_ids=(-1,))])
def test_bad_extras_are_refused(fields):
    with pytest.raises(ValueError):
        Sampling(**fields)
