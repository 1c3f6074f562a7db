"""qvpic's engine end to end on the device: 16 linked requests joining a running batch one after another (every
other step), on tiny-qwen (fp32): each request's TTFT (submitted to its first token) and the ms between its tokens
(p50 / p99 over all of them), host syncs per decode step, and the caching allocator's memory, reserved against
allocated at the peak. Correctness beside it: every request ends as asked, and the first four give the tokens they
give when each runs alone on a fresh engine (greedy: batching must not change an answer).

Needs the engine's modules (pydantic, Pillow, llguidance, prometheus_client: `--wheels`) and the tiny checkpoint
(carried in gpu_check_models/, as the exactness step's)."""

from __future__ import annotations

import random
import statistics
import time

import torch

from benchmarks.gpu_check.common import Context, Record, need
from benchmarks.gpu_check.exactness import load

REQUESTS, JOIN_EVERY_STEPS, NEW_TOKENS, ALONE = 16, 2, 24, 4
DRY = dict(requests=6, new_tokens=6, alone=2)  # --dry on CI's CPU: the same path, a few seconds
TEXTS = ("Invoice 4471 ships on 12 March from the Rotterdam warehouse.",
         "The warranty covers two years of normal use, parts and labour.",
         "Hold the reset button for ten seconds until the light blinks.",
         "Part QZ-19 ships on 3 April; part XK-4471-B ships in May.",
         "Bake the loaf at 220 degrees for thirty minutes, then rest it.",
         "Revenue grew fastest in the northern region in the third quarter.")
QUESTIONS = ("When does it ship?", "What does the warranty cover?", "How do I reset it?", "Which region grew?")


def contexts(vlm, count: int, seed: int = 0) -> list:
    """`count` linked contexts: 2-4 of the compiled chunks in a shuffled order each, one of the questions."""
    from serve.engine.prepared import LinkedContext
    from serve.engine.qvpic.linked_prompt import native_prompt

    chunks = [vlm.compile_text(text) for text in TEXTS]
    rng = random.Random(seed)
    made = []
    for i in range(count):
        picked = rng.sample(chunks, rng.randint(2, 4))
        made.append(LinkedContext(native_prompt(vlm, picked, QUESTIONS[i % len(QUESTIONS)], ""), b""))
    return made


class Timed:
    """One request's tokens and when each came (the engine's emit runs on the stepping thread)."""

    def __init__(self, context, new_tokens: int):
        from schemas.sampling import Sampling
        from serve.engine.sequence import Sequence

        self.tokens, self.times, self.finished = [], [], None
        self.seq = Sequence(Sampling(max_new_tokens=new_tokens), context, context.num_prompt_tokens,
                            context.num_query_tokens, emit=self.emit)

    def emit(self, event) -> None:
        if isinstance(event, int):
            self.tokens.append(event)
            self.times.append(time.perf_counter())
        else:
            self.finished = event

    def submit(self, engine) -> None:
        self.submitted = time.perf_counter()
        engine.add(self.seq)


def drain(engine, pending: list[Timed] = (), every: int = 1, per_step=None) -> int:
    """Step `engine` until it is idle, submitting one of `pending` every `every` steps; `per_step(step)` runs each
    step (it may wrap it); the steps taken."""
    pending, steps = list(pending), 0
    while pending or engine.scheduler.busy:
        if pending and steps % every == 0:
            pending.pop(0).submit(engine)
        (per_step or (lambda step: step()))(engine.step)
        steps += 1
    return steps


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def engine(ctx: Context, out: Record) -> None:
    need("pydantic", "PIL", "llguidance", "prometheus_client", "serve.engine.qvpic.engine")
    from schemas.config import EngineConfig
    from serve.engine.qvpic.engine import QvpicEngine

    requests, new_tokens, alone_count = (DRY["requests"], DRY["new_tokens"], DRY["alone"]) if ctx.dry else \
        (REQUESTS, NEW_TOKENS, ALONE)
    vlm = load("tiny-qwen", str(ctx.device))
    config = EngineConfig(max_batch_size=REQUESTS, max_kv_nbytes=1 << 30)
    made = contexts(vlm, requests)
    warm = QvpicEngine(vlm, config, start=False)  # kernels, allocator pools and the rotation table warmed first
    drain(warm, [Timed(c, new_tokens) for c in made[:2]])
    if ctx.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    batch = QvpicEngine(vlm, config, start=False)
    timed = [Timed(c, new_tokens) for c in made]
    syncs: list[int] = []

    def step_counting(step) -> None:
        decoding = bool(batch.scheduler.running) and not batch.scheduler.waiting and batch.scheduler.prefilling is None
        if ctx.cuda and decoding:
            from benchmarks.gpu_check.decode import syncs_per_step

            syncs.append(syncs_per_step(step))
        else:
            step()

    steps = drain(batch, timed, JOIN_EVERY_STEPS, step_counting)
    out.set("steps", steps)
    ended = [t.finished.end.value if t.finished is not None else None for t in timed]
    out.check("every request ended as asked (length or stop)", all(e in ("length", "stop") for e in ended),
              ended=ended)
    ttft = [(t.times[0] - t.submitted) * 1e3 for t in timed if t.times]
    gaps = [(b - a) * 1e3 for t in timed for a, b in zip(t.times, t.times[1:])]
    out.set("ttft_ms", {"p50": round(statistics.median(ttft), 2), "p99": round(percentile(ttft, 0.99), 2)})
    out.set("ms_per_token", {"p50": round(statistics.median(gaps), 2), "p99": round(percentile(gaps, 0.99), 2)})
    if syncs:
        out.set("syncs_per_decode_step", {"median": statistics.median(syncs), "max": max(syncs)})
    if ctx.cuda:
        out.set("memory_bytes", {"peak_allocated": torch.cuda.max_memory_allocated(),
                                 "peak_reserved": torch.cuda.max_memory_reserved(),
                                 "reserved_now": torch.cuda.memory_reserved()})
    for i, t in enumerate(timed[:alone_count]):
        alone = Timed(made[i], new_tokens)
        drain(QvpicEngine(vlm, config, start=False), [alone])
        out.check(f"request {i}: batched = alone", alone.tokens == t.tokens, batched=t.tokens[:8],
                  alone=alone.tokens[:8])
    out.set("headline", f"TTFT p50 {out.data['ttft_ms']['p50']} ms, {out.data['ms_per_token']['p50']} ms/token p50 "
                        f"over {requests} staggered requests; {len(out.failures)} check(s) failed")
