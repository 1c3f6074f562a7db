"""Renderer: Glyph layout defaults, wrapping, fallback fonts, cropping, paging, limits, determinism."""

from __future__ import annotations

import hashlib
import io
import json
import math
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.runtime import Renderer, vision_tokens
from pipeline.runtime.render import REPLACEMENT_CHAR, RenderError, pt_to_px
from schemas.config import ModelFamily
from schemas.render import RenderSpec, TierSpec
from tests.support.paths import REPO

LOW, HIGH = TierSpec(name="low", dpi=72), TierSpec(name="high", dpi=120)
MID = TierSpec(name="mid", dpi=96)  # not in the default spec: fonts are loaded on first use
INVOICE = "Invoice INV-2024-0042 dated 2024-03-17: part XK-4471-B qty 12 @ $14.95 = $179.40 (Jane Smith)"
CJK = "这是一个测试。中文文本需要逐字换行，并且没有空格分隔词语。"


@pytest.fixture(scope="module")
def renderer() -> Renderer:
    return Renderer(RenderSpec())


@pytest.fixture(scope="module")
def uncropped() -> Renderer:
    return Renderer(RenderSpec(crop=False))


def ink_bbox(page: Image.Image) -> tuple[int, int, int, int] | None:
    """(left, top, right, bottom) of non-white pixels."""
    dark = np.asarray(page.convert("L")) < 250
    if not dark.any():
        return None
    rows, cols = np.nonzero(dark.any(axis=1))[0], np.nonzero(dark.any(axis=0))[0]
    return int(cols[0]), int(rows[0]), int(cols[-1]) + 1, int(rows[-1]) + 1


def png_digests(chunk_pages: list[Image.Image]) -> list[str]:
    digests = []
    for page in chunk_pages:
        buf = io.BytesIO()
        page.save(buf, format="PNG")
        digests.append(hashlib.sha256(buf.getvalue()).hexdigest())
    return digests


def random_text(rng: random.Random, num_words: int) -> str:
    parts = []
    for _ in range(num_words):
        r = rng.random()
        if r < 0.03:
            parts.append("W" * rng.randint(100, 400))  # unbreakable, wider than a line at 72 DPI
        elif r < 0.08:
            parts.append("".join(rng.choice(CJK) for _ in range(rng.randint(1, 30))))
        else:
            parts.append("".join(rng.choice("abcdefXYZ0123456789-.$") for _ in range(rng.randint(1, 12))))
        parts.append(rng.choice([" ", " ", " ", "  ", "   ", "\t", "\n", "\n\n"]))
    return "".join(parts)


def test_glyph_defaults_give_a4_pages_and_known_token_counts(uncropped: Renderer) -> None:
    text = "\n".join(f"line {i}" for i in range(200))
    low, high = uncropped.render(text, LOW), uncropped.render(text, HIGH)
    assert [p.size for p in low.pages] == [(595, 842)] * 3
    assert [p.size for p in high.pages] == [(992, 1403)] * 3
    assert all(p.mode == "RGB" for p in low.pages + high.pages)
    assert vision_tokens(ModelFamily.QWEN2_5_VL, *low.pages[0].size) == 630
    assert vision_tokens(ModelFamily.QWEN2_5_VL, *high.pages[0].size, max_pixels=1_389_000) == 1750
    assert (low.dpi, low.tier, low.num_chars, low.missing_glyphs) == (72, LOW, len(text), 0)


