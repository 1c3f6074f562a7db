"""Legibility of rendered chunks per (font size, DPI): Tesseract OCR accuracy vs vision tokens.

    python -m benchmarks.quality.legibility

Renders a fixed invoice-like text full of numbers, names and codes at each (font size, DPI), OCRs the
page with Tesseract and reports character accuracy (1 − edit distance / reference length) and word
accuracy (the same over words), next to the Qwen2.5-VL vision tokens the page costs.

Tesseract is a proxy for what a VLM can read, and it is weak on small raw pixels: the "3× upscaled"
columns OCR the same page after a Lanczos upscale, which adds no information, to separate Tesseract's
small-glyph weakness from what the pixels actually carry.
"""

from __future__ import annotations

import os
import random
import time

import pytesseract
from PIL import Image

from pipeline.eval import markdown_table, write_section
from pipeline.runtime import Renderer, vision_tokens
from schemas.config import ModelFamily, ModelSpec
from schemas.render import RenderSpec, TierSpec

FONT_SIZES_PT = (6, 8, 9, 10, 12)
DPIS = (72, 96, 120)
UPSCALE = 3
NUM_LINES = 18
NAMES = ("Jane Smith", "Olu Adeyemi", "Marta Kowalska", "Kenji Watanabe", "Lucia Ferreira", "Aidan O'Brien")
CITIES = ("Springfield", "Rotterdam", "Wroclaw", "Osaka", "Porto", "Galway")


def reference_text(seed: int = 0) -> str:
    """Invoice lines: ids, part numbers like XK-4471-B, dates, quantities, amounts, names."""
    rng = random.Random(seed)
    lines = []
    for i in range(NUM_LINES):
        part = f"{rng.choice('ABCKMQXZ')}{rng.choice('KLQRTZ')}-{rng.randint(0, 9999):04d}-{rng.choice('ABCDEF')}"
        qty, unit = rng.randint(1, 250), rng.randint(100, 999_999) / 100
        date = f"20{rng.randint(19, 25)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        if i % 3 == 0:
            lines.append(f"Invoice INV-{rng.randint(1000, 9999)}-{rng.randint(10, 99)} dated {date} "
                         f"for {rng.choice(NAMES)}, {rng.choice(CITIES)}")
        else:
            lines.append(f"Part {part} qty {qty} @ ${unit:,.2f} = ${qty * unit:,.2f} due {date}")
    return "\n".join(lines)


def levenshtein(a: str | list[str], b: str | list[str]) -> int:
    """Edit distance (insert, delete, substitute = 1) with a two-row DP; O(len(a)·len(b))."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, start=1):
        cur = [i]
        for j, y in enumerate(b, start=1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


def accuracy(reference: str, hypothesis: str) -> tuple[float, float]:
    """(character accuracy, word accuracy) after collapsing whitespace; floored at 0."""
    ref_words, hyp_words = reference.split(), hypothesis.split()
    ref_chars, hyp_chars = " ".join(ref_words), " ".join(hyp_words)
    char_acc = 1 - levenshtein(ref_chars, hyp_chars) / len(ref_chars)
    word_acc = 1 - levenshtein(ref_words, hyp_words) / len(ref_words)
    return max(0.0, char_acc), max(0.0, word_acc)


def ocr(page: Image.Image, dpi: int) -> str:
    # psm 6: one uniform block of text, which is what a rendered chunk is
    return pytesseract.image_to_string(page, config=f"--psm 6 --dpi {dpi}")


def run() -> str:
    text = reference_text()
    max_pixels = ModelSpec().max_pixels
    rows = []
    for font_size_pt in FONT_SIZES_PT:
        renderer = Renderer(RenderSpec(font_size_pt=font_size_pt, line_height_pt=font_size_pt * 10 / 9))
        for dpi in DPIS:
            (page,) = renderer.render(text, TierSpec(name="bench", dpi=dpi)).pages
            raw_char, raw_word = accuracy(text, ocr(page, dpi))
            big = page.resize((page.width * UPSCALE, page.height * UPSCALE), Image.Resampling.LANCZOS)
            up_char, up_word = accuracy(text, ocr(big, dpi * UPSCALE))
            num_tokens = vision_tokens(ModelFamily.QWEN2_5_VL, *page.size, max_pixels=max_pixels)
            rows.append([font_size_pt, dpi, f"{page.width}×{page.height}", num_tokens,
                         round(len(text) / num_tokens, 2), f"{raw_char:.1%}", f"{raw_word:.1%}",
                         f"{up_char:.1%}", f"{up_word:.1%}"])
            print(*rows[-1], sep="\t", flush=True)
    headers = ["font pt", "DPI", "page px", "vision tokens", "chars/token", "char acc", "word acc",
               f"char acc ({UPSCALE}× upscaled)", f"word acc ({UPSCALE}× upscaled)"]
    return (
        f"{NUM_LINES} invoice lines ({len(text)} characters: ids, part numbers, dates, amounts, names), "
        f"one cropped page per row, line height = 10/9 × font size (Glyph's ratio). Tesseract "
        f"{pytesseract.get_tesseract_version()} `--psm 6`; accuracy = 1 − edit distance / reference length "
        f"(characters, then words), whitespace collapsed. Vision tokens: Qwen2.5-VL, max_pixels {max_pixels:,}.\n\n"
        + markdown_table(headers, rows)
    )


def main() -> None:
    os.environ.setdefault("OMP_THREAD_LIMIT", "1")  # Tesseract's OpenMP threads only thrash on 2 cores
    start = time.perf_counter()
    body = run()
    body += f"\n\nWall time {time.perf_counter() - start:.0f} s."
    path = write_section("render_legibility", "Render legibility: OCR accuracy vs vision tokens",
                         "python -m benchmarks.quality.legibility", body)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
