"""vLLM's engine behind qvpic's `Engine` seam (serve/engine/interface.py), with qvpic's KV connector.

vLLM runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, one worker): its scheduler, its worker and qvpic's
connector on both sides share the claims registry (serve/engine/vllm/connector.py). One thread owns vLLM:

    step = take     requests added and aborted since the last step: each added one's prompt and claim are built
                    (serve/engine/vllm/prompt.py: the claim's KV re-anchored here) and handed to vLLM
         → step     vLLM's own step: schedule, load the claimed KV, forward, sample
         → deliver  each request's new tokens to its `Sequence`; stops, deadlines and the end of its turn finish it

A follow-up turn (earlier turns before its chunks) goes to vLLM twice: first its history pass, a prefill-only
request of the tokens before the chunks (vLLM computes them, finding earlier turns' blocks in its prefix cache);
when that ends, the request itself, whose claim — the chunks — starts after them (connector.py: the history's
blocks are held for it and copied where the prefix cache does not share them).

Sampling is vLLM's (temperature, top_p, top_k, min_p, seed, penalties, logit bias, min_tokens, stop_token_ids,
ignore_eos, logprobs); structured output is vLLM's guidance
backend on the Lark grammar qvpic's engine would use (llguidance both); stop strings are qvpic's matcher over the
decoded text, as on qvpic's engine, so both engines cut answers alike. `n` choices are `n` vLLM requests
over one prompt: the first prefills, the others find its blocks in vLLM's prefix cache.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import Counter, deque

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the connector's worker side must run here

from pipeline.runtime import VLM  # noqa: E402
from schemas.config import EngineConfig  # noqa: E402
from schemas.errors import BusyError, TooLargeError  # noqa: E402
from serve.engine.grammar import Grammars  # noqa: E402
from serve.engine.interface import Engine, EngineStats, step_failure  # noqa: E402
from serve.engine.sequence import End, Sequence, Status  # noqa: E402
from serve.engine.stops import StopMatcher  # noqa: E402
from serve.engine.vllm.arguments import cpu_binding, engine_args  # noqa: E402
from serve.engine.vllm.claims import CLAIM_KEY, CLAIMS, HISTORY_KEY, REQUEST_KEY, Claim  # noqa: E402
from serve.engine.vllm.outputs import count_prompt, logprob_entry  # noqa: E402
from serve.engine.vllm.prompt import VllmPrompt, check, vllm_prompt  # noqa: E402

log = logging.getLogger(__name__)
def claim_key(seq: Sequence) -> str:
    """The key of `seq`'s claim in `CLAIMS`, and the prefix of its vLLM request ids."""
    return f"qvpic-{seq.id}"


