"""Evaluation items: LongBench QA tasks with their official prompts, synthetic and generic QA JSONL.

Prompt templates and answer lengths are LongBench's own (THUDM/LongBench `config/dataset2prompt.json`
at 8ae23fd, the 21-dataset release, and `config/dataset2maxlen.json`). qvpic serves the context as
chunks, so each template is split at `{context}`: the part before it is prefilled as text ahead of
the chunks, the part after it (with `{input}` filled) is the query prefilled online.
`prompt_before_context + context + query_after_context == template.format(context=…, input=…)`,
which is exactly the prompt LongBench's `pred.py` builds before its model-specific truncation.

Bad records are an error, not a skip: dropping items silently would change the denominator of a
score. `DatasetError` lists every bad line (up to `_MAX_REPORTED`) with what is wrong with it.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any


class QATask(str, Enum):
    NARRATIVEQA = "narrativeqa"
    QASPER = "qasper"
    MULTIFIELDQA_EN = "multifieldqa_en"
    HOTPOTQA = "hotpotqa"
    TWOWIKIMQA = "2wikimqa"
    MUSIQUE = "musique"
    SYNTHETIC = "synthetic"  # pipeline.eval.synthetic, LongBench-format records
    GENERIC = "generic"  # {question, context | chunk_ids, answers} records


LONGBENCH_QA_TASKS: tuple[QATask, ...] = (QATask.NARRATIVEQA, QATask.QASPER, QATask.MULTIFIELDQA_EN,
                                          QATask.HOTPOTQA, QATask.TWOWIKIMQA, QATask.MUSIQUE)

_MULTIHOP = ("Answer the question based on the given passages. Only give me the answer and do not output any other "
             "words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given "
             "passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:")
_BRIEF = ("Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on "
          "the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:")

PROMPT_TEMPLATES: dict[QATask, str] = {
    QATask.NARRATIVEQA: (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the question as "
        "concisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: {context}"
        "\n\nNow, answer the question based on the story as concisely as you can, using a single phrase if possible. "
        "Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"),
    QATask.QASPER: (
        "You are given a scientific article and a question. Answer the question as concisely as you can, using a "
        "single phrase or sentence if possible. If the question cannot be answered based on the information in the "
        "article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or "
        "\"unanswerable\". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on "
        "the above article as concisely as you can, using a single phrase or sentence if possible. If the question "
        "cannot be answered based on the information in the article, write \"unanswerable\". If the question is a "
        "yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nQuestion: "
        "{input}\n\nAnswer:"),
    QATask.MULTIFIELDQA_EN: _BRIEF,
    QATask.HOTPOTQA: _MULTIHOP,
    QATask.TWOWIKIMQA: _MULTIHOP,
    QATask.MUSIQUE: _MULTIHOP,
    # Not LongBench tasks: short factual answers, so multifieldqa_en's wording and a 32-token budget.
    QATask.SYNTHETIC: _BRIEF,
    QATask.GENERIC: _BRIEF,
}

MAX_NEW_TOKENS: dict[QATask, int] = {
    QATask.NARRATIVEQA: 128, QATask.QASPER: 128, QATask.MULTIFIELDQA_EN: 64, QATask.HOTPOTQA: 32,
    QATask.TWOWIKIMQA: 32, QATask.MUSIQUE: 32, QATask.SYNTHETIC: 32, QATask.GENERIC: 32,
}

_MAX_REPORTED = 20


class DatasetError(ValueError):
    """A task file is missing or holds records that cannot be evaluated."""


@dataclass(frozen=True)
class QAItem:
    task: QATask
    id: str
    question: str
    context: str | None  # None when the item names stored chunks instead
    chunk_ids: tuple[str, ...] | None  # store chunk keys in context order; None when `context` is given
    answers: tuple[str, ...]
    prompt_before_context: str
    query_after_context: str  # the text after the context, question filled in: prefilled online
    max_new_tokens: int
    length_words: int | None = None  # LongBench's `length` field: words of the context
    evidence: str | None = None  # the sentence holding the answer, where the dataset knows it


def split_prompt(task: QATask, question: str) -> tuple[str, str]:
    """(text before the context, query after it) of `task`'s template with `question` filled in."""
    before, after = PROMPT_TEMPLATES[task].split("{context}")
    return before, after.format(input=question)


def load_tasks(path: str, tasks: Iterable[QATask] = LONGBENCH_QA_TASKS) -> list[QAItem]:
    """Items of each task, task by task in the order given, records in file order.

    `path` is a folder of `<task>.jsonl` files, or a zip archive holding `data/<task>.jsonl`
    (LongBench's own `data.zip` layout).
    """
    tasks = tuple(tasks)
    if QATask.GENERIC in tasks:
        raise DatasetError("the generic format is read by load_generic(path), not load_tasks")
    if os.path.isdir(path):
        return [item for task in tasks for item in _load_task_file(path, task)]
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            return [item for task in tasks for item in _load_task_zip(archive, path, task)]
    raise DatasetError(f"{path!r} is neither a folder of <task>.jsonl files nor a zip archive")


