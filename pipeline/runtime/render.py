"""Renders chunk text to page images at each resolution tier (Glyph-style layout, points → pixels).

Layout is done in pixels per tier (px = pt * dpi / 72) with that tier's hinted glyph advances, so text
never overflows the right margin at any tier; line breaks may therefore differ slightly between tiers.

Characters are drawn from the first font of `RenderSpec.font_names` that has a glyph for them.
Characters no configured font covers (and control characters other than tab and newline) are drawn as
U+FFFD "�" — a diamond with a question mark, visibly not a tofu box and not silently dropped — and
counted in `RenderedChunk.missing_glyphs`.

Output is deterministic: Pillow's BASIC layout engine is pinned, so pixels do not depend on whether
libraqm happens to be installed, and no randomness or clock enters rendering.
"""

from __future__ import annotations

import math
import unicodedata
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from schemas.render import RenderSpec, TierSpec

FONT_DIRS: tuple[Path, ...] = (
    Path("/usr/share/fonts"),
    Path("/usr/local/share/fonts"),
    Path.home() / ".local" / "share" / "fonts",
    Path.home() / ".fonts",
)
REPLACEMENT_CHAR = "\ufffd"
_LAST_RESORT_CHAR = "?"  # drawn for missing glyphs only if no configured font has U+FFFD either
# U+10FFFF is a Unicode noncharacter: no font maps it, so it always renders the font's .notdef glyph.
_UNMAPPED_PROBE = "\U0010ffff"
_PROBE_SIZE_PX = 48  # coverage probes at a size where .notdef and real glyphs cannot coincide by hinting
_TEXT_COLOR = 0
_PAPER_COLOR = 255


class RenderError(ValueError):
    """A chunk cannot be rendered under the configured limits, or the renderer is misconfigured."""


@dataclass
class RenderedChunk:
    pages: list[Image.Image]  # RGB, one per page, in reading order
    dpi: int
    tier: TierSpec
    missing_glyphs: int  # characters drawn as U+FFFD because no configured font covers them
    num_chars: int  # len() of the input text

    @property
    def num_pages(self) -> int:
        return len(self.pages)


class _Seg(Enum):
    SPACE = 0  # run of U+0020; kept inside a line, hangs (dropped) at a wrap
    WORD = 1  # run of non-space characters that is only broken when wider than a line
    WIDE = 2  # one East Asian wide/fullwidth character: a break opportunity on both sides


@dataclass(frozen=True)
class _Glyph:
    char: str  # what is drawn (REPLACEMENT_CHAR when the source character is missing)
    font: int  # index into the font chain
    kind: _Seg
    missing: bool


def resolve_font(name: str) -> Path:
    """Absolute path of a font file given by path or by file name under the system font dirs."""
    direct = Path(name).expanduser()
    if direct.is_absolute():
        if direct.is_file():
            return direct
        raise RenderError(f"font file {name!r} does not exist")
    for root in FONT_DIRS:
        if root.is_dir():
            # sorted: the same file wins on every machine that has several copies
            hits = sorted(p for p in root.rglob(name) if p.is_file())
            if hits:
                return hits[0]
    raise RenderError(f"font {name!r} not found under {[str(d) for d in FONT_DIRS]}")


def pt_to_px(length_pt: float, dpi: int) -> float:
    return length_pt * dpi / 72.0


def _load_font(path: Path, size_px: float) -> ImageFont.FreeTypeFont:
    return ImageFont.truetype(str(path), size_px, layout_engine=ImageFont.Layout.BASIC)


def _signature(font: ImageFont.FreeTypeFont, ch: str) -> tuple[float, bytes]:
    """Advance and pixels of `ch`; equal to the .notdef signature exactly when the font lacks `ch`."""
    canvas = Image.new("L", (3 * _PROBE_SIZE_PX, 3 * _PROBE_SIZE_PX), 0)
    ImageDraw.Draw(canvas).text((_PROBE_SIZE_PX, 2 * _PROBE_SIZE_PX), ch, font=font, fill=255, anchor="ls")
    return font.getlength(ch), canvas.tobytes()


