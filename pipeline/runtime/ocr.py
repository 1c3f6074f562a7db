"""Ingest-time legibility of a chunk's pages at one tier: how much of its text OCR reads back.

`qvpic ingest --legibility` stores it in every image entry's index row (`legibility`), and the hybrid
router (serve/routing/hybrid.py) serves a chunk as text where its image tier would lose characters — small
digits and code at 72 DPI. Tesseract reads each page as rendered (no upscaling, `--psm 6`, told the
tier's DPI), pages joined in order. The score is the share of the chunk's characters (lower-cased,
whitespace collapsed) that the OCR text matches in order: matched characters of difflib's longest
matching blocks over the reference length, in [0, 1]. Cost: one Tesseract call per page per tier
(benchmarks/hybrid.py measures it); off by default.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

import pytesseract
from PIL import Image


class LegibilityUnavailable(RuntimeError):
    """Tesseract is not installed where the job runs."""


def normalise(text: str) -> str:
    return " ".join(text.lower().split())


def matched_share(reference: str, hypothesis: str) -> float:
    """Share of `reference`'s characters that `hypothesis` matches in order (1.0 for an empty reference)."""
    reference, hypothesis = normalise(reference), normalise(hypothesis)
    if not reference:
        return 1.0
    # autojunk off: on long strings it would junk the most common characters (spaces, 'e'), the bulk of the text
    blocks = difflib.SequenceMatcher(None, reference, hypothesis, autojunk=False).get_matching_blocks()
    return min(1.0, sum(b.size for b in blocks) / len(reference))


def ocr_pages(pages: Sequence[Image.Image], dpi: int) -> str:
    try:
        return "\n".join(pytesseract.image_to_string(p.convert("RGB"), config=f"--psm 6 --dpi {dpi}") for p in pages)
    except pytesseract.TesseractNotFoundError:
        raise LegibilityUnavailable("--legibility needs tesseract (Debian: apt-get install tesseract-ocr "
                                    "tesseract-ocr-eng)") from None


def page_legibility(text: str, pages: Sequence[Image.Image], dpi: int) -> float:
    """OCR character accuracy of `pages` (one chunk at one tier) against the chunk's `text`."""
    return matched_share(text, ocr_pages(pages, dpi))