def test_lines_per_page_and_multi_page_split(renderer: Renderer) -> None:
    per_page = int((842 - 2 * 10) // 10)  # 82 lines of 10 pt between 10 pt margins
    assert renderer.render("\n".join("x" * per_page), LOW).num_pages == 1
    chunk = renderer.render("\n".join("x" * (per_page + 1)), LOW)
    assert chunk.num_pages == 2
    assert chunk.pages[0].size[1] == 842  # only the last page is cut at the bottom
    assert chunk.pages[1].size[1] == 2 * 10 + 10


@pytest.mark.parametrize("tier", [LOW, MID, HIGH])
def test_crop_keeps_margins_and_cuts_the_unused_area(renderer: Renderer, tier: TierSpec) -> None:
    chunk = renderer.render(f"{INVOICE}\nshort", tier)
    (page,) = chunk.pages
    margin_px = pt_to_px(10, tier.dpi)
    width_px, height_px = page.size
    left, top, right, bottom = ink_bbox(page)
    assert width_px < pt_to_px(595, tier.dpi) / 1.1
    assert height_px == math.ceil(pt_to_px(2 * 10 + 2 * 10, tier.dpi))  # two lines + two margins
    assert margin_px - 1 <= left <= margin_px + 2
    assert width_px - margin_px - 3 <= right <= width_px - margin_px + 1
    assert top >= margin_px - 2 and bottom <= height_px - margin_px + 3


@pytest.mark.parametrize("tier", [LOW, MID, HIGH])
def test_wrapped_text_never_crosses_the_right_margin(uncropped: Renderer, tier: TierSpec) -> None:
    text = random_text(random.Random(tier.dpi), 900)
    margin_px = pt_to_px(10, tier.dpi)
    for page in uncropped.render(text, tier).pages:
        left, _, right, _ = ink_bbox(page)
        assert left >= margin_px - 1
        assert right <= page.size[0] - margin_px + 1


def test_layout_loses_no_character_and_breaks_words_only_when_too_long(renderer: Renderer) -> None:
    for seed in range(20):
        text = random_text(random.Random(seed), 150)
        for tier in (LOW, HIGH):
            lines = renderer.layout(text, tier)
            assert "".join(lines).replace(" ", "") == text.expandtabs(4).replace(" ", "").replace("\n", "")
    words = " ".join("".join(random.Random(i).choice("abcXYZ019") for _ in range(1 + i % 11)) for i in range(400))
    lines = renderer.layout(words, LOW)
    assert len(lines) > 5
    assert " ".join(lines).split() == words.split()  # every break falls on a space


def test_spaces_tabs_and_blank_lines_are_kept(renderer: Renderer) -> None:
    assert renderer.layout("a    b\n\n\nc\td\r\nab\tc", LOW) == ["a    b", "", "", "c   d", "ab  c"]
    assert renderer.layout("    indented", LOW) == ["    indented"]
    assert renderer.layout("x\u2028y\x0cz\n\n", LOW) == ["x", "y", "z", ""]  # every Unicode line break


def test_unbreakable_word_is_split_at_the_line_width(renderer: Renderer) -> None:
    word = "XK4471B" * 150
    for tier in (LOW, HIGH):
        lines = renderer.layout(f"id: {word} end", tier)
        assert len(lines) >= 4 and "".join(lines).replace(" ", "") == f"id:{word}end"
        assert lines[0] == "id:"  # the long word starts on its own line, then breaks by characters
        assert len(set(map(len, lines[1:-2]))) == 1  # full lines hold the same number of characters


def test_cjk_and_mixed_text_wrap_per_character(renderer: Renderer) -> None:
    lines = renderer.layout(CJK * 20, LOW)
    assert len(lines) > 3 and len(set(map(len, lines[:-1]))) == 1 and len(lines[0]) >= 40
    # A CJK run after Latin words fills the rest of the line instead of moving down as one word.
    shared = sum(
        any("word" in line and "中" in line for line in renderer.layout("word " * k + "中" * 60, LOW))
        for k in range(1, 40)
    )
    assert shared >= 30
    mixed = renderer.layout(("English words 和中文混合 " * 40).strip(), HIGH)
    assert all(not line.startswith(" ") for line in mixed)
    assert "".join(mixed).replace(" ", "") == ("English words 和中文混合 " * 40).replace(" ", "")


def font_for(renderer: Renderer, ch: str) -> Path | None:
    """The configured font that draws character `ch`, or None when `ch` is a missing glyph."""
    glyph = renderer._glyph(ch)
    return None if glyph.missing else renderer.font_paths[glyph.font]


def test_font_fallback_chain(renderer: Renderer) -> None:
    assert font_for(renderer, "A").name == "DejaVuSans.ttf"
    assert font_for(renderer, "中").name == "NotoSansCJK-Regular.ttc"
    assert font_for(renderer, "한").name == "NotoSansCJK-Regular.ttc"
    assert font_for(renderer, "\u0915") is None  # Devanagari: none of the three fonts has it
    assert font_for(renderer, "\x07") is None
    assert all(font_for(renderer, chr(c)) is not None for c in range(0x21, 0x7F))


def test_missing_glyphs_are_counted_and_drawn_as_replacement(renderer: Renderer) -> None:
    chunk = renderer.render("code \u0915\u0916 end\x00", LOW)
    assert chunk.missing_glyphs == 3
    same = renderer.render(f"code {REPLACEMENT_CHAR * 2} end{REPLACEMENT_CHAR}", LOW)
    assert same.missing_glyphs == 0
    assert np.array_equal(np.asarray(chunk.pages[0]), np.asarray(same.pages[0]))
    tofu = Renderer(RenderSpec(font_names=("DejaVuSans.ttf",))).render("code \u4e2d end", LOW)
    assert tofu.missing_glyphs == 1  # CJK without the CJK font is missing, not a box


@pytest.mark.parametrize(
    ("spec", "text", "message"),
    [
        (RenderSpec(max_chars_per_chunk=100), "x" * 101, "max_chars_per_chunk"),
        (RenderSpec(max_pages_per_chunk=1), "\n".join("y" * 83), "max_pages_per_chunk"),
        (RenderSpec(), "  \n\t ", "empty"),
    ],
)
def test_limits_raise_render_error(spec: RenderSpec, text: str, message: str) -> None:
    with pytest.raises(RenderError, match=message):
        Renderer(spec).render(text, LOW)


def test_glyph_text_handling_and_fonts_by_path(renderer: Renderer) -> None:
    """As Glyph's renderer: soft hyphens and zero-width spaces are dropped. A font can be named by its
    absolute path (how a Glyph deployment points at Verdana.ttf), also from the command line."""
    assert renderer.layout("soft\xadhyphen zero\u200bwidth", LOW) == ["softhyphen zerowidth"]
    path = font_for(renderer, "A")
    by_path = Renderer(RenderSpec(font_names=(str(path),)))
    assert font_for(by_path, "A") == path
    assert np.array_equal(np.asarray(by_path.render(INVOICE, LOW).pages[0]),
                          np.asarray(Renderer(RenderSpec(font_names=(path.name,))).render(INVOICE, LOW).pages[0]))
    import argparse

    from jobs.ingest import render_args, render_spec

    parser = argparse.ArgumentParser()
    render_args(parser)
    assert render_spec(parser.parse_args(["--font", str(path), "--font", "NotoSansCJK-Regular.ttc"])).font_names == (
        str(path), "NotoSansCJK-Regular.ttc")
    assert render_spec(parser.parse_args([])).font_names == RenderSpec().font_names


def test_unknown_font_is_a_clear_error() -> None:
    with pytest.raises(RenderError, match="NoSuchFont.ttf"):
        Renderer(RenderSpec(font_names=("DejaVuSans.ttf", "NoSuchFont.ttf")))
    assert issubclass(RenderError, ValueError)


def test_render_all_tiers(renderer: Renderer) -> None:
    chunks = renderer.render_all_tiers(INVOICE)
    assert list(chunks) == ["low", "high"]
    (low,), (high,) = chunks["low"].pages, chunks["high"].pages
    assert high.size[0] / low.size[0] == pytest.approx(120 / 72, rel=0.05)


def test_png_bytes_are_identical_across_processes(renderer: Renderer) -> None:
    text = f"{INVOICE}\n{CJK}\n\u0915 tab\there\n" * 30
    here = {name: png_digests(c.pages) for name, c in renderer.render_all_tiers(text).items()}
    assert here == {name: png_digests(c.pages) for name, c in renderer.render_all_tiers(text).items()}
    script = textwrap.dedent(f"""
        import json

        from pipeline.runtime.render import Renderer
        from schemas.render import RenderSpec
        from tests.pipeline.runtime.test_render import png_digests
        chunks = Renderer(RenderSpec()).render_all_tiers({text!r})
        print(json.dumps({{name: png_digests(c.pages) for name, c in chunks.items()}}))
    """)
    repo_root = REPO
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=repo_root)
    assert json.loads(out.stdout) == here
