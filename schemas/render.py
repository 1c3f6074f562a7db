"""How chunks become pages: the named resolution tiers and the page layout they are rendered with."""

from __future__ import annotations

from enum import Enum

from pydantic import Field, field_validator, model_validator

from schemas.frozen import Frozen


class Alignment(str, Enum):
    LEFT = "left"


class TierSpec(Frozen):
    """A named rendering resolution."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]{0,31}$")
    dpi: int = Field(ge=18, le=600)


DEFAULT_TIERS: tuple[TierSpec, ...] = (TierSpec(name="low", dpi=72), TierSpec(name="high", dpi=120))


class RenderSpec(Frozen):
    """Page layout of rendered chunks. Defaults follow Glyph's public rendering configuration
    (thu-coai/Glyph `config/config_en.json`: A4, 72 DPI, margins 10 pt, 9 pt font, leading 10 pt, left
    aligned, width and last page auto-cropped, newlines as line breaks, soft hyphens and zero-width
    spaces dropped), with these substitutions, each deliberate or unavoidable here:
    - font: Glyph renders Verdana, a Microsoft core font that cannot be installed offline here nor
      redistributed with qvpic; DejaVuSans (metrically close, humanist sans) stands in. A Glyph checkpoint
      reads what it was trained on: point `font_names` (`--font`) at a Verdana.ttf, e.g. the one in
      Glyph's repository (`config/Verdana.ttf`), first in the list;
    - rasteriser: Pillow/FreeType with hinted advances instead of ReportLab → PDF → poppler, so glyph
      anti-aliasing and line breaks can differ by a pixel or a word;
    - crop margins scale with the tier's DPI (Glyph keeps 10 px at any DPI), so every tier is the same
      page, only sharper; tabs expand to `tab_size_spaces` spaces (ReportLab collapses them).
    """

    page_width_pt: float = Field(595.0, gt=0)  # A4
    page_height_pt: float = Field(842.0, gt=0)
    margin_pt: float = Field(10.0, ge=0)
    font_size_pt: float = Field(9.0, gt=0)
    line_height_pt: float = Field(10.0, gt=0)
    alignment: Alignment = Alignment.LEFT
    # Tried in order per character; file names are resolved against the system font directories, absolute
    # paths used as they are.
    font_names: tuple[str, ...] = ("DejaVuSans.ttf", "NotoSans-Regular.ttf", "NotoSansCJK-Regular.ttc")
    tab_size_spaces: int = Field(4, ge=1, le=16)
    crop: bool = True  # crop the unused right margin and the empty tail of the last page
    max_pages_per_chunk: int = Field(8, ge=1)
    max_chars_per_chunk: int = Field(20_000, ge=1)
    tiers: tuple[TierSpec, ...] = DEFAULT_TIERS

    @field_validator("tiers")
    @classmethod
    def _unique_tiers(cls, tiers: tuple[TierSpec, ...]) -> tuple[TierSpec, ...]:
        if not tiers:
            raise ValueError("at least one tier is required")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        return tiers

    @model_validator(mode="after")
    def _fits_page(self) -> "RenderSpec":
        if 2 * self.margin_pt + self.line_height_pt > self.page_height_pt:
            raise ValueError("margins and one line do not fit on the page")
        if 2 * self.margin_pt >= self.page_width_pt:
            raise ValueError("margins leave no width on the page")
        return self

    def tier(self, name: str) -> TierSpec:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(f"unknown tier {name!r}; configured: {[t.name for t in self.tiers]}")

    @property
    def lowest_tier(self) -> TierSpec:
        return min(self.tiers, key=lambda t: t.dpi)

    @property
    def highest_tier(self) -> TierSpec:
        return max(self.tiers, key=lambda t: t.dpi)