def _load_task_file(folder: str, task: QATask) -> list[QAItem]:
    file_path = os.path.join(folder, f"{task.value}.jsonl")
    if not os.path.isfile(file_path):
        raise DatasetError(f"task {task.value!r}: no file {file_path!r}")
    with open(file_path, "rb") as f:
        return _parse_lines(f.read(), file_path, task)


def _load_task_zip(archive: zipfile.ZipFile, archive_path: str, task: QATask) -> list[QAItem]:
    member = f"data/{task.value}.jsonl"
    try:
        raw = archive.read(member)
    except KeyError:
        raise DatasetError(f"task {task.value!r}: {archive_path!r} has no member {member!r}") from None
    return _parse_lines(raw, f"{archive_path}:{member}", task)


def load_generic(path: str) -> list[QAItem]:
    """Items of a JSONL file of `{id?, question, context | chunk_ids, answers}` records.

    `id` defaults to `L<line number>`; exactly one of `context` (text) and `chunk_ids` (store chunk
    keys, in context order) must be given.
    """
    if not os.path.isfile(path):
        raise DatasetError(f"no file {path!r}")
    with open(path, "rb") as f:
        return _parse_lines(f.read(), path, QATask.GENERIC)


def _parse_lines(raw: bytes, source: str, task: QATask) -> list[QAItem]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{source}: not UTF-8 ({exc})") from None
    items: list[QAItem] = []
    problems: list[str] = []
    first_line: dict[str, int] = {}
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            item = _generic_item(record, line_number) if task is QATask.GENERIC else _longbench_item(record, task)
        except (json.JSONDecodeError, _BadRecord) as exc:
            problems.append(f"line {line_number}: {exc}")
            continue
        if item.id in first_line:
            problems.append(f"line {line_number}: id {item.id!r} already used on line {first_line[item.id]}")
            continue
        first_line[item.id] = line_number
        items.append(item)
    if problems:
        shown = "\n  ".join(problems[:_MAX_REPORTED])
        more = f"\n  … and {len(problems) - _MAX_REPORTED} more" if len(problems) > _MAX_REPORTED else ""
        raise DatasetError(f"{source}: {len(problems)} bad record(s):\n  {shown}{more}")
    if not items:
        raise DatasetError(f"{source}: no records")
    return items


class _BadRecord(Exception):
    pass


def _longbench_item(record: Any, task: QATask) -> QAItem:
    record = _object(record)
    question = _text(record, "input")
    dataset = record.get("dataset", task.value)
    if dataset != task.value:  # LongBench-E files carry the same names, so a mismatch is a mix-up
        raise _BadRecord(f"'dataset' is {dataset!r} in the {task.value!r} file")
    length = record.get("length")
    if length is not None and (not isinstance(length, int) or isinstance(length, bool) or length < 0):
        raise _BadRecord(f"'length' must be a non-negative integer, got {length!r}")
    evidence = record.get("evidence")
    if evidence is not None and not isinstance(evidence, str):
        raise _BadRecord(f"'evidence' must be a string, got {type(evidence).__name__}")
    before, after = split_prompt(task, question)
    return QAItem(task=task, id=_text(record, "_id"), question=question, context=_text(record, "context"),
                  chunk_ids=None, answers=_answers(record), prompt_before_context=before,
                  query_after_context=after, max_new_tokens=MAX_NEW_TOKENS[task], length_words=length,
                  evidence=evidence)


def _generic_item(record: Any, line_number: int) -> QAItem:
    record = _object(record)
    question = _text(record, "question")
    has_context, has_chunks = record.get("context") is not None, record.get("chunk_ids") is not None
    if has_context == has_chunks:
        raise _BadRecord("give exactly one of 'context' and 'chunk_ids'")
    chunk_ids = None
    if has_chunks:
        chunk_ids = record["chunk_ids"]
        if not isinstance(chunk_ids, list) or not chunk_ids \
                or not all(isinstance(c, str) and c.strip() for c in chunk_ids):
            raise _BadRecord("'chunk_ids' must be a non-empty list of non-empty strings")
        chunk_ids = tuple(chunk_ids)
    item_id = _text(record, "id") if record.get("id") is not None else f"L{line_number}"
    before, after = split_prompt(QATask.GENERIC, question)
    return QAItem(task=QATask.GENERIC, id=item_id, question=question,
                  context=_text(record, "context") if has_context else None, chunk_ids=chunk_ids,
                  answers=_answers(record), prompt_before_context=before, query_after_context=after,
                  max_new_tokens=MAX_NEW_TOKENS[QATask.GENERIC])


def _object(record: Any) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise _BadRecord(f"a record must be a JSON object, got {type(record).__name__}")
    return record


def _text(record: dict[str, Any], field: str) -> str:
    value = record.get(field)
    if not isinstance(value, str) or not value.strip():
        raise _BadRecord(f"{field!r} must be a non-empty string, got {_describe(value)}")
    return value


def _answers(record: dict[str, Any]) -> tuple[str, ...]:
    answers = record.get("answers")
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise _BadRecord(f"'answers' must be a non-empty list of strings, got {_describe(answers)}")
    return tuple(answers)


def _describe(value: Any) -> str:
    return "nothing" if value is None else f"{type(value).__name__} {str(value)[:40]!r}"

