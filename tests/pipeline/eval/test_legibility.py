"""OCR legibility of evidence: real Tesseract on text rendered with Pillow, and the fuzzy matcher."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageDraw, ImageFont

from pipeline.eval import answer_recoverable
from pipeline.eval.legibility import LegibilityError, best_window_distance
from pipeline.runtime import normalise

EVIDENCE = "Invoice 88213 was paid on 14 March 2024 by Marta Oyelaran.\nThe access code for vault 7 is QX-5581-K."


def _render(text: str, font_px: int) -> Image.Image:
    font = ImageFont.truetype("DejaVuSans.ttf", font_px)  # Debian fonts-dejavu-core
    _, _, right, bottom = ImageDraw.Draw(Image.new("L", (1, 1))).multiline_textbbox((0, 0), text, font=font)
    image = Image.new("L", (right + 2 * font_px, bottom + 2 * font_px), 255)
    ImageDraw.Draw(image).multiline_text((font_px, font_px), text, font=font, fill=0)
    return image


def test_large_text_is_recovered_and_tiny_text_loses_characters():
    large = answer_recoverable(_render(EVIDENCE, 28), "QX-5581-K")
    assert large.recovered and large.char_accuracy == 1.0
    assert "qx-5581-k" in normalise(large.ocr_text)
    tiny = answer_recoverable(_render(EVIDENCE, 7), "QX-5581-K")
    assert not tiny.recovered and tiny.char_accuracy < large.char_accuracy
    assert 0.0 <= tiny.char_accuracy < 1.0


def test_case_and_whitespace_do_not_matter():
    result = answer_recoverable(_render(EVIDENCE, 28), "  marta\n OYELARAN ")
    assert result.recovered and result.char_accuracy == 1.0


def test_absent_answer_is_not_recovered_on_a_legible_page():
    result = answer_recoverable(_render(EVIDENCE, 28), "QX-5518-K")  # two digits swapped
    assert not result.recovered and result.char_accuracy == pytest.approx(1 - 2 / 9)


def test_empty_answer_is_rejected():
    with pytest.raises(LegibilityError, match="answer is empty"):
        answer_recoverable(_render("text", 20), " \n ")


@pytest.mark.parametrize(("needle", "haystack", "distance"), [
    ("abc", "xxabcxx", 0), ("abc", "xxabxx", 1), ("abc", "xxaxcxx", 1), ("abc", "", 3),
    ("qx-5581-k", "is qx-s581-k.", 1), ("14 march", "14march 2024", 1), ("abc", "cba", 2), ("a", "bbb", 1),
])
def test_best_window_distance_examples(needle, haystack, distance):
    assert best_window_distance(needle, haystack) == distance


def _levenshtein(a: str, b: str) -> int:
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(needle=st.text("ab5S-", min_size=1, max_size=6), haystack=st.text("ab5S- ", max_size=10))
def test_best_window_distance_is_min_over_all_substrings(needle, haystack):
    brute = min(_levenshtein(needle, haystack[i:j])
                for i in range(len(haystack) + 1) for j in range(i, len(haystack) + 1))
    assert best_window_distance(needle, haystack) == brute
