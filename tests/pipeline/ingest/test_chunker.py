"""Chunker: budget held, text kept in order, cuts at the strongest boundary, linear cost."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from pipeline.ingest import Chunker
from pipeline.ingest.chunker import ChunkingError
from pipeline.ingest.corpus import read_file
from schemas.corpus import Document, chunk_key
from tests.support.paths import REPO

DATA = REPO / "jobs" / "data"
WORDS = ["pump", "seal", "kit", "SK-118", "€1,215", "Dock", "3", "engineer", "pressure", "the", "of", "a",
         "naïve", "cafe\u0301", "zero\u200bwidth", "\u202eltr\u202c", "tab\there"]


def _word_count(text: str) -> int:
    return len(text.split())


@pytest.fixture(scope="module")
def bpe_count() -> Callable[[str], int]:
    """A real byte-level BPE trained in memory on the sample corpus."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    texts = [json.loads(line)["text"] for line in (DATA / "sample_corpus.jsonl").read_text().splitlines()]
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


def _random_document(rng: random.Random) -> str:
    paragraphs = []
    for _ in range(rng.randint(0, 12)):
        sentences = []
        for _ in range(rng.randint(1, 8)):
            words = [rng.choice(WORDS) for _ in range(rng.randint(1, 25))]
            if rng.random() < 0.05:
                words.append("x" * rng.randint(50, 3000))  # an unbreakable run
            if rng.random() < 0.1:
                words.append("机器学习的缓存。位置编码。" * rng.randint(1, 6))
            sentences.append(" ".join(words) + rng.choice([".", "!", "?", ";", ""]))
        joiner = rng.choice([" ", "\n", "  \n\t", " "])
        paragraphs.append(joiner.join(sentences))
    return rng.choice(["", "\n\n  ", " "]) + rng.choice(["\n\n", "\n \n\n", "\r\n\r\n"]).join(paragraphs) + "\n"


def _assert_chunks_tile_the_text(text: str, chunks: list[tuple[str, int]], count: Callable[[str], int],
                                 max_tokens: int) -> None:
    position = 0
    for chunk_text, num_tokens in chunks:
        assert chunk_text and chunk_text == chunk_text.strip()
        assert num_tokens == count(chunk_text) <= max_tokens
        while text[position].isspace():  # only whitespace may be dropped, and only at cut points
            position += 1
        assert text.startswith(chunk_text, position), (text[position:position + 40], chunk_text[:40])
        position += len(chunk_text)
    assert not text[position:].strip()


@pytest.mark.parametrize("max_tokens", [1, 4, 37, 400])
def test_random_documents_keep_every_character_in_order_within_budget(max_tokens: int) -> None:
    rng = random.Random(max_tokens)
    for count in (_word_count, len):
        chunker = Chunker(count, max_tokens if count is _word_count else max_tokens * 5)
        for _ in range(25):
            text = _random_document(rng)
            chunks = chunker.split(text)
            _assert_chunks_tile_the_text(text, chunks, count, chunker.max_tokens)
            assert chunker.split(text) == chunks


def test_a_real_bpe_tokenizer_holds_the_budget(bpe_count: Callable[[str], int]) -> None:
    rng = random.Random(11)
    for max_tokens in (8, 64, 300):
        chunker = Chunker(bpe_count, max_tokens)
        for _ in range(10):
            text = _random_document(rng)
            _assert_chunks_tile_the_text(text, chunker.split(text), bpe_count, max_tokens)
    for doc in read_file(str(DATA / "sample_corpus.jsonl"), str(DATA)):
        assert isinstance(doc, Document)
        chunks = Chunker(bpe_count, 128).chunk(doc)
        assert [c.chunk_id for c in chunks] == [f"{doc.doc_id}#{i:05d}" for i in range(len(chunks))]
        assert all(c.chunk_key == chunk_key(c.text) and c.num_text_tokens <= 128 for c in chunks)


def test_cuts_prefer_paragraphs_then_sentences() -> None:
    paragraphs = [" ".join(f"p{p}w{w}" for w in range(3)) for p in range(9)]
    chunks = Chunker(_word_count, 10).split("\n\n".join(paragraphs))
    assert [text.split("\n\n") for text, _ in chunks] == [paragraphs[0:3], paragraphs[3:6], paragraphs[6:9]]
    sentences = " ".join(f"Sentence {i} has five words." for i in range(6))
    short_then_long = "Short one.\n\n" + sentences
    texts = [text for text, _ in Chunker(_word_count, 12).split(short_then_long)]
    assert texts == ["Short one.", " ".join(sentences.split(" ")[:10]), " ".join(sentences.split(" ")[10:20]),
                     " ".join(sentences.split(" ")[20:])]
    assert all(text.endswith(".") for text in texts)


def test_cjk_cuts_at_sentence_ends_and_combining_marks_stay_attached() -> None:
    text = "机器学习的缓存。" * 10
    assert {t for t, _ in Chunker(len, 20).split(text)} == {"机器学习的缓存。机器学习的缓存。"}
    accented = "e\u0301" * 500
    chunks = Chunker(len, 7).split(accented)
    assert "".join(t for t, _ in chunks) == accented
    assert all(t[0] == "e" for t, _ in chunks)


def test_cost_stays_linear_on_a_huge_unbreakable_word_and_many_paragraphs() -> None:
    def measured(text: str, max_tokens: int, count: Callable[[str], int]) -> tuple[int, int]:
        calls, nchars = 0, 0

        def counting(s: str) -> int:
            nonlocal calls, nchars
            calls, nchars = calls + 1, nchars + len(s)
            return count(s)

        Chunker(counting, max_tokens).split(text)
        return calls, nchars

    word = "".join(random.Random(5).choice("abcdefgh") for _ in range(100_000))
    _, nchars = measured(word, 100, len)
    _, nchars_double = measured(word * 2, 100, len)
    assert nchars < 40 * len(word) and nchars_double < 2.5 * nchars
    paragraphs = "\n\n".join(f"para {i} has six words" for i in range(20_000))
    calls, _ = measured(paragraphs, 60, _word_count)
    assert calls < 2 * 20_000 + 10 * (20_000 * 6 // 60)


def test_budget_errors() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        Chunker(len, 0)
    with pytest.raises(ChunkingError, match="alone"):
        Chunker(lambda s: 5 * len(s), 3).split("abc")
    assert Chunker(len, 5).split(" \n\n\t ") == []


COUNT_TEXTS = ["The Atlas pump ships with part XK-4471-B.", "  leading and trailing  ", "Zero\u200bwidth 你好 e\u0301",
               "<|im_start|>user looks like a special token", "", "line\nbreaks\n\n and tabs\t."]


@pytest.mark.parametrize("name", ["tiny-qwen", "tiny-glm", "tiny-llava"])
def test_chunk_token_counts_are_the_models_own_tokenizer(name: str) -> None:
    """The chunk stage reads tokenizer.json with `tokenizers` (no transformers import); the oracle is the
    checkpoint's tokenizer through transformers. Negative control: a plausible counter (words) disagrees."""
    from transformers import AutoTokenizer

    from pipeline.ingest.stages.chunk import token_counter
    from pipeline.runtime import resolve_path
    from schemas.config import ModelSpec

    oracle = AutoTokenizer.from_pretrained(resolve_path(ModelSpec(path=name)), local_files_only=True)
    expected = [len(oracle(t, add_special_tokens=False).input_ids) for t in COUNT_TEXTS]
    count = token_counter(ModelSpec(path=name))
    assert [count(t) for t in COUNT_TEXTS] == expected
    assert [len(t.split()) for t in COUNT_TEXTS] != expected
