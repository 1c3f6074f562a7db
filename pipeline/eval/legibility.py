"""Evidence legibility: can the answer still be read off a served page image?

Tesseract reads the image as served (no upscaling), so the result tracks what the resolution tier
leaves legible: at 72 DPI, 12 pt text survives and 8 pt digits start to go. Both sides are
lower-cased with whitespace collapsed. `char_accuracy` is 1 − (edit distance of the answer to its
best-matching window of the OCR text) / (answer length), floored at 0; `recovered` asks for the
answer as an exact substring.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytesseract
from PIL import Image


class LegibilityError(ValueError):
    """An empty answer, or no Tesseract to read with."""


@dataclass(frozen=True)
class LegibilityResult:
    recovered: bool  # the normalised answer occurs verbatim in the normalised OCR text
    char_accuracy: float  # in [0, 1]; 1.0 iff recovered
    ocr_text: str  # Tesseract's raw output


def normalize_text(text: str) -> str:
    return " ".join(text.lower().split())


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


def ocr(image: Image.Image) -> str:
    try:
        return pytesseract.image_to_string(image.convert("RGB"), lang="eng")
    except pytesseract.TesseractNotFoundError:
        raise LegibilityError("tesseract is not installed (Debian: apt-get install tesseract-ocr "
                              "tesseract-ocr-eng)") from None


def answer_recoverable(image: Image.Image, answer: str) -> LegibilityResult:
    needle = normalize_text(answer)
    if not needle:
        raise LegibilityError("answer is empty after whitespace normalisation")
    ocr_text = ocr(image)
    haystack = normalize_text(ocr_text)
    if needle in haystack:
        return LegibilityResult(recovered=True, char_accuracy=1.0, ocr_text=ocr_text)
    distance = best_window_distance(needle, haystack)
    return LegibilityResult(recovered=False, char_accuracy=max(0.0, 1.0 - distance / len(needle)),
                            ocr_text=ocr_text)
