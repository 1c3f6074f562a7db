"""Page-image inputs: safe decoding, OCR of the source text, and a DCT perceptual hash.

pHash keys near-duplicate *inputs* only (a rescan, a re-encoded JPEG); it cannot tell one changed
digit apart, which is why caches are keyed by text hash and why near-duplicates also need equal OCR.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image, UnidentifiedImageError

from pipeline.runtime import OcrUnavailable, PageLayout, read_text
from schemas.corpus import ReaderSpec

_HASH_SIDE_PX = 32  # the image is reduced to 32x32 grey before the DCT
_LOW_FREQ_SIDE = 8  # the top-left 8x8 coefficients make the 64 bits
_ACCEPTED_FORMATS = ("PNG", "JPEG")


def _dct_matrix(n: int) -> np.ndarray:
    """Orthonormal DCT-II basis, [n, n]: `d @ x @ d.T` is the 2-D DCT of an n x n block."""
    k = np.arange(n)[:, None]
    i = np.arange(n)[None, :]
    basis = np.cos(np.pi * (2 * i + 1) * k / (2 * n)) * np.sqrt(2.0 / n)
    basis[0] /= np.sqrt(2.0)
    return basis


_DCT = _dct_matrix(_HASH_SIDE_PX)


@dataclass(frozen=True)
class PageImage:
    ocr_text: str
    phash: str  # 16 hex digits


def perceptual_hash(image: Image.Image) -> str:
    """64-bit DCT pHash: low-frequency coefficients above their median are the set bits."""
    grey = np.asarray(image.convert("L").resize((_HASH_SIDE_PX, _HASH_SIDE_PX), Image.Resampling.LANCZOS),
                      dtype=np.float64)  # [32, 32]
    low = (_DCT @ grey @ _DCT.T)[:_LOW_FREQ_SIDE, :_LOW_FREQ_SIDE]  # [8, 8]
    bits = (low > np.median(low)).flatten()
    return f"{int(''.join('1' if b else '0' for b in bits), 2):016x}"


def phash_distance_bits(a: str, b: str) -> int:
    return (int(a, 16) ^ int(b, 16)).bit_count()


def read_page_image(path: str, spec: ReaderSpec) -> PageImage | str:
    """The OCR text and pHash of a PNG/JPEG page, or why it cannot be used.

    The pixel budget is checked from the header before any pixel is decoded, so a decompression bomb
    costs nothing; truncated files fail at `load()` because Pillow's LOAD_TRUNCATED_IMAGES stays off.
    A missing tesseract binary or language pack raises `OcrUnavailable`: a broken setup is not
    a bad input, and quarantining every page for it would hide the problem.
    """
    try:
        with Image.open(path) as image:
            if image.format not in _ACCEPTED_FORMATS:
                return f"format {image.format} is not one of {_ACCEPTED_FORMATS}"
            width_px, height_px = image.size
            if width_px * height_px > spec.max_image_pixels:
                return f"{width_px}x{height_px} pixels > max_image_pixels {spec.max_image_pixels}"
            image.load()
            rgb = image.convert("RGB")
    except Image.DecompressionBombError as exc:
        return f"decompression bomb: {exc}"
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    try:
        # A scan's layout (columns, figures, margins) is nobody's choice: Tesseract segments it itself.
        text = read_text(rgb, layout=PageLayout.AUTO, lang=spec.ocr_lang, timeout_s=spec.ocr_timeout_s)
    except OcrUnavailable:
        raise
    except RuntimeError as exc:  # pytesseract's timeout
        return f"OCR failed: {exc}"
    return PageImage(ocr_text=text, phash=perceptual_hash(rgb))
