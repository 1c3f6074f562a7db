"""Stop strings, penalties and logit bias: each against a reference from outside the code under test — the
tokenizer's own decoding cut with `str.find`, and logits worked by hand with OpenAI's formula."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoTokenizer

from pipeline.runtime import adjust_logits, ensure_model
from schemas.sampling import Sampling
from serve.engine.stops import StopMatcher


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ensure_model("tiny-qwen"), local_files_only=True)


def run(tokenizer, ids: list[int], stops: tuple[str, ...]) -> tuple[list[str], bool, int]:
    """The matcher's shown pieces, whether it matched, and how many tokens it read before matching."""
    matcher, shown = StopMatcher(tokenizer, stops), []
    for read, token in enumerate(ids, 1):
        step = matcher.add(token)
        shown.append(step.text)
        if step.matched:
            return shown, True, read
    step = matcher.flush()
    return shown + [step.text], step.matched, len(ids)


def test_a_stop_string_split_across_tokens_ends_the_text_before_it(tokenizer):
    ids = tokenizer.encode("The part ships on Monday.\nNext question: when?", add_special_tokens=False)
    shown, matched, read = run(tokenizer, ids, ("\nNext",))
    assert matched and "".join(shown) == "The part ships on Monday."
    assert read < len(ids)  # decoding stops at the match, not at the end
    assert tokenizer.decode(ids[:read]).find("\nNext") >= 0 > tokenizer.decode(ids[:read - 1]).find("\nNext")


@pytest.mark.parametrize("seed", range(4))
def test_random_text_against_str_find(tokenizer, seed):
    """The shown text is the full decoding cut at the earliest stop string, and no prefix of the stream ever
    shows a stop string's start that then completes (the held-back tail)."""
    rng = random.Random(seed)
    words = ["ab", "a", "b", "ba", " ", "stop", "st", "op", "\n", "é", "日本"]
    for _ in range(60):
        text = "".join(rng.choice(words) for _ in range(rng.randrange(1, 25)))
        stops = tuple(rng.sample(["stop", "ba b", "\n\n", "日本", "aab"], rng.randrange(1, 4)))
        ids = tokenizer.encode(text, add_special_tokens=False)
        decoded = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        cuts = [i for i in (decoded.find(s) for s in stops) if i >= 0]
        shown, matched, _ = run(tokenizer, ids, stops)
        assert matched == bool(cuts)
        assert "".join(shown) == (decoded[:min(cuts)] if cuts else decoded)
        stream = ""
        for piece in shown:  # no piece shown ends inside a stop string that the answer contains
            stream += piece
            assert not any(s in stream for s in stops)


def test_penalties_and_bias_by_hand():
    """OpenAI: logit[j] - count[j] * frequency - (count[j] > 0) * presence + bias[j]."""
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0])
    sampling = Sampling(presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((0, 10.0), (3, -100.0)))
    generated = [1, 1, 2]  # token 1 twice, token 2 once, 0 and 3 never
    expected = [1.0 + 10.0, 2.0 - 2 * 0.25 - 0.5, 3.0 - 0.25 - 0.5, 4.0 - 100.0]
    assert adjust_logits(logits, generated, sampling).tolist() == pytest.approx(expected)
    assert logits.tolist() == [1.0, 2.0, 3.0, 4.0]  # the model's logits are left as they were
    negative = Sampling(presence_penalty=-2.0, frequency_penalty=-1.0)  # negative: encourages repetition
    assert adjust_logits(logits, [3], negative).tolist() == pytest.approx([1.0, 2.0, 3.0, 4.0 + 1.0 + 2.0])
    assert not Sampling().adjusts_logits and Sampling(logit_bias=((1, 0.5),)).adjusts_logits