class _TierFonts:
    """Fonts and metrics of one DPI; advances are cached per glyph since wrapping measures every char."""

    def __init__(self, paths: tuple[Path, ...], spec: RenderSpec, dpi: int) -> None:
        self.fonts = [_load_font(p, pt_to_px(spec.font_size_pt, dpi)) for p in paths]
        self.line_height_px = pt_to_px(spec.line_height_pt, dpi)
        self.margin_px = pt_to_px(spec.margin_pt, dpi)
        self.page_width_px = round(pt_to_px(spec.page_width_pt, dpi))
        self.page_height_px = round(pt_to_px(spec.page_height_pt, dpi))
        self.text_width_px = self.page_width_px - 2 * self.margin_px
        self.lines_per_page = max(1, math.floor((spec.page_height_pt - 2 * spec.margin_pt) / spec.line_height_pt))
        ascent_px, descent_px = self.fonts[0].getmetrics()
        # All fonts share the first font's baseline, centred in the line box.
        self.baseline_px = (self.line_height_px - (ascent_px + descent_px)) / 2 + ascent_px
        self._advance: dict[tuple[int, str], float] = {}

    def advance(self, g: _Glyph) -> float:
        key = (g.font, g.char)
        if key not in self._advance:
            self._advance[key] = self.fonts[g.font].getlength(g.char)
        return self._advance[key]


class Renderer:
    """Heavy init once (resolve and load fonts); then `render` is pure and deterministic."""

    def __init__(self, spec: RenderSpec) -> None:
        self.spec = spec
        self.font_paths = tuple(resolve_font(n) for n in spec.font_names)
        self._probes = [_load_font(p, _PROBE_SIZE_PX) for p in self.font_paths]
        self._notdef = [_signature(f, _UNMAPPED_PROBE) for f in self._probes]
        self._glyphs: dict[str, _Glyph] = {}
        covering = self._covering_font(REPLACEMENT_CHAR)
        self._replacement = (REPLACEMENT_CHAR, covering) if covering is not None else (_LAST_RESORT_CHAR, 0)
        self._tiers: dict[int, _TierFonts] = {}
        for t in spec.tiers:
            self._tier_fonts(t.dpi)

    def layout(self, text: str, tier: TierSpec) -> list[str]:
        """The lines `render` draws for `text` at `tier` (after wrapping, before paging)."""
        lines, _ = self._layout(self._normalize(text), self._tier_fonts(tier.dpi))
        return ["".join(g.char for g in line) for line in lines]

    def page_count(self, text: str, tier: TierSpec) -> int:
        """How many pages `render` would draw for `text` at `tier`: the layout alone, no page drawn (the inspector
        checks a requested page against it before rendering)."""
        tf = self._tier_fonts(tier.dpi)
        lines, _ = self._layout(self._normalize(text), tf)
        return math.ceil(len(lines) / tf.lines_per_page)

    def render_all_tiers(self, text: str) -> dict[str, RenderedChunk]:
        return {t.name: self.render(text, t) for t in self.spec.tiers}

    def render(self, text: str, tier: TierSpec) -> RenderedChunk:
        if len(text) > self.spec.max_chars_per_chunk:
            raise RenderError(
                f"chunk has {len(text)} characters, above max_chars_per_chunk={self.spec.max_chars_per_chunk}"
            )
        tf = self._tier_fonts(tier.dpi)
        lines, missing = self._layout(self._normalize(text), tf)
        num_pages = math.ceil(len(lines) / tf.lines_per_page)
        if num_pages > self.spec.max_pages_per_chunk:
            raise RenderError(
                f"chunk needs {num_pages} pages at {tier.dpi} DPI, above max_pages_per_chunk="
                f"{self.spec.max_pages_per_chunk}"
            )
        pages = [
            self._draw_page(lines[i : i + tf.lines_per_page], tf, is_last=i + tf.lines_per_page >= len(lines))
            for i in range(0, len(lines), tf.lines_per_page)
        ]
        return RenderedChunk(pages=pages, dpi=tier.dpi, tier=tier, missing_glyphs=missing, num_chars=len(text))

    @staticmethod
    def _normalize(text: str) -> str:
        # Glyph's renderer drops soft hyphens and zero-width spaces before layout; so do we (fonts that
        # have a glyph for U+00AD would otherwise draw a visible hyphen mid-word).
        normalized = unicodedata.normalize("NFC", text).replace("\xad", "").replace("\u200b", "")
        if not normalized.strip():
            raise RenderError("chunk text is empty or whitespace only; nothing to render")
        return normalized

    def _tier_fonts(self, dpi: int) -> _TierFonts:
        if dpi not in self._tiers:  # a tier outside the spec: load once, then reuse
            self._tiers[dpi] = _TierFonts(self.font_paths, self.spec, dpi)
        return self._tiers[dpi]

    def _covering_font(self, ch: str) -> int | None:
        for i, probe in enumerate(self._probes):
            if _signature(probe, ch) != self._notdef[i]:
                return i
        return None

    def _glyph(self, ch: str) -> _Glyph:
        g = self._glyphs.get(ch)
        if g is None:
            kind = _Seg.SPACE if ch == " " else _Seg.WIDE if unicodedata.east_asian_width(ch) in "WF" else _Seg.WORD
            # Cc/Cs: control characters and lone surrogates have no drawable form in any font.
            font = None if unicodedata.category(ch) in ("Cc", "Cs") else self._covering_font(ch)
            if font is None:
                g = _Glyph(self._replacement[0], self._replacement[1], kind, missing=True)
            else:
                g = _Glyph(ch, font, kind, missing=False)
            self._glyphs[ch] = g
        return g

    def _layout(self, text: str, tf: _TierFonts) -> tuple[list[list[_Glyph]], int]:
        """Greedy line fill; returns lines of glyphs (trailing spaces stripped) and the missing count."""
        lines: list[list[_Glyph]] = []
        missing = 0
        for logical in text.splitlines():  # \n, \r\n, \r, \v, \f, U+2028, ...; a final newline adds no line
            glyphs = [self._glyph(c) for c in logical.expandtabs(self.spec.tab_size_spaces)]
            missing += sum(g.missing for g in glyphs)
            lines.extend(_wrap(glyphs, tf))
        return lines, missing

    def _draw_page(self, lines: list[list[_Glyph]], tf: _TierFonts, is_last: bool) -> Image.Image:
        page = Image.new("L", (tf.page_width_px, tf.page_height_px), _PAPER_COLOR)
        draw = ImageDraw.Draw(page)
        right_px = tf.margin_px
        for row, line in enumerate(lines):
            x_px = tf.margin_px
            y_px = tf.margin_px + row * tf.line_height_px + tf.baseline_px
            for font_index, run in _runs(line):
                font = tf.fonts[font_index]
                draw.text((x_px, y_px), run, font=font, fill=_TEXT_COLOR, anchor="ls")
                x_px += font.getlength(run)
            right_px = max(right_px, x_px)
        if self.spec.crop:
            width_px = min(tf.page_width_px, math.ceil(right_px + tf.margin_px))
            height_px = tf.page_height_px
            if is_last:
                used_px = 2 * tf.margin_px + len(lines) * tf.line_height_px
                height_px = min(tf.page_height_px, math.ceil(used_px))
            page = page.crop((0, 0, width_px, height_px))
        return page.convert("RGB")


