"""Generator: holds the VLM and its batching engine; a request's context is built, submitted, streamed.

Linked modes (qvpic, uniform, uniform_high, image_pic, image_pic_dummy, text_pic, text_pic_plain) place
the loaded KV after the serving prefix — the chat-template prefix and the request's instruction, computed
once per distinct instruction — re-anchor it, and prefill only the text after the chunks (the query
prompt, or the query) and the turn's closing. The online modes prefill everything, the instruction
first: full_text the chunks' source text, full_image their pages — rendered with the store's
RenderSpec (or, for a scanned page, its own image scaled) at the tier the router chose. Those are
the pages and tiers qvpic links, so full_image is qvpic's exact, uncached reference and the gap
between the two is the cost (or error) of caching alone.

A request reads as context → submit → stream: its chunk KV comes from the device hot tier
(serve/kv/hot_tier.py), its misses from the loader; the engine (serve/engine/) runs it in one batch with
every other request in flight, a token per step, and this side detokenises incrementally. A caller
that goes away (cancelled, or its stream closed) cancels the request: the engine drops it at its next
step and frees its KV. Past its deadline it ends with 504.

The context's chunk KV comes through `ContextBuilder` (serve/engine/context.py), which rebuilds an
entry the loader could not read, or a lazily compiled tier's pending one, through `Repairer`
(serve/engine/repair.py); the report is serve/engine/report.py's. Serve collects `record_routing_stats`
(what the hot tier holds) for the request router across replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import torch

from pipeline.runtime import VLM, Renderer, check_store, in_passing_thread, serial_here
from pipeline.store import Store, check_device
from schemas.config import EngineConfig, EngineKind
from schemas.decoding import ChoiceLogprobs, TokenLogprob, TopLogprob
from schemas.errors import DeadlineExceededError, InvalidRequestError
from schemas.sampling import Sampling
from schemas.service import CacheStats
from serve.config import GeneratorConfig
from serve.engine.context import ContextBuilder
from serve.engine.detokenizer import Detokenizer, token_text
from serve.engine.interface import Engine, EngineStats, PrefixCacheStats
from serve.engine.prepared import PreparedContext
from serve.engine.qvpic import QvpicEngine
from serve.engine.qvpic.engine import column_nbytes
from serve.engine.repair import Repairer
from serve.engine.report import FINISH, answer_report
from serve.engine.sequence import End, Finished, Sequence
from serve.engine.shares import TenantShares
from serve.engine.stops import Step, StopMatcher
from serve.kv import HotTier, KVSource, LocalLoader
from serve.plan import Answer, Choice, Plan, TextDelta


def text_of(step: str | Step) -> str:
    """A detokenizer's piece, or what a stop matcher lets through."""
    return step if isinstance(step, str) else step.text


def forward_threads(configured: int | None, reserved_cpus: float | None) -> int | None:
    """Torch threads for this replica's forwards: `configured` (`engine.forward.threads`), else the replica's CPU
    reservation rounded up (at least 1); None outside a Ray replica (no reservation: torch's own default stays)."""
    if configured is not None:
        return configured
    return None if not reserved_cpus else max(1, math.ceil(reserved_cpus - 1e-9))


def reserved_cpus() -> float | None:
    """The CPUs Ray reserved for this process's actor (None in a driver or without Ray)."""
    import ray

    if not ray.is_initialized() or ray.get_runtime_context().worker.mode != ray.WORKER_MODE:
        return None
    return ray.get_runtime_context().get_assigned_resources().get("CPU")


def build_engine(vlm: VLM, config: EngineConfig) -> Engine:
    """The engine `config.kind` names, on `vlm`'s checkpoint."""
    if config.kind is EngineKind.VLLM:
        from serve.engine.vllm import VllmEngine  # imports vllm: only where it is installed and asked for

        return VllmEngine(vlm, config)
    return QvpicEngine(vlm, config)


def load_model(config: GeneratorConfig) -> VLM:
    """The generator's model, its weights where its engine wants them: vLLM's engine holds its own copy on the GPU, so
    this one stays in host memory there (ModelSpec.weights_for); qvpic's runs every forward on it, on the device."""
    return VLM(config.model.weights_for(config.engine.kind))


