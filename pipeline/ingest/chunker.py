"""Paragraph-aware chunking under a token budget.

A document is cut at the coarsest boundary that works: blank lines, then line breaks, then sentence
ends, then whitespace, and only for an unbreakable run (a 100k-character "word") inside it. The
pieces keep their trailing whitespace, so joining them reproduces the document exactly; a chunk's
text is its pieces joined and stripped, so the chunks reproduce the document up to the whitespace
at the cut points. Every chunk has at most `max_tokens` tokens by the `count_tokens` it was given.

Cost: every piece is counted once per level it passes through, and each chunk a handful of times
(greedy packing by the pieces' summed counts, then a verified gallop/binary search on the real count,
since sub-word tokenizers do not add up exactly across a cut).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from typing import NamedTuple

from schemas.corpus import Chunk, Document

_LEVELS = (
    re.compile(r"\n[ \t]*\n\s*"),  # paragraphs
    re.compile(r"\n\s*"),  # lines
    re.compile(r"(?<=[.!?])\s+|(?<=[。！？；])\s*"),  # sentences; CJK ends need no space after them
    re.compile(r"\s+"),  # words
)
_CHARACTERS = len(_LEVELS)


class ChunkingError(ValueError):
    """The text cannot be cut under the budget (one character alone is over it)."""


class _Piece(NamedTuple):
    text: str  # with its trailing whitespace
    num_tokens: int
    level: int  # the boundary level it was cut at
    end_level: int  # level of the boundary right after it: -1 end of text, 0 paragraph ... 4 mid-word


def _split_after(text: str, boundary: re.Pattern[str]) -> list[str]:
    pieces, start = [], 0
    for match in boundary.finditer(text):
        if match.end() > start:
            pieces.append(text[start:match.end()])
            start = match.end()
    if start < len(text):
        pieces.append(text[start:])
    return pieces


class Chunker:
    def __init__(self, count_tokens: Callable[[str], int], max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.count_tokens = count_tokens
        self.max_tokens = max_tokens

    def chunk(self, doc: Document) -> list[Chunk]:
        return [Chunk.build(doc.doc_id, order, text, num_tokens)
                for order, (text, num_tokens) in enumerate(self.split(doc.text))]

    def split(self, text: str) -> list[tuple[str, int]]:
        """(chunk text, its token count) in document order; blank input gives no chunks.

        Each chunk takes as many pieces as fit, then gives back to the strongest boundary inside
        that span (the last paragraph break, else line break, else sentence end, ...).
        """
        pieces = self._pieces(text, 0, end_level=-1)
        chunks: list[tuple[str, int]] = []
        start = 0
        while start < len(pieces):
            guess_end, estimate = start + 1, pieces[start].num_tokens
            while guess_end < len(pieces) and estimate + pieces[guess_end].num_tokens <= self.max_tokens:
                estimate += pieces[guess_end].num_tokens
                guess_end += 1
            fit = self._largest_fit(pieces, start, guess_end)
            if fit is None:  # one piece that counts over once stripped (sub-word merges): cut it finer
                piece = pieces[start]
                if piece.level >= _CHARACTERS:
                    raise ChunkingError(f"{piece.text[:20]!r}... does not fit in {self.max_tokens} tokens")
                pieces[start:start + 1] = self._pieces(piece.text, piece.level + 1, piece.end_level)
                continue
            end, chunk_text, num_tokens = fit
            best_end = min(range(start + 1, end + 1), key=lambda e: (pieces[e - 1].end_level, -e))
            if best_end != end:
                chunk_text, num_tokens = self._measure(pieces, start, best_end)
            chunks.append((chunk_text, num_tokens))
            start = best_end
        return chunks

    def _pieces(self, text: str, level: int, end_level: int) -> list[_Piece]:
        """Whole sections where they fit; oversized ones cut at the next finer boundary."""
        if level >= _CHARACTERS:
            return self._cut_characters(text, end_level)
        parts = [part for part in _split_after(text, _LEVELS[level]) if part.strip()]
        pieces: list[_Piece] = []
        for i, part in enumerate(parts):
            part_end = end_level if i == len(parts) - 1 else level
            num_tokens = self.count_tokens(part)
            if num_tokens <= self.max_tokens or self.count_tokens(part.strip()) <= self.max_tokens:
                pieces.append(_Piece(part, num_tokens, level, part_end))
            else:
                pieces.extend(self._pieces(part, level + 1, part_end))
        return pieces

    def _measure(self, pieces: list[_Piece], start: int, end: int) -> tuple[str, int]:
        text = "".join(p.text for p in pieces[start:end]).strip()
        return text, self.count_tokens(text)

    def _largest_fit(self, pieces: list[_Piece], start: int, guess_end: int) -> tuple[int, str, int] | None:
        """(end, text, tokens) of the longest run pieces[start:end] that fits, or None if not even one."""
        text, num_tokens = self._measure(pieces, start, guess_end)
        best: tuple[int, str, int] | None = None
        low, high = start, guess_end  # pieces[start:low] fits (or low == start); pieces[start:high] does not
        if num_tokens <= self.max_tokens:
            best, low, high, step = (guess_end, text, num_tokens), guess_end, len(pieces) + 1, 1
            while low < len(pieces):  # gallop: the summed estimate is usually pessimistic
                probe = min(low + step, len(pieces))
                text, num_tokens = self._measure(pieces, start, probe)
                if num_tokens > self.max_tokens:
                    high = probe
                    break
                best, low, step = (probe, text, num_tokens), probe, step * 2
        while high - low > 1 and low < len(pieces):
            mid = (low + high) // 2
            text, num_tokens = self._measure(pieces, start, mid)
            if num_tokens <= self.max_tokens:
                best, low = (mid, text, num_tokens), mid
            else:
                high = mid
        return best

    def _cut_characters(self, word: str, end_level: int) -> list[_Piece]:
        """Cut an unbreakable run into the longest prefixes that fit."""
        pieces: list[_Piece] = []
        rest = word
        while rest.strip():
            cut, num_tokens = self._longest_prefix(rest)
            if cut == 0:
                raise ChunkingError(f"character {rest[0]!r} alone is over {self.max_tokens} tokens")
            cut, num_tokens = self._keep_marks_attached(rest, cut, num_tokens)
            piece, rest = rest[:cut], rest[cut:]
            pieces.append(_Piece(piece, num_tokens, _CHARACTERS, end_level if not rest.strip() else _CHARACTERS))
        return pieces

    def _longest_prefix(self, rest: str) -> tuple[int, int]:
        """(length, tokens) of a longest prefix within budget: doubling probes, then bisection."""
        fits, fits_tokens, fails = 0, 0, len(rest) + 1
        probe = min(self.max_tokens, len(rest))
        while True:
            num_tokens = self.count_tokens(rest[:probe].strip())
            if num_tokens > self.max_tokens:
                fails = probe
                break
            fits, fits_tokens = probe, num_tokens
            if probe == len(rest):
                return fits, fits_tokens
            probe = min(2 * probe, len(rest))
        while fails - fits > 1:
            mid = (fits + fails) // 2
            num_tokens = self.count_tokens(rest[:mid].strip())
            if num_tokens <= self.max_tokens:
                fits, fits_tokens = mid, num_tokens
            else:
                fails = mid
        return fits, fits_tokens

    def _keep_marks_attached(self, rest: str, cut: int, num_tokens: int) -> tuple[int, int]:
        """Move a cut back so combining marks stay with their base character, when that still fits."""
        moved = cut
        while 1 < moved < len(rest) and unicodedata.combining(rest[moved]):
            moved -= 1
        if moved == cut or unicodedata.combining(rest[moved]):
            return cut, num_tokens
        moved_tokens = self.count_tokens(rest[:moved].strip())
        return (moved, moved_tokens) if moved_tokens <= self.max_tokens else (cut, num_tokens)