def _segments(glyphs: list[_Glyph]) -> list[list[_Glyph]]:
    segs: list[list[_Glyph]] = []
    for g in glyphs:
        if segs and g.kind is not _Seg.WIDE and segs[-1][0].kind is g.kind:
            segs[-1].append(g)
        else:
            segs.append([g])
    return segs


def _wrap(glyphs: list[_Glyph], tf: _TierFonts) -> list[list[_Glyph]]:
    """Wrap one logical line; an empty logical line yields one empty (blank) line."""
    out: list[list[_Glyph]] = []
    line: list[_Glyph] = []
    width_px = 0.0
    limit_px = tf.text_width_px

    def flush() -> None:
        nonlocal line, width_px
        while line and line[-1].kind is _Seg.SPACE:  # spaces hang at a wrap point
            line.pop()
        out.append(line)
        line, width_px = [], 0.0

    for seg in _segments(glyphs):
        seg_px = sum(tf.advance(g) for g in seg)
        if width_px + seg_px <= limit_px:
            line.extend(seg)
            width_px += seg_px
            continue
        if seg[0].kind is _Seg.SPACE:  # the run reaches the margin: the rest of it hangs
            flush()
            continue
        if any(g.kind is not _Seg.SPACE for g in line):
            flush()
            if seg_px <= limit_px:
                line.extend(seg)
                width_px = seg_px
                continue
        for g in seg:  # wider than a whole line: break at the line width, never overflow
            g_px = tf.advance(g)
            if line and width_px + g_px > limit_px:
                flush()
            line.append(g)
            width_px += g_px
    if line or not out:
        flush()
    return out


def _runs(line: list[_Glyph]) -> list[tuple[int, str]]:
    """Maximal same-font runs: one draw call per run instead of per character."""
    runs: list[tuple[int, list[str]]] = []
    for g in line:
        if runs and runs[-1][0] == g.font:
            runs[-1][1].append(g.char)
        else:
            runs.append((g.font, [g.char]))
    return [(font, "".join(chars)) for font, chars in runs]
