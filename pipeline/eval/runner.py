"""Runs QA items through serving configurations under a controlled cache state, and summarises them.

Cache state. The serving roles keep linked KV between requests: the generator's device hot tier and
the loader's host cache. Left alone, a configuration measured right after another one that linked the
same entries (qvpic after uniform_high) finds them hot, and the order of the grid decides who pays the
store reads. So every (item, configuration) is measured twice: **cold**, after `clear_caches` emptied
both caches (its KV is read from the store; the OS page cache of the store's files is not ours to
drop), then **warm**, the same request again at once. The configurations of each item run in an order
shuffled with a seeded generator (the seed is recorded; each result keeps its position), after one
warm-up pass of the first item through every configuration, which pays first-call costs (allocator
growth, lazy initialisation) outside any measurement. A harness that cannot empty the caches (a remote
service over HTTP) passes no `clear_caches`: its "cold" figures are first requests, and say so.

Over-length items. LongBench's `pred.py` truncates a prompt over the model's limit in the middle: it
keeps the first and the last half of the limit's tokens (THUDM/LongBench, `pred.py`: `half =
int(max_length/2); prompt = tokenizer.decode(tokenized_prompt[:half]) +
tokenizer.decode(tokenized_prompt[-half:])`). A request here is built of stored chunks, so the cut is by
whole chunks: the most chunks that fit (the server says 413 otherwise), the first half of them from the
start of the context and the rest from its end; instruction and question are kept, as `pred.py` keeps
the prompt's ends. Each result counts the chunks dropped, so the truncations are reported per mode.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

from pipeline.eval.evaluation import Answered, Answerer, ServingSpec, StoreView, item_request
from pipeline.eval.longbench import QAItem, QATask
from pipeline.eval.scoring import qa_f1, score
from schemas.api import AnswerRequest
from schemas.errors import ApiError, TooLargeError
from schemas.modes import Mode

CacheClear = Callable[[], None]  # empties every cache between a request and the store


@dataclass(frozen=True)
class ItemResult:
    task: QATask
    item_id: str
    config: str  # ServingSpec.name
    mode: Mode
    prediction: str  # "" when the request failed
    f1: float  # LongBench QA F1 in [0, 1]; a failed request scores 0, so the denominator never shrinks
    ttft_ms: float | None  # cold: caches emptied first (see the module docstring)
    context_tokens: int | None
    vision_tokens: int | None
    num_high: int | None  # chunks served at the high tier
    kv_nbytes: int | None  # KV bytes linked into the context
    timings: dict[str, float] | None  # of the cold request
    error: str | None = None
    response_cache: str | None = None  # the server's response-cache level that answered, if one did
    ttft_warm_ms: float | None = None  # the same request again, right after the cold one
    cache: dict[str, int] | None = None  # the cold request's CacheReport: where each linked entry came from
    cache_warm: dict[str, int] | None = None
    fallbacks: tuple[dict[str, str], ...] = ()  # FallbackReports: chunks served at another tier than planned
    num_chunks_dropped: int = 0  # truncated from the middle of an over-length context
    position: int | None = None  # the configuration's place in its item's shuffled order


def middle_cut(chunk_ids: Sequence[str], keep: int) -> list[str]:
    """`keep` chunks: the first ⌈keep/2⌉ and the last ⌊keep/2⌋ (pred.py keeps the prompt's two ends)."""
    head = (keep + 1) // 2
    return list(chunk_ids[:head]) + list(chunk_ids[len(chunk_ids) - (keep - head):])


def _over_length(error: ApiError) -> bool:
    return getattr(error, "status_code", None) == TooLargeError.status_code


def answer_truncated(answer: Answerer, request: AnswerRequest,
                     clear: CacheClear) -> tuple[Answered, AnswerRequest]:
    """`request` answered cold, whole or cut in the middle to the most chunks that fit; (answer, request answered).

    Binary search over how many chunks to keep: an over-length request is refused while routing, before
    any KV moves, so the probes that fail leave the caches as the last success left them, and the last
    success is the largest that fits."""
    clear()
    try:
        return answer(request), request
    except ApiError as error:
        if not _over_length(error) or len(request.chunk_ids or ()) < 2:
            raise
        last_error = error
    chunk_ids = list(request.chunk_ids)
    low, high, best = 1, len(chunk_ids) - 1, None
    while low <= high:
        keep = (low + high + 1) // 2
        clear()
        try:
            cut = request.model_copy(update={"chunk_ids": middle_cut(chunk_ids, keep)})
            best = (answer(cut), cut)
            low = keep + 1
        except ApiError as error:
            if not _over_length(error):
                raise
            last_error, high = error, keep - 1
    if best is None:
        raise last_error
    return best


def _result(item: QAItem, serving: ServingSpec, view: StoreView, cold: Answered, warm: Answered | None,
            dropped: int, position: int) -> ItemResult:
    report = cold.report
    return ItemResult(
        item.task, item.id, serving.name, serving.mode, cold.text, qa_f1(cold.text, item.answers), cold.ttft_ms,
        report.usage.context_tokens, report.usage.context_vision_tokens,
        sum(c.tier == view.high_tier for c in report.chunks), view.linked_nbytes(report), report.timings.model_dump(),
        None, report.response_cache.level.value if report.response_cache.level else None,
        warm.ttft_ms if warm else None, report.cache.model_dump(), warm.report.cache.model_dump() if warm else None,
        tuple(f.model_dump() for f in report.fallbacks), dropped, position)


def run(items: Sequence[QAItem], configs: Sequence[ServingSpec | Mode], answer: Answerer, view: StoreView, *,
        clear_caches: CacheClear | None = None, seed: int = 0, max_new_tokens: int | None = None,
        progress: bool = True) -> list[ItemResult]:
    """Every item through every configuration (a bare mode: the server's routing defaults), cold then warm,
    configurations shuffled per item by `random.Random(seed)` after one warm-up pass (module docstring).
    Results come in item order, each item's configurations in the given order."""
    view.check(items)
    configs = [c if isinstance(c, ServingSpec) else ServingSpec.of(c) for c in configs]
    clear = clear_caches or (lambda: None)
    rng = random.Random(seed)
    results = []
    for config in configs if items else []:  # warm-up: first-call costs, never measured
        try:
            answer(item_request(items[0], view, config, max_new_tokens))
        except ApiError:
            pass  # measured (and recorded) below
    with tqdm(total=len(items) * len(configs), desc="eval", unit="req", disable=not progress) as bar:
        for item in items:
            order = rng.sample(range(len(configs)), len(configs))
            measured: dict[int, ItemResult] = {}
            for position, index in enumerate(order):
                config = configs[index]
                request = item_request(item, view, config, max_new_tokens)
                try:
                    cold, answered = answer_truncated(answer, request, clear)
                    warm = answer(answered)
                    dropped = len(request.chunk_ids or ()) - len(answered.chunk_ids or ())
                except ApiError as error:
                    measured[index] = ItemResult(item.task, item.id, config.name, config.mode, "", 0.0, None, None,
                                                 None, None, None, None, f"{type(error).__name__}: {error}",
                                                 position=position)
                else:
                    measured[index] = _result(item, config, view, cold, warm, dropped, position)
                bar.update()
            results += [measured[i] for i in range(len(configs))]
    return results


def protocol(cache_controlled: bool, seed: int, summaries: Sequence[ModeSummary]) -> dict[str, str]:
    """How `run` measured, for a report's header: cache state, order, chunks and truncations."""
    truncated = [f"{s.config} {s.num_truncated}" for s in summaries if s.task == "all" and s.num_truncated]
    return {
        "cache state": "cold: device hot tier and loader host cache emptied first, KV read from the store; warm: "
        "the same request again at once" if cache_controlled else "cold: the first request of each (item, "
        "configuration), the server's caches as they were (not controllable over HTTP); warm: the same again",
        "order": f"configurations shuffled per item (seed {seed}) after one warm-up pass",
        "chunks": "each item's whole context in document order (chunk_ids; top_k requests assemble in retrieval "
        "order unless `order: source`); over-length contexts cut in the middle by whole chunks (LongBench "
        "pred.py); truncated items per configuration: " + (", ".join(truncated) or "none"),
    }


@dataclass(frozen=True)
class ModeSummary:
    task: str  # a task name, or "all" (F1 = mean over tasks, as LongBench averages)
    config: str
    mode: Mode
    num_items: int
    num_errors: int
    f1_percent: float
    ttft_median_ms: float | None  # cold
    ttft_p90_ms: float | None  # cold
    context_tokens_median: float | None
    vision_tokens_median: float | None
    kv_nbytes_median: float | None
    num_high_median: float | None
    ttft_warm_median_ms: float | None = None
    render_median_ms: float | None = None  # of the cold requests (full_image renders pages online)
    prefill_median_ms: float | None = None
    num_truncated: int = 0  # items cut in the middle to fit the context
    num_fallbacks: int = 0  # chunks served at another tier than planned, over all items


def _median(values: list[Any]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _summary(task: str, results: list[ItemResult], f1_percent: float) -> ModeSummary:
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft_ms for r in ok]
    return ModeSummary(task, results[0].config, results[0].mode, len(results), len(results) - len(ok), f1_percent,
                       _median(ttfts), float(np.percentile(ttfts, 90)) if ttfts else None,
                       _median([r.context_tokens for r in ok]), _median([r.vision_tokens for r in ok]),
                       _median([r.kv_nbytes for r in ok]), _median([r.num_high for r in ok]),
                       _median([r.ttft_warm_ms for r in ok]), _phase(ok, "render_ms"), _phase(ok, "prefill_ms"),
                       sum(r.num_chunks_dropped > 0 for r in ok), sum(len(r.fallbacks) for r in ok))


def _phase(results: list[ItemResult], name: str) -> float | None:
    return _median([(r.timings or {}).get(name) for r in results])


def summarize(items: Sequence[QAItem], results: Sequence[ItemResult]) -> list[ModeSummary]:
    """Per task and configuration, then per configuration over all tasks; F1 scored by `pipeline.eval.scoring.score`."""
    by_key = {(r.task, r.item_id, r.config): r for r in results}
    rows = []
    for config in dict.fromkeys(r.config for r in results):
        config_results = [by_key[(item.task, item.id, config)] for item in items]
        scores = score([r.prediction for r in config_results], items)
        for task, task_score in scores.items():
            rows.append(_summary(task.value, [r for r in config_results if r.task is task], task_score.f1_percent))
        rows.append(_summary("all", config_results, statistics.fmean(s.f1_percent for s in scores.values())))
    return rows
