"""LongBench QA F1, scored exactly as the reference `qa_f1_score` + `scorer` (THUDM/LongBench
`metrics.py` and `eval.py`) score the six English QA tasks.

Reference behaviour kept on purpose, even where it surprises:
- normalisation lower-cases, then drops ASCII punctuation (`string.punctuation` only, so "’" or "—"
  survive), then removes the articles a/an/the as whole words, then collapses whitespace;
- an empty normalised prediction or gold answer scores 0, also when both are empty (SQuAD would
  say 1);
- an item scores the max over its gold answers; a task scores the mean of its items × 100.
The reference rounds the task score to 2 decimals for display; we keep the full float and leave
rounding to whoever prints it.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.eval.longbench import QAItem, QATask

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


class ScoringError(ValueError):
    """Predictions and items do not line up, or an item has no gold answer to score against."""


def normalize_answer(text: str) -> str:
    lowered = text.lower()
    no_punctuation = "".join(ch for ch in lowered if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", no_punctuation).split())


def token_f1(prediction_tokens: Sequence[str], gold_tokens: Sequence[str]) -> float:
    """Bag-of-tokens F1: repeated tokens count as often as they occur on both sides."""
    num_same = sum((Counter(prediction_tokens) & Counter(gold_tokens)).values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction_tokens)
    recall = num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, answers: Sequence[str]) -> float:
    """F1 in [0, 1] of one prediction against the best-matching gold answer."""
    if isinstance(answers, str):  # a bare string would be scored per character
        raise ScoringError("answers must be a sequence of strings, not one string")
    if not answers:
        raise ScoringError("no gold answers to score against")
    prediction_tokens = normalize_answer(prediction).split()
    return max(token_f1(prediction_tokens, normalize_answer(gold).split()) for gold in answers)


@dataclass(frozen=True)
class TaskScore:
    task: QATask
    num_items: int
    f1_percent: float  # mean item F1 × 100, LongBench's reported number (before its 2-decimal rounding)
    item_f1s: tuple[float, ...]  # per item, in the order the items were given


def score(predictions: Sequence[str], items: Sequence[QAItem]) -> dict[QATask, TaskScore]:
    """Per-task LongBench F1 of `predictions[i]` answering `items[i]`."""
    if isinstance(predictions, str):
        raise ScoringError("predictions must be a sequence of strings, not one string")
    if len(predictions) != len(items):
        raise ScoringError(f"{len(predictions)} predictions for {len(items)} items")
    per_task: dict[QATask, list[float]] = {}
    for prediction, item in zip(predictions, items):
        if not isinstance(prediction, str):
            raise ScoringError(f"prediction for {item.task.value}/{item.id} is {type(prediction).__name__}, "
                               "not a string")
        try:
            f1 = qa_f1(prediction, item.answers)
        except ScoringError as exc:
            raise ScoringError(f"{item.task.value}/{item.id}: {exc}") from None
        per_task.setdefault(item.task, []).append(f1)
    return {task: TaskScore(task=task, num_items=len(f1s), f1_percent=100 * sum(f1s) / len(f1s),
                            item_f1s=tuple(f1s))
            for task, f1s in per_task.items()}
