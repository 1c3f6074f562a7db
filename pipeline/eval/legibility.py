"""Evidence legibility: can the answer still be read off a served page image?

Tesseract reads the image as served (no upscaling; `pipeline/runtime/ocr.py`, as ingest reads it), so the
result tracks what the resolution tier leaves legible: at 72 DPI, 12 pt text survives and 8 pt digits start
to go. Both sides are lower-cased with whitespace collapsed. `char_accuracy` is 1 − (edit distance of the answer to its
best-matching window of the OCR text) / (answer length), floored at 0; `recovered` asks for the
answer as an exact substring.
"""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

from pipeline.runtime import normalise, read_text


class LegibilityError(ValueError):
    """An answer that is empty after normalisation."""


@dataclass(frozen=True)
class LegibilityResult:
    recovered: bool  # the normalised answer occurs verbatim in the normalised OCR text
    char_accuracy: float  # in [0, 1]; 1.0 iff recovered
    ocr_text: str  # Tesseract's raw output


def best_window_distance(needle: str, haystack: str) -> int:
    """Fewest edits turning `needle` into some substring of `haystack` (Sellers' approximate match).

    The DP row is over needle positions; a free start anywhere in the haystack is the zero top row
    and a free end is the min over the last row. O(len(needle) × len(haystack)) time.
    """
    # previous[i] = edits to match needle[:i] ending at the previous haystack character.
    previous = list(range(len(needle) + 1))
    best = previous[-1]
    for hay_char in haystack:
        current = [0]
        for i, needle_char in enumerate(needle, start=1):
            current.append(min(previous[i] + 1,  # haystack character left unmatched
                               current[i - 1] + 1,  # needle character missing from the OCR text
                               previous[i - 1] + (needle_char != hay_char)))
        previous = current
        best = min(best, previous[-1])
    return best


def answer_recoverable(image: Image.Image, answer: str, dpi: int | None = None) -> LegibilityResult:
    """Whether `answer` can be read off `image` (`dpi`: its resolution when known; raises OcrUnavailable
    without Tesseract)."""
    needle = normalise(answer)
    if not needle:
        raise LegibilityError("answer is empty after whitespace normalisation")
    ocr_text = read_text(image, dpi=dpi)
    haystack = normalise(ocr_text)
    if needle in haystack:
        return LegibilityResult(recovered=True, char_accuracy=1.0, ocr_text=ocr_text)
    distance = best_window_distance(needle, haystack)
    return LegibilityResult(recovered=False, char_accuracy=max(0.0, 1.0 - distance / len(needle)),
                            ocr_text=ocr_text)
