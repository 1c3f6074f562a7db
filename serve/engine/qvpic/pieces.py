"""Chunked prefill: one linked prompt's new tokens forwarded in pieces, one piece per engine step, so a long prompt
never holds the batch for its whole prefill. Between its pieces the running rows decode, and requests that join
whole go first (serve/engine/qvpic/scheduler.py says how a step's `max_prefill_tokens` is shared).

A piece is a run of the row's slots as `lay_out` placed them (serve/engine/qvpic/batch.py): its tokens write their own
columns at their own positions and see every column written before their own — the earlier pieces' and the linked
chunks' — so the last piece's logits are those of the whole prefill in one forward, to float rounding
(tests/serve/engine/test_pieces.py checks them against it and against the model run alone). The row's KV lives in
the layout's own one-row slab until its last piece; then it joins the batch like any prefilled row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pipeline.runtime.model import VLM
from serve.engine.qvpic.batch import Layout, forward
from serve.engine.sequence import Sequence


@dataclass
class Pieces:
    """A prompt being prefilled in pieces: its sequence, its one-row layout (no pad slots) and how far it got."""

    seq: Sequence
    layout: Layout
    started: float = field(default_factory=time.perf_counter)  # its first step: its prefill time runs from here
    done: int = 0  # slots forwarded

    def __post_init__(self) -> None:
        if self.layout.ids.shape[0] != 1 or not bool(self.layout.real.all()):
            raise ValueError("a prompt is prefilled in pieces alone: one row, no pad slots")

    @property
    def remaining(self) -> int:
        """Slots still to forward."""
        return self.layout.ids.shape[1] - self.done

    def _stop(self, tokens: float) -> int:
        """Where a piece of `tokens` slots (at least one) from here ends."""
        return min(self.done + max(int(tokens), 1), self.layout.ids.shape[1])

    def size(self, budget: float, per_column: float) -> int:
        """Slots the next piece takes: as many as `budget` tokens of work pays for, each reading as many columns as
        the widest the piece could reach (serve/engine/qvpic/scheduler.py `prefill_cost`); at least one."""
        end = self._stop(budget)
        widest = int(self.layout.columns[0, end - 1]) + 1  # the host's copy: no device read
        return max(1, min(end - self.done, int(budget / (1 + widest * per_column))))

    @torch.inference_mode()
    def forward(self, vlm: VLM, tokens: int) -> torch.Tensor | None:
        """The next `tokens` slots (at least one) forwarded; the last piece's logits `[1, vocab]`, before it None."""
        layout, stop = self.layout, self._stop(tokens)
        # the piece's last slot, read from the layout's host tensors (no device read): the forward's width and reach
        last = ([int(layout.columns[0, stop - 1])], [int(layout.positions[0, stop - 1])])
        logits = forward(vlm, layout.slab, *layout.slots(vlm.device, slice(self.done, stop)), last)
        self.done = stop
        return logits if self.remaining == 0 else None
