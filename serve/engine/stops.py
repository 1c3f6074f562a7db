"""Stop strings, matched on the decoded text across token boundaries (OpenAI's `stop`).

A stop string may be split over several tokens, or begin inside one: the matcher holds back any tail of the text
that could still begin a stop string, so a stream never shows part of one, and at a match it gives the text before
the stop string and says so. Two matchers see the same tokens: the engine's (serve/engine/qvpic/engine.py) ends the
sequence at the match, before another decode step; the generator's (serve/engine/generator.py) turns the same
tokens into the answer's text. Both are deterministic over the token ids, so they agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from serve.engine.detokenizer import Detokenizer


@dataclass(frozen=True)
class Step:
    text: str  # what may be shown now (never part of a stop string)
    matched: bool  # a stop string completed: `text` ends right before it, and nothing follows


class StopMatcher:
    def __init__(self, tokenizer, stops: tuple[str, ...], include: bool = False, skip_special_tokens: bool = True):
        if not stops or not all(stops):
            raise ValueError(f"stop strings must be non-empty, got {stops!r}")
        self.detokenizer = Detokenizer(tokenizer, skip_special_tokens)
        self.stops = stops
        self.include = include  # vLLM's include_stop_str_in_output: the text ends after the stop string
        self.held = ""  # decoded text not yet shown: a tail that could begin a stop string
        self.matched = False

    def add(self, token_id: int) -> Step:
        return self._step(self.detokenizer.add(token_id))

    def flush(self) -> Step:
        """The end of the answer: what is held is shown (no stop string can complete any more)."""
        step = self._step(self.detokenizer.flush())
        if step.matched:
            return step
        text, self.held = step.text + self.held, ""
        return Step(text, False)

    def _step(self, piece: str) -> Step:
        if self.matched:
            return Step("", True)
        text = self.held + piece
        found = [(i, len(stop)) for stop in self.stops if (i := text.find(stop)) >= 0]
        if found:  # the earliest; of two starting there, the shorter (a growing text completes it first)
            self.matched, self.held = True, ""
            at, length = min(found)
            return Step(text[:at + length if self.include else at], True)
        keep = max((k for stop in self.stops for k in range(min(len(stop) - 1, len(text)), 0, -1)
                    if text.endswith(stop[:k])), default=0)
        self.held = text[len(text) - keep:] if keep else ""
        return Step(text[:len(text) - keep], False)
