"""Synthetic long-document QA: fine-grained facts (codes, digits, dates, names) planted at random
depths in long filler text, written as LongBench-format JSONL (`dataset = "synthetic"`).

Each document holds one asked fact and `num_distractors` facts of the same kind with other keys and
values ("vault 7" is asked, "vault 31" is a distractor), so reading the wrong digit gives a wrong
answer. The answer string occurs exactly once in the context, which lets `evidence_chunks` find the
chunk that holds it. Filler is English prose from Python's own bundled docs (`pydoc_data.topics`),
digit-free so that the planted facts are the only numbers. Output is deterministic for a given seed
and Python minor version (the bundled docs change between versions).
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import Enum
from pydoc_data.topics import topics

from pipeline.eval.longbench import QATask


class SyntheticError(ValueError):
    """Generator arguments out of range, or evidence that no chunk holds."""


class FactKind(str, Enum):
    ACCESS_CODE = "access_code"
    INVOICE_DATE = "invoice_date"
    INVOICE_PAYER = "invoice_payer"
    SHIPMENT_CRATES = "shipment_crates"
    EXTENSION = "extension"


@dataclass(frozen=True)
class Fact:
    kind: FactKind
    sentence: str  # the evidence sentence planted in the filler
    question: str
    answer: str


@dataclass(frozen=True)
class SyntheticRecord:
    """One LongBench-format line; `evidence`, `depth` and `fact_kind` are our additions."""

    input: str
    context: str
    answers: list[str]
    length: int  # whitespace words of the context, as LongBench counts English lengths
    dataset: str
    language: str
    all_classes: None
    _id: str
    evidence: str
    depth: float  # character offset of the evidence / context length, in [0, 1)
    fact_kind: str


_FIRST_NAMES = ("Marta", "Tomasz", "Amara", "Kenji", "Lucia", "Oskar", "Nadia", "Ravi", "Elif", "Joaquin",
                "Signe", "Kwame", "Ines", "Dmitri", "Leilani", "Farid", "Hana", "Bruno", "Zainab", "Emeka")
_SURNAMES = ("Oyelaran", "Lindqvist", "Castellano", "Mbeki", "Varga", "Nakamura", "Okafor", "Brennan",
             "Haddad", "Sorensen", "Quispe", "Adeyemi", "Kowalczyk", "Ferreira", "Tanaka", "Morozova")
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
           "October", "November", "December")
_DEPOTS = ("Harrow", "Eastgate", "Millbrook", "Kestrel Point", "Dunmore", "Ashford", "Port Lenny", "Greyfield")
_LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"  # no I or O: they read as digits, which is not the point here
_SENTENCE_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"])")
_CODE_LIKE = re.compile(r"::=|\*\*\*|===|---|>>>")
_UNWANTED_CHARS = re.compile(r"[\d{}\[\]<>=`|\\]")
_MAX_ATTEMPTS = 100


def _date(rng: random.Random) -> str:
    return f"{rng.randint(1, 28)} {rng.choice(_MONTHS)} {rng.randint(1990, 2029)}"


def _name(rng: random.Random) -> str:
    return f"{rng.choice(_FIRST_NAMES)} {rng.choice(_SURNAMES)}"


def _fact(kind: FactKind, rng: random.Random) -> tuple[str, Fact]:
    """(key that must differ between facts of a document, fact)."""
    if kind is FactKind.ACCESS_CODE:
        vault = rng.randint(1, 99)
        code = f"{rng.choice(_LETTERS)}{rng.choice(_LETTERS)}-{rng.randint(1000, 9999)}-{rng.choice(_LETTERS)}"
        return f"vault {vault}", Fact(kind, f"The access code for vault {vault} is {code}.",
                                      f"What is the access code for vault {vault}?", code)
    if kind in (FactKind.INVOICE_DATE, FactKind.INVOICE_PAYER):
        invoice, date, payer = rng.randint(10000, 99999), _date(rng), _name(rng)
        sentence = f"Invoice {invoice} was paid on {date} by {payer}."
        if kind is FactKind.INVOICE_DATE:
            return f"invoice {invoice}", Fact(kind, sentence, f"On what date was invoice {invoice} paid?", date)
        return f"invoice {invoice}", Fact(kind, sentence, f"Who paid invoice {invoice}?", payer)
    if kind is FactKind.SHIPMENT_CRATES:
        shipment = f"{rng.choice(_LETTERS)}{rng.randint(100, 999)}"
        crates = str(rng.randint(100, 9999))
        return f"shipment {shipment}", Fact(
            kind, f"Shipment {shipment} left the {rng.choice(_DEPOTS)} depot carrying {crates} crates.",
            f"How many crates did shipment {shipment} carry?", crates)
    building, extension = rng.randint(1, 60), str(rng.randint(1000, 9999))
    return f"building {building}", Fact(
        kind, f"The maintenance desk of building {building} answers on extension {extension}.",
        f"On which extension does the maintenance desk of building {building} answer?", extension)


@functools.lru_cache(maxsize=1)
def filler_sentences() -> tuple[str, ...]:
    """Digit-free prose sentences of the bundled Python docs, sorted and unique."""
    found: set[str] = set()
    for name in sorted(topics):
        for paragraph in re.split(r"\n\s*\n", topics[name]):
            lines = paragraph.split("\n")
            if all(line.startswith("   ") for line in lines):  # an indented note, still prose
                lines = [line[3:] for line in lines]
            if any(line.startswith(" ") for line in lines):  # code, grammar or a table
                continue
            text = " ".join(line.strip() for line in lines).replace("*", "")
            if _CODE_LIKE.search(text):
                continue
            for sentence in map(str.strip, _SENTENCE_SPLIT.split(text)):
                if 6 <= len(sentence.split()) <= 60 and sentence.endswith(".") \
                        and (sentence[0].isupper() or sentence[0] == '"') and not _UNWANTED_CHARS.search(sentence):
                    found.add(sentence)
    return tuple(sorted(found))


def _filler_paragraphs(rng: random.Random, context_words: int) -> list[list[str]]:
    """Paragraphs of 3–7 sentences, `context_words` words in all (rounded up to a sentence)."""
    pool = filler_sentences()
    order: list[str] = []
    paragraphs: list[list[str]] = []
    num_words = 0
    while num_words < context_words:
        paragraph: list[str] = []
        for _ in range(rng.randint(3, 7)):
            if not order:  # every sentence once before any repeats
                order = rng.sample(pool, len(pool))
            paragraph.append(order.pop())
            num_words += len(paragraph[-1].split())
        paragraphs.append(paragraph)
    return paragraphs


def _record(index: int, seed: int, context_words: int, num_distractors: int) -> SyntheticRecord:
    rng = random.Random(f"qvpic-synthetic:{seed}:{index}")  # str seeds hash with sha512: stable
    kind = list(FactKind)[index % len(FactKind)]
    for _ in range(_MAX_ATTEMPTS):
        paragraphs = _filler_paragraphs(rng, context_words)
        facts: dict[str, Fact] = {}
        while len(facts) < num_distractors + 1:
            key, fact = _fact(kind, rng)
            facts.setdefault(key, fact)
        asked = next(iter(facts.values()))
        for fact in facts.values():
            paragraph = paragraphs[rng.randrange(len(paragraphs))]
            paragraph.insert(rng.randint(0, len(paragraph)), fact.sentence)
        context = "\n\n".join(" ".join(p) for p in paragraphs)
        # A date "4 May 2001" inside a distractor's "14 May 2001" would make the evidence ambiguous.
        if context.count(asked.answer) == 1 and context.count(asked.sentence) == 1:
            return SyntheticRecord(
                input=asked.question, context=context, answers=[asked.answer], length=len(context.split()),
                dataset=QATask.SYNTHETIC.value, language="en", all_classes=None, _id=f"synthetic-{seed}-{index:06d}",
                evidence=asked.sentence, depth=round(context.index(asked.sentence) / len(context), 4),
                fact_kind=kind.value)
    raise SyntheticError(f"item {index}: no unambiguous placement in {_MAX_ATTEMPTS} attempts")


def generate(num_items: int, *, context_words: int = 4000, num_distractors: int = 3,
             seed: int = 0) -> list[SyntheticRecord]:
    """`num_items` records cycling through the fact kinds; item i does not depend on `num_items`."""
    if num_items < 1:
        raise SyntheticError(f"num_items must be >= 1, got {num_items}")
    if context_words < 50:
        raise SyntheticError(f"context_words must be >= 50, got {context_words}")
    if not 0 <= num_distractors <= 20:
        raise SyntheticError(f"num_distractors must be in [0, 20], got {num_distractors}")
    return [_record(i, seed, context_words, num_distractors) for i in range(num_items)]


def write_jsonl(records: Sequence[SyntheticRecord], folder: str) -> str:
    """Write `<folder>/synthetic.jsonl` (what `load_tasks(folder, [QATask.SYNTHETIC])` reads); its path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{QATask.SYNTHETIC.value}.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(asdict(record), ensure_ascii=False) + "\n")
    return path


def evidence_chunks(chunks: Sequence[str], evidence: str, answer: str) -> list[int]:
    """Indices of the chunks that hold the evidence sentence, compared with whitespace collapsed.

    A chunker may cut the sentence in two; then the chunks holding the answer string count, and if
    the answer is cut too, the adjacent pair whose join holds it.
    """
    def squash(text: str) -> str:
        return " ".join(text.split())

    flat = [squash(chunk) for chunk in chunks]
    for needle in (squash(evidence), squash(answer)):
        found = [i for i, chunk in enumerate(flat) if needle in chunk]
        if found:
            return found
    needle = squash(answer)
    for i in range(len(flat) - 1):
        if needle in flat[i] + " " + flat[i + 1] or needle in flat[i] + flat[i + 1]:
            return [i, i + 1]
    raise SyntheticError(f"no chunk holds the evidence {evidence[:60]!r}")