class Generator:
    def __init__(self, config: GeneratorConfig, source: KVSource | None = None):
        """`source`: where the device tier's misses are read from (serve/kv/source.py); None: every request must
        bring its own (`generate(..., source=...)`)."""
        self.config = config
        reserved = reserved_cpus()
        threads = forward_threads(config.engine.forward.threads, reserved)
        if threads is not None:
            torch.set_num_threads(threads)  # every thread's default from here on, the engine's included
        # The load, the serving prefix and any warm-up run parallel kernels: on a thread that ends, so that the
        # engine's thread holds the process's only OpenMP pool (pipeline/runtime/threads.py: a bf16 token 9.7
        # against 15.6 ms otherwise)
        in_passing_thread(self._build, config, source, name="qvpic-generator-start")
        if reserved is not None:  # a Serve replica: this thread runs its event loop for as long as it lives. A
            serial_here()  # script's thread is left as it was (its own forwards would run on one thread)

    def _build(self, config: GeneratorConfig, source: KVSource | None) -> None:
        store = Store.open(config.store)
        manifest = store.load_manifest_or_raise()
        check_store(manifest, config.model)
        self.vlm = load_model(config)
        check_device(manifest.kv_quant, self.vlm.device)  # it dequantises the store's entries there
        renderer = Renderer(manifest.render)
        self.prefix_tokens = self.vlm.prefix.num_tokens  # the serving prefix KV, computed here once
        self.source = source.opened() if source is not None else None  # in_generator: this replica's own loader
        self.engine = build_engine(self.vlm, config.engine)  # the Engine this generator drives
        engine = self.engine.config  # its caps as resolved at start (max_kv_nbytes: null is sized to the device)
        self.kv_column_nbytes = column_nbytes(self.vlm)
        self.shares = TenantShares(engine.max_tenant_share, engine.max_batch_size, engine.max_kv_nbytes)
        self.repairer = Repairer(store, manifest, self.vlm, renderer, self.engine.model_lock, config.images_root)
        self.contexts = ContextBuilder(self.vlm, renderer, manifest.render, HotTier(config.engine.hot_tier_nbytes),
                                       config.recompute, self.repairer, config.images_root)

    async def generate(self, plan: Plan, sampling: Sampling, timeout_s: float | None = None, *,
                       source: KVSource | None = None) -> Answer:
        async with contextlib.aclosing(self.stream(plan, sampling, timeout_s, source=source)) as events:
            async for event in events:
                if isinstance(event, Answer):
                    return event
        raise RuntimeError("the stream ended without an answer")

    async def stream(self, plan: Plan, sampling: Sampling, timeout_s: float | None = None, *,
                     source: KVSource | None = None) -> AsyncIterator[str | Answer]:
        """Answer text deltas as tokens decode, then the `Answer` (full text and report).

        `source`: read the device tier's misses from it instead of this generator's own (in-process use)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        vocab = self.vlm.vocab_size
        if sampling.logit_bias and sampling.logit_bias[-1][0] >= vocab:  # sorted by id: the last is the largest
            error = InvalidRequestError(f"logit_bias: token id {sampling.logit_bias[-1][0]} is past this model's "
                                        f"vocabulary (ids 0..{vocab - 1})")
            error.param = "logit_bias"  # OpenAI's error names the field
            raise error
        if sampling.stop_token_ids and sampling.stop_token_ids[-1] >= vocab:  # sorted too
            error = InvalidRequestError(f"stop_token_ids: token id {sampling.stop_token_ids[-1]} is past this "
                                        f"model's vocabulary (ids 0..{vocab - 1})")
            error.param = "stop_token_ids"
            raise error
        try:
            async with asyncio.timeout(timeout_s):
                context = await self.contexts.build(plan, source or self.source)
        except TimeoutError:
            raise DeadlineExceededError(f"the request passed its {timeout_s:.3g} s deadline while loading") from None
        prefill = context.prefill
        # the tenant's share of the engine: n rows, each able to fill its prompt and max_new_tokens - 1 columns
        nbytes = sampling.n * (prefill.num_prompt_tokens + sampling.max_new_tokens - 1) * self.kv_column_nbytes
        async with self.shares.hold(plan.cache_salt, sampling.n, nbytes, deadline):
            loop = asyncio.get_running_loop()
            runs = [Run(self, sampling.choice(i), prefill, deadline, loop) for i in range(sampling.n)]
            leader = runs[0].seq
            leader.forks = [run.seq for run in runs[1:]]  # prefilled once, decoded as n rows
            self.engine.add(leader)  # a grammar that does not compile is a 400 here, before anything is queued
            try:
                async for piece in runs[0].pieces(timeout_s) if len(runs) == 1 else merged(runs, timeout_s):
                    yield piece
                first, *others = runs
                yield Answer(text=first.text, report=answer_report(plan, context, leader, prefill.after.num_tokens),
                             logprobs=first.logprobs(), choices=tuple(run.choice() for run in others))
            finally:
                for run in runs:
                    self.engine.abort(run.seq)  # a no-op once finished; else the caller went away: the row leaves

    def generate_blocking(self, plan: Plan, sampling: Sampling, *, source: KVSource | None = None) -> Answer:
        """`generate` for callers without an event loop (scripts, evaluation, tests)."""
        return asyncio.run(self.generate(plan, sampling, source=source))

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def hot_tier_stats(self) -> CacheStats:
        return self.contexts.hot.stats()

    def loader_stats(self) -> CacheStats:
        """The host LRU of this replica's own loader (loader_placement in_generator)."""
        if not isinstance(self.source, LocalLoader):
            raise RuntimeError("this generator has no loader of its own: ask the CacheLoader deployment")
        return self.source.loader.stats()

    def clear_hot_tier(self) -> None:
        """Drop the chunk KV resident on the device: the next request loads every entry (a cold measurement)."""
        self.contexts.hot.clear()

    def record_routing_stats(self) -> dict[str, Any]:
        """What Serve collects from this replica for the chunk-affinity router (serve/dispatch/affinity.py):
        its hot tier's key sketch and counters."""
        return self.contexts.hot.report().to_stats()

    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.engine.stats().prefix_cache

    def clear_prefix_cache(self) -> None:
        """Drop the prefix KV cache (a cold measurement)."""
        self.engine.clear_prefix_cache()


