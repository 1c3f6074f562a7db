"""One sequence's next token from its logits row, and whether the token ends it: the request's decoding controls
applied in order — logit bias and penalties (pipeline/runtime/sampling.py), min_tokens' mask of the endings, the
grammar's mask (serve/engine/grammar.py), greedy or seeded sampling (min-p, top-k, top-p) — then the endings a
token can cause (end of turn unless ignore_eos, stop_token_ids, a completed grammar or stop string,
max_new_tokens). The engine (serve/engine/qvpic/engine.py) calls it for every row of
every step; each sequence's seeded sampler lives here until the sequence leaves."""

from __future__ import annotations

import torch

from pipeline.runtime import VLM, adjust_logits, ban_tokens, choose_token, token_logprobs, token_mask
from serve.engine.grammar import Grammars, advance
from serve.engine.sequence import End, Sequence


class Sampler:
    def __init__(self, vlm: VLM):
        self.vlm = vlm
        self._grammars: Grammars | None = None  # built at the first structured-output request
        self._samplers: dict[int, torch.Generator] = {}  # seeded sequences' generators, by sequence id
        # by sequence id, built once on the device: the prompt's tokens (repetition_penalty), the endings
        # min_tokens masks (end of turn and stop_token_ids)
        self._prompts: dict[int, torch.Tensor] = {}
        self._ends: dict[int, torch.Tensor] = {}

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
        early = len(seq.token_ids) < sampling.min_tokens  # no ending may be chosen yet
        if not sampling.adjusts_logits and seq.grammar is None and sampling.temperature == 0 and not early:
            return None
        if sampling.adjusts_logits:  # penalties / bias: this row's choice is not the batch's argmax
            row = adjust_logits(row, seq.token_ids, sampling,
                                self._prompt(seq, row) if sampling.repetition_penalty != 1.0 else None)
        if early:
            row = ban_tokens(row, self._endings(seq, row))
        if seq.grammar is not None:  # structured output: only what the JSON schema allows next
            row = self.grammars.mask(seq.grammar, row)
        return choose_token(row.unsqueeze(0), sampling, self._sampler(seq))

    def logprobs(self, seq: Sequence, raw: torch.Tensor, token: int) -> None:
        """`token`'s log-probability (and the top ones) under `raw`, the model's own distribution (vLLM's default,
        raw_logprobs), kept on `seq` when it asked for them (a host read of its own: a few numbers a row)."""
        if seq.sampling.logprobs is not None and not self.ends_turn(seq, token):
            seq.token_logprobs.append(token_logprobs(raw, token, seq.sampling.logprobs))

    def ends_turn(self, seq: Sequence, token: int) -> bool:
        """Whether `token` ends the answer unseen: end of turn (unless ignore_eos), or one of stop_token_ids."""
        sampling = seq.sampling
        return ((token in self.vlm.adapter.end_of_turn_ids and not sampling.ignore_eos)
                or token in sampling.stop_token_ids)

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
        for kept in (self._samplers, self._prompts, self._ends):
            if seq_id is None:
                kept.clear()
            else:
                kept.pop(seq_id, None)

    def _prompt(self, seq: Sequence, row: torch.Tensor) -> torch.Tensor:
        if seq.id not in self._prompts:
            self._prompts[seq.id] = token_mask(prompt_token_ids(seq.context), row.shape[-1], row.device)
        return self._prompts[seq.id]

    def _endings(self, seq: Sequence, row: torch.Tensor) -> torch.Tensor:
        if seq.id not in self._ends:
            ends = set(seq.sampling.stop_token_ids) | set(self.vlm.adapter.end_of_turn_ids)
            self._ends[seq.id] = token_mask(ends, row.shape[-1], row.device)
        return self._ends[seq.id]

    def _sampler(self, seq: Sequence) -> torch.Generator | None:
        if seq.sampling.seed is None:
            return None
        if seq.id not in self._samplers:
            self._samplers[seq.id] = torch.Generator(device=self.vlm.device).manual_seed(seq.sampling.seed)
        return self._samplers[seq.id]


def prompt_token_ids(context) -> list[int]:
    """The prompt's token ids known here: its text segments' (template, history, question; image placeholders
    expanded). A linked chunk's KV carries no ids, and an online chunk is tokenized at its prefill: neither counts."""
    texts = context.prompt.texts if hasattr(context, "prompt") else getattr(context, "texts", [])
    return [token for segment in texts for token in segment.ids]