class VllmEngine(Engine):
    """vLLM with qvpic's connector (serve/engine/interface.py states the contract it keeps)."""

    def __init__(self, vlm: VLM, config: EngineConfig, start: bool = True, **overrides):
        from vllm import EngineArgs, LLMEngine

        ranks = config.tensor_parallel_size
        if ranks > 1 and vlm.device.type == "cpu" and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            from vllm import envs

            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(ranks)
            envs.disable_envs_cache()  # an engine started before in this process froze vLLM's view of the environment
        self.vlm, self.config = vlm, config
        self.engine = LLMEngine.from_engine_args(EngineArgs(**{**engine_args(vlm, config), **overrides}))
        self.model_lock = threading.Lock()  # qvpic's own forwards (a claim's text KV, the repair path)
        self.steps = self.decoded_tokens = 0
        self.ended: Counter[str] = Counter()
        self._work = threading.Condition()
        self._added: deque[Sequence] = deque()
        self._running: dict[str, tuple[Sequence, str]] = {}  # vLLM request id -> (member, its claim's key)
        self._histories: dict[str, tuple[Sequence, VllmPrompt]] = {}  # a history pass's vLLM id -> what follows it
        self._clear_asked = False  # clear_prefix_cache waits for the engine's thread to reset vLLM's
        self.forward_threads = 0
        self.end_ids = set(vlm.adapter.end_of_turn_ids)
        if start:
            threading.Thread(target=self._loop, name="qvpic-vllm-engine", daemon=True).start()

    # ---- the request's side ------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue `seq` and its forks; refused before anything is queued: InvalidRequestError (what only qvpic's
        engine serves, naming it), TooLargeError (past the model's length), BusyError (the queue is full)."""
        check(seq.context)
        checked: set[str] = set()  # n choices share one grammar: compiled once here (vLLM caches its own)
        for member in seq.members:
            grammar = member.sampling.grammar
            if grammar is not None and grammar not in checked:  # one llguidance cannot compile: a 400 naming it
                self.grammars.matcher(grammar, member.sampling.grammar_param)
                checked.add(grammar)
            if member.sampling.stop:
                member.stops = StopMatcher(self.vlm.tokenizer, member.sampling.stop,
                                           skip_special_tokens=member.sampling.skip_special_tokens)
        if seq.max_columns > self.engine.vllm_config.model_config.max_model_len:
            raise TooLargeError(f"the prompt and max_tokens need {seq.max_columns} tokens; this model takes "
                                f"{self.engine.vllm_config.model_config.max_model_len}")
        with self._work:
            if len(self._added) + len(self._running) + len(self._histories) >= \
                    self.config.max_batch_size + self.config.max_waiting:
                raise BusyError("the generator's queue is full")
            self._added.append(seq)
            self._work.notify()

    @functools.cached_property
    def grammars(self) -> Grammars:
        """llguidance's view of the tokenizer, to refuse a bad grammar before anything is queued (vLLM's guidance
        backend compiles the same Lark text again for decoding)."""
        return Grammars(self.vlm.tokenizer, self.vlm.vocab_size, self.vlm.adapter.end_of_turn_ids)

    def abort(self, seq: Sequence) -> None:
        if seq.status is not Status.FINISHED:
            seq.cancel()
            with self._work:
                self._work.notify()

    def clear_prefix_cache(self, timeout_s: float = 10.0) -> None:
        """vLLM's prefix cache reset on the engine's thread (vLLM is not thread-safe), once nothing is in flight."""
        with self._work:
            self._clear_asked = True
            self._work.notify_all()
            if not self._work.wait_for(lambda: not self._clear_asked, timeout=timeout_s):
                raise TimeoutError(f"requests still in flight after {timeout_s} s: the prefix cache was not cleared")

    def stats(self) -> EngineStats:
        with self._work:
            return EngineStats(len(self._running), len(self._added) + len(self._histories), 0, self.steps,
                               self.decoded_tokens,
                               dict(self.ended), self.forward_threads)

    # ---- the engine's thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        import torch

        self.forward_threads = torch.get_num_threads()
        while True:
            with self._work:
                while not (self._added or self._running or self._histories or self._clear_asked or CLAIMS.releasable):
                    self._work.wait()
                idle = not (self._running or self._histories or CLAIMS.holding)  # held blocks are not freeable
                if self._clear_asked and idle:  # before what was added since: it finds a cold cache
                    if not self.engine.reset_prefix_cache():
                        log.warning("vLLM did not reset its prefix cache: blocks were still in use")
                    self._clear_asked = False
                    self._work.notify_all()
                added = list(self._added)
                self._added.clear()
            for seq in added:
                try:
                    self._submit(seq)
                except Exception as error:  # noqa: BLE001  vLLM refused it: it alone fails, the engine goes on
                    log.exception("vLLM did not take a request; it fails alone")
                    self._fail_submission(seq, error)
            try:
                self._retire()
                unfinished = self.engine.has_unfinished_requests()
                if unfinished or CLAIMS.releasable:  # a step hands held blocks back
                    self._deliver(self.engine.step())
                    self.steps += 1
                    if not unfinished and CLAIMS.releasable:  # vLLM did not take them back: no busy loop
                        time.sleep(0.01)
            except Exception as error:  # noqa: BLE001  fail the requests in flight, keep serving
                log.exception("vLLM step failed; the requests in flight end with it")
                failure = step_failure(error)  # out of memory: a 503 to retry
                for request_id, (seq, _) in list(self._running.items()):
                    self._finish(request_id, seq, End.FAILED, failure)

    def _submit(self, seq: Sequence) -> None:
        """`seq`'s prompt and claim built and handed to vLLM: its members, or first its history pass."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        started = time.perf_counter()
        with self.model_lock:  # what raises here fails `seq` alone (_loop: _fail_submission)
            prompt = vllm_prompt(self.vlm, seq.context)
        key = claim_key(seq)
        if prompt.claim_kv is not None:
            CLAIMS.put(key, Claim(prompt.claim_kv, offset=prompt.claim_offset))
        for member in seq.members:
            member.num_prompt_tokens, member.reanchor_ms = prompt.num_tokens, (time.perf_counter() - started) * 1e3
        if prompt.history_ids is None:
            return self._add_members(seq, prompt)
        request_id = f"{key}-history"
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY,
                                extra_args={"kv_transfer_params": {HISTORY_KEY: key}})
        self.engine.add_request(request_id, {"prompt_token_ids": prompt.history_ids,
                                             "cache_salt": self._salt(seq, prompt)}, params)
        with self._work:
            self._histories[request_id] = (seq, prompt)

    @staticmethod
    def _salt(seq: Sequence, prompt: VllmPrompt) -> str:
        """vLLM's prefix-cache salt: the tenant's, and linked apart from online (the same ids are other KV)."""
        return ((b"linked:" if prompt.claim_kv is not None else b"online:") + seq.context.salt).hex()

    def _add_members(self, seq: Sequence, prompt: VllmPrompt) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        key = claim_key(seq)
        for member in seq.members:
            sampling = member.sampling
            request_id = f"{key}-{member.id}"
            params = SamplingParams(
                temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed,
                max_tokens=sampling.max_new_tokens, presence_penalty=sampling.presence_penalty,
                frequency_penalty=sampling.frequency_penalty, logit_bias=dict(sampling.logit_bias) or None,
                logprobs=sampling.logprobs, top_k=sampling.top_k, min_p=sampling.min_p,
                repetition_penalty=sampling.repetition_penalty, min_tokens=sampling.min_tokens,
                ignore_eos=sampling.ignore_eos,  # vLLM masks these stop ids too before min_tokens
                stop_token_ids=sorted(set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else self.end_ids)),
                skip_special_tokens=False,  # qvpic detokenizes (its skip_special_tokens is the generator's)
                output_kind=RequestOutputKind.DELTA, detokenize=False,
                structured_outputs=StructuredOutputsParams(grammar=sampling.grammar) if sampling.grammar else None,
                extra_args={"kv_transfer_params": {CLAIM_KEY: key, REQUEST_KEY: request_id}}
                if prompt.claim_kv is not None else None)
            self.engine.add_request(request_id, {**prompt.prompt, "cache_salt": self._salt(seq, prompt)}, params)
            with self._work:
                self._running[request_id] = (member, key)

    def _history_done(self, request_id: str, output) -> None:
        """A history pass ended: its request follows, with the tokens found in vLLM's prefix cache counted."""
        seq, prompt = self._histories.pop(request_id)
        claim = CLAIMS.get(claim_key(seq))
        if claim is None or claim.history is None:
            raise RuntimeError("vLLM ended a history pass without its blocks")
        claim.history_cached = output.num_cached_tokens or 0
        self._add_members(seq, prompt)

    def _fail_submission(self, seq: Sequence, error: Exception | None, end: End = End.FAILED) -> None:
        """`seq`'s members end (FAILED, unless `end` says otherwise): what vLLM took of it (its history pass, its
        members) is aborted there, the claim is dropped."""
        key = claim_key(seq)
        for request_id, (staged, _) in list(self._histories.items()):
            if staged is seq:
                self.engine.abort_request([request_id])
                del self._histories[request_id]
        for request_id, (member, member_key) in list(self._running.items()):
            if member_key == key:
                self.engine.abort_request([request_id])
                self._finish(request_id, member, end, error)
        for member in seq.members:
            self._finish(None, member, end, error)
        CLAIMS.drop(key)

    def _retire(self) -> None:
        now = time.monotonic()
        for seq, _ in list(self._histories.values()):  # waiting for its history pass
            if any(m.cancelled or m.expired(now) for m in seq.members):
                self._fail_submission(seq, None, End.CANCELLED if any(m.cancelled for m in seq.members)
                                      else End.DEADLINE)
        for request_id, (seq, _) in list(self._running.items()):
            if seq.cancelled or seq.expired(now):
                self.engine.abort_request([request_id])
                self._finish(request_id, seq, End.CANCELLED if seq.cancelled else End.DEADLINE)

    def _deliver(self, outputs) -> None:
        now = time.monotonic()  # Sequence.submitted_at's clock
        for output in outputs:
            if output.request_id in self._histories and output.finished:
                seq = self._histories[output.request_id][0]
                try:
                    self._history_done(output.request_id, output)
                except Exception as error:  # noqa: BLE001  it fails alone
                    log.exception("a history pass did not lead to its request; it fails alone")
                    self._fail_submission(seq, error)
                continue
            if output.request_id not in self._running:
                continue
            seq = self._running[output.request_id][0]
            completion = output.outputs[0]
            elapsed_ms = (now - seq.submitted_at) * 1e3
            if not seq.token_ids and seq.status is Status.WAITING:  # its first tokens: the prompt's accounting
                seq.status = Status.RUNNING
                seq.prefill_ms = elapsed_ms - seq.reanchor_ms  # vLLM's queue and prefill, and the claim's load
                count_prompt(seq, CLAIMS.get(self._running[output.request_id][1]), output)
            else:
                seq.decode_ms = elapsed_ms - seq.reanchor_ms - seq.prefill_ms
            # vLLM's own end: the tokenizer's eos (stop_reason None), which a completed grammar samples; qvpic's
            # engine ends there without a token, so the eos is not delivered either
            eos_at = len(completion.token_ids) - 1 if output.finished and completion.finish_reason == "stop" \
                and completion.stop_reason is None else -1
            for i, token in enumerate(completion.token_ids):
                if (token in self.end_ids and not seq.sampling.ignore_eos) or token in seq.sampling.stop_token_ids \
                        or i == eos_at:
                    self._finish(output.request_id, seq, End.STOP)
                    break
                if seq.sampling.logprobs is not None and completion.logprobs:
                    seq.token_logprobs.append(logprob_entry(completion.logprobs[i], token, seq.sampling.logprobs))
                seq.token_ids.append(token)
                self.decoded_tokens += 1
                seq.deliver(token)
                if seq.stops is not None and seq.stops.add(token).matched:
                    self.engine.abort_request([output.request_id])
                    self._finish(output.request_id, seq, End.STOP)
                    break
            if seq.status is not Status.FINISHED and output.finished:
                self._finish(output.request_id, seq, End.LENGTH if completion.finish_reason == "length"
                             else End.STOP)

    def _finish(self, request_id: str | None, seq: Sequence, end: End, error: Exception | None = None) -> None:
        with self._work:
            _, key = self._running.pop(request_id, (None, None)) if request_id is not None else (None, None)
            if key is not None and all(k != key for _, k in self._running.values()):
                CLAIMS.drop(key)  # its last member ended: vLLM's prefix cache keeps what it loaded
            self._work.notify_all()
        if seq.status is not Status.FINISHED:
            self.ended[end.value] += 1
        seq.finish(end, error)