async def merged(runs: list[Run], timeout_s: float | None) -> AsyncIterator[TextDelta]:
    """n choices' pieces as each decodes, every piece marked with its choice's `index`; the first failure raised."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, run: Run) -> None:
        try:
            async for piece in run.pieces(timeout_s):
                piece.index = index
                queue.put_nowait(piece)
        except Exception as error:  # noqa: BLE001  handed to the reader, which raises it
            queue.put_nowait(error)
            return
        queue.put_nowait(None)  # this choice is done

    tasks = [asyncio.create_task(pump(i, run)) for i, run in enumerate(runs)]
    try:
        done = 0
        while done < len(runs):
            item = await queue.get()
            if item is None:
                done += 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


class Run:
    """One choice of a request: its engine sequence, and the request side of its events — the text as it decodes
    (stop strings cut, log-probabilities attached) and how it ended."""

    def __init__(self, generator: Generator, sampling: Sampling, prefill: PreparedContext, deadline: float | None,
                 loop: asyncio.AbstractEventLoop):
        self.tokenizer = generator.vlm.tokenizer
        self.sampling = sampling
        self.events: asyncio.Queue = asyncio.Queue()
        self.seq = Sequence(sampling, prefill, prefill.num_prompt_tokens, prefill.num_query_tokens, deadline=deadline,
                            emit=lambda event: loop.call_soon_threadsafe(self.events.put_nowait, event))
        # the engine ends decoding at a stop string; this matcher cuts the text the same way
        self.detokenizer = (StopMatcher(self.tokenizer, sampling.stop, sampling.include_stop_str_in_output,
                                        sampling.skip_special_tokens) if sampling.stop
                            else Detokenizer(self.tokenizer, sampling.skip_special_tokens))
        self.text = ""
        # sent: tokens whose log-probabilities went out with a piece; received: tokens delivered so far (the engine
        # appends a token's log-probabilities before it delivers the token, and may run ahead of this loop)
        self.sent = self.received = 0

    async def pieces(self, timeout_s: float | None) -> AsyncIterator[TextDelta]:
        """The answer's text as it decodes; raises when the sequence ended by deadline or failure."""
        seq = self.seq
        while not isinstance(event := await self.events.get(), Finished):
            self.received += 1
            if piece := text_of(self.detokenizer.add(event)):
                yield self.delta(piece)
        if event.end is End.DEADLINE:
            raise DeadlineExceededError(f"the request passed its {timeout_s:.3g} s deadline; its decoding stopped "
                                        f"after {len(seq.token_ids)} tokens")
        if event.end is not End.STOP and event.end is not End.LENGTH:
            raise event.error or RuntimeError(f"generation ended: {event.end.value}")
        if piece := text_of(self.detokenizer.flush()):
            yield self.delta(piece)  # any tokens after it (a stop string's) come with the answer

    def delta(self, piece: str) -> TextDelta:
        self.text += piece
        out = TextDelta(piece)
        if self.sampling.logprobs is not None:
            out.logprobs = tuple(self.entries(self.sent, self.received))
            self.sent = self.received
        return out

    def logprobs(self) -> ChoiceLogprobs | None:
        """Each emitted token's log-probability and alternatives (the engine's), with their text and bytes."""
        if self.sampling.logprobs is None:
            return None
        return ChoiceLogprobs(content=self.entries(0, len(self.seq.token_logprobs)))

    def entries(self, start: int, end: int) -> list[TokenLogprob]:
        """Tokens `start..end` of the answer as OpenAI's logprobs entries."""
        def entry(token: int, logprob: float) -> dict:
            text, raw = token_text(self.tokenizer, token)
            return {"token": text, "logprob": logprob, "bytes": raw}
        seq = self.seq
        return [TokenLogprob(**entry(token, logprob), top_logprobs=[TopLogprob(**entry(t, lp)) for t, lp in top])
                for token, (logprob, top) in zip(seq.token_ids[start:end], seq.token_logprobs[start:end])]

    def choice(self) -> Choice:
        """A choice beside the first: its text, how it ended, its tokens."""
        return Choice(text=self.text, finish_reason=FINISH[self.seq.end], completion_tokens=len(self.seq.token_ids),
                      logprobs=self.logprobs())
