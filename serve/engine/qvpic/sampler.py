"""One sequence's next token from its logits row, and whether the token ends it: the request's decoding controls
applied in order — penalties and logit bias (pipeline/runtime/sampling.py), the JSON-schema grammar's mask
(serve/engine/grammar.py), greedy or seeded sampling — then the endings a token can cause (end of turn, a
completed grammar or stop string, max_new_tokens). The engine (serve/engine/qvpic/engine.py) calls it for every row of
every step; each sequence's seeded sampler lives here until the sequence leaves."""

from __future__ import annotations

import torch

from pipeline.runtime import VLM, adjust_logits, choose_token, token_logprobs
from serve.engine.grammar import Grammars, advance
from serve.engine.sequence import End, Sequence


class Sampler:
    def __init__(self, vlm: VLM):
        self.vlm = vlm
        self._grammars: Grammars | None = None  # built at the first structured-output request
        self._samplers: dict[int, torch.Generator] = {}  # seeded sequences' generators, by sequence id

    @property
    def grammars(self) -> Grammars:
        """llguidance's view of this model's tokenizer (built once, on first use: it reads the whole vocabulary)."""
        if self._grammars is None:
            self._grammars = Grammars(self.vlm.tokenizer, self.vlm.vocab_size, self.vlm.adapter.end_of_turn_ids)
        return self._grammars

    def token(self, seq: Sequence, row: torch.Tensor, best: int) -> int:
        """The next token from `row` `[vocab]` (`best`: its argmax), read back at once: one row alone."""
        chosen = self.choose(seq, row)
        token = best if chosen is None else int(chosen)
        self.logprobs(seq, row, token)
        return token

    def choose(self, seq: Sequence, row: torch.Tensor) -> torch.Tensor | None:
        """The next token from `row` `[vocab]` as a 0-d tensor on its device, not read back: the engine reads the
        whole batch's choices in one transfer a step. None: the row's own argmax (the batch computes those at once)."""
        sampling = seq.sampling
        if not sampling.adjusts_logits and seq.grammar is None and sampling.temperature == 0:
            return None
        if sampling.adjusts_logits:  # penalties / bias: this row's choice is not the batch's argmax
            row = adjust_logits(row, seq.token_ids, sampling)
        if seq.grammar is not None:  # structured output: only what the JSON schema allows next
            row = self.grammars.mask(seq.grammar, row)
        return choose_token(row.unsqueeze(0), sampling, self._sampler(seq))

    def logprobs(self, seq: Sequence, raw: torch.Tensor, token: int) -> None:
        """`token`'s log-probability (and the top ones) under `raw`, the model's own distribution (vLLM's default,
        raw_logprobs), kept on `seq` when it asked for them (a host read of its own: a few numbers a row)."""
        if seq.sampling.logprobs is not None and token not in self.vlm.adapter.end_of_turn_ids:
            seq.token_logprobs.append(token_logprobs(raw, token, seq.sampling.logprobs))

    def ending(self, seq: Sequence, token: int) -> End | None:
        """How `token`, just emitted, ends the sequence (None: it goes on)."""
        if seq.grammar is not None and advance(seq.grammar, token):
            return End.STOP  # the JSON is complete: nothing may follow
        if seq.stops is not None and seq.stops.add(token).matched:
            return End.STOP  # a stop string completed: no more decode steps for it
        if len(seq.token_ids) >= seq.sampling.max_new_tokens:
            return End.LENGTH
        return None

    def forget(self, seq_id: int | None = None) -> None:
        """A sequence left (None: every one did)."""
        if seq_id is None:
            self._samplers.clear()
        else:
            self._samplers.pop(seq_id, None)

    def _sampler(self, seq: Sequence) -> torch.Generator | None:
        if seq.sampling.seed is None:
            return None
        if seq.id not in self._samplers:
            self._samplers[seq.id] = torch.Generator(device=self.vlm.device).manual_seed(seq.sampling.seed)
        return self._samplers[seq.id]
