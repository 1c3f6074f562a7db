"""OCR: the one Tesseract call of the project, and the ingest-time legibility score built on it.

Every caller reads pages through `read_text`, with one configuration: the page image as given (no
upscaling), Tesseract told its DPI when the caller knows it, `--psm 6` (one uniform block of text: what
the renderer draws) unless the caller names another `PageLayout`. A missing tesseract binary or language
pack raises `OcrUnavailable`: a broken setup, never a property of the page.

Ingest-time legibility of a chunk's pages at one tier (`page_legibility`): how much of its text OCR reads
back. `qvpic ingest --legibility` stores it in every image entry's index row (`legibility`), and the hybrid
router (serve/routing/hybrid.py) serves a chunk as text where its image tier would lose characters — small
digits and code at 72 DPI. Pages are read at the tier's DPI and joined in order. The score is the share of
the chunk's characters (lower-cased, whitespace collapsed) that the OCR text matches in order: matched
characters of difflib's longest matching blocks over the reference length, in [0, 1]. Cost: one Tesseract
call per page per tier (benchmarks/quality/hybrid.py measures it); off by default.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from enum import Enum

import pytesseract
from PIL import Image

_INSTALL_HINT = "Debian: apt-get install tesseract-ocr tesseract-ocr-eng"


class OcrUnavailable(RuntimeError):
    """Tesseract, or the language pack asked for, is not installed where the job runs."""


class PageLayout(str, Enum):
    """Tesseract's page segmentation mode (`--psm`)."""

    BLOCK = "6"  # one uniform block of text: a page the renderer drew (one column, no figures)
    AUTO = "3"  # Tesseract finds the layout: a scanned page, whose columns and figures nobody chose


def read_text(image: Image.Image, *, dpi: int | None = None, layout: PageLayout = PageLayout.BLOCK,
              lang: str = "eng", timeout_s: float = 0) -> str:
    """Tesseract's text of `image` (`dpi`: the resolution it was rendered at, None: Tesseract estimates it;
    `timeout_s` 0: none — past it pytesseract raises a RuntimeError, which is about the page, not the setup)."""
    config = f"--psm {layout.value}" + (f" --dpi {dpi}" if dpi is not None else "")
    try:
        return pytesseract.image_to_string(image.convert("RGB"), lang=lang, config=config, timeout=timeout_s)
    except pytesseract.TesseractNotFoundError as exc:  # an OSError: must not pass for an unreadable file
        raise OcrUnavailable(f"tesseract is not installed ({_INSTALL_HINT})") from exc
    except pytesseract.TesseractError as exc:  # e.g. a language pack that is not installed
        raise OcrUnavailable(f"tesseract failed for language {lang!r}: {exc}") from exc


def normalise(text: str) -> str:
    """Lower-cased, whitespace collapsed: how both legibility scores compare OCR text with its source."""
    return " ".join(text.lower().split())


def matched_share(reference: str, hypothesis: str) -> float:
    """Share of `reference`'s characters that `hypothesis` matches in order (1.0 for an empty reference)."""
    reference, hypothesis = normalise(reference), normalise(hypothesis)
    if not reference:
        return 1.0
    # autojunk off: on long strings it would junk the most common characters (spaces, 'e'), the bulk of the text
    blocks = difflib.SequenceMatcher(None, reference, hypothesis, autojunk=False).get_matching_blocks()
    return min(1.0, sum(b.size for b in blocks) / len(reference))


def page_legibility(text: str, pages: Sequence[Image.Image], dpi: int) -> float:
    """OCR character accuracy of `pages` (one chunk at one tier) against the chunk's `text`."""
    return matched_share(text, "\n".join(read_text(page, dpi=dpi) for page in pages))
