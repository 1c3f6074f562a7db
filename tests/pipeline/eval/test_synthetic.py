"""Synthetic planted-fact QA: determinism, unambiguous evidence, LongBench round trip, chunk lookup."""

from __future__ import annotations

import re
from dataclasses import asdict

import pytest

from pipeline.eval import QATask, evidence_chunks, generate, load_tasks
from pipeline.eval.scoring import qa_f1
from pipeline.eval.synthetic import FactKind, SyntheticError, filler_sentences, write_jsonl

_FACT_PATTERNS = {
    FactKind.ACCESS_CODE: r"The access code for vault \d+ is [A-Z]{2}-\d{4}-[A-Z]\.",
    FactKind.INVOICE_DATE: r"Invoice \d{5} was paid on \d+ \w+ \d{4} by [A-Z]\w+ [A-Z]\w+\.",
    FactKind.INVOICE_PAYER: r"Invoice \d{5} was paid on \d+ \w+ \d{4} by [A-Z]\w+ [A-Z]\w+\.",
    FactKind.SHIPMENT_CRATES: r"Shipment [A-Z]\d{3} left the [A-Z][\w ]+ depot carrying \d+ crates\.",
    FactKind.EXTENSION: r"The maintenance desk of building \d+ answers on extension \d{4}\.",
}


@pytest.fixture(scope="module")
def records():
    return generate(40, context_words=1500, num_distractors=3, seed=7)


def test_deterministic_per_seed_and_independent_of_count(records):
    again = generate(40, context_words=1500, num_distractors=3, seed=7)
    assert [asdict(r) for r in again] == [asdict(r) for r in records]
    assert asdict(generate(3, context_words=1500, seed=7)[2]) == asdict(records[2])
    assert generate(1, context_words=1500, seed=8)[0].context != records[0].context
    assert len({r._id for r in records}) == len(records)


def test_each_record_has_one_unambiguous_planted_answer(records):
    assert {r.fact_kind for r in records[:len(FactKind)]} == {k.value for k in FactKind}
    for r in records:
        (answer,) = r.answers
        assert r.context.count(answer) == 1 and r.context.count(r.evidence) == 1
        assert answer in r.evidence
        assert r.context.index(r.evidence) == pytest.approx(r.depth * len(r.context), abs=len(r.context) * 1e-4)
        assert 0.0 <= r.depth < 1.0
        planted = re.findall(_FACT_PATTERNS[FactKind(r.fact_kind)], r.context)
        assert len(planted) == 4 and r.evidence in planted  # the asked fact and three distractors
        # Filler is digit-free: every digit of the context belongs to a planted fact.
        assert not re.search(r"\d", re.sub(_FACT_PATTERNS[FactKind(r.fact_kind)], "", r.context))
        assert 1500 <= r.length == len(r.context.split()) < 1500 + 4 * 60 + 100
        assert (r.dataset, r.language, r.all_classes) == ("synthetic", "en", None)
        assert qa_f1(answer, r.answers) == 1.0


def test_asked_key_is_named_in_the_question(records):
    for r in records:
        key = re.search(r"(vault \d+|[Ii]nvoice \d+|[Ss]hipment [A-Z]\d+|building \d+)", r.evidence).group(1)
        assert key.lower() in r.input.lower()


def test_depths_cover_the_document(records):
    depths = [r.depth for r in records]
    assert min(depths) < 0.25 and max(depths) > 0.75


def test_filler_is_unique_digit_free_prose():
    sentences = filler_sentences()
    assert len(sentences) > 500 and len(set(sentences)) == len(sentences)
    assert not any(re.search(r"\d|::=|>>>", s) for s in sentences)
    assert all(s.endswith(".") and (s[0].isupper() or s[0] == '"') and s == s.strip() for s in sentences)


def test_round_trip_through_longbench_loader(records, tmp_path):
    path = write_jsonl(records[:5], str(tmp_path))
    assert path.endswith("synthetic.jsonl")
    items = load_tasks(str(tmp_path), [QATask.SYNTHETIC])
    assert [(i.id, i.question, i.context, i.answers, i.evidence) for i in items] == \
        [(r._id, r.input, r.context, tuple(r.answers), r.evidence) for r in records[:5]]
    assert all(i.task is QATask.SYNTHETIC and i.max_new_tokens == 32 for i in items)
    assert items[0].query_after_context.endswith(f"Question: {records[0].input}\nAnswer:")


def _chunks(text: str, num_chars: int) -> list[str]:
    return [text[i:i + num_chars] for i in range(0, len(text), num_chars)]


def test_evidence_chunks_finds_the_holding_chunk(records):
    for r in records[:10]:
        paragraphs = r.context.split("\n\n")
        found = evidence_chunks(paragraphs, r.evidence, r.answers[0])
        assert found == [i for i, p in enumerate(paragraphs) if r.evidence in p]
        # Fixed-size cuts may split the sentence and even the answer: the result still holds it.
        for num_chars in (97, 400, 1000):
            chunks = _chunks(r.context, num_chars)
            found = evidence_chunks(chunks, r.evidence, r.answers[0])
            assert found == list(range(found[0], found[0] + len(found))) and len(found) <= 2
            assert r.answers[0] in "".join(chunks[i] for i in found)


def test_evidence_chunks_ignores_whitespace_and_reports_absence():
    chunks = ["alpha beta", "The code  is\nQX-1234-K.", "gamma"]
    assert evidence_chunks(chunks, "The code is QX-1234-K.", "QX-1234-K") == [1]
    with pytest.raises(SyntheticError, match="no chunk holds"):
        evidence_chunks(chunks, "Vault 9 is empty.", "ZZ-0000-Z")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_items": 0}, "num_items"), ({"num_items": 1, "context_words": 10}, "context_words"),
    ({"num_items": 1, "num_distractors": -1}, "num_distractors"),
])
def test_rejects_bad_arguments(kwargs, message):
    with pytest.raises(SyntheticError, match=message):
        generate(**kwargs)


def test_zero_distractors_and_long_documents_repeat_filler_only_after_exhausting_it():
    (r,) = generate(1, context_words=40_000, num_distractors=0, seed=1)
    assert len(re.findall(_FACT_PATTERNS[FactKind(r.fact_kind)], r.context)) == 1
    assert r.length >= 40_000 > sum(len(s.split()) for s in filler_sentences())
