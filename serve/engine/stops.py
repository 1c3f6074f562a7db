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
    def __init__(self, tokenizer, stops: tuple[str, ...]):
        if not stops or not all(stops):
            raise ValueError(f"stop strings must be non-empty, got {stops!r}")
        self.detokenizer = Detokenizer(tokenizer)
        self.stops = stops
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
        found = [i for i in (text.find(stop) for stop in self.stops) if i >= 0]
        if found:
            self.matched, self.held = True, ""
            return Step(text[:min(found)], True)
        keep = max((k for stop in self.stops for k in range(min(len(stop) - 1, len(text)), 0, -1)
                    if text.endswith(stop[:k])), default=0)
        self.held = text[len(text) - keep:] if keep else ""
        return Step(text[:len(text) - keep], False)
