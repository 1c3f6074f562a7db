"""Page-image inputs: OCR text, perceptual hash, and near-duplicate detection across files."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from PIL import Image, ImageDraw, ImageFont

from pipeline.ingest.corpus import DocRef, read_file
from pipeline.ingest.corpus.page_images import perceptual_hash, phash_distance_bits
from pipeline.ingest.corpus.readers import read_corpus
from pipeline.ingest.corpus.repeats import cross_file_rejections
from pipeline.runtime import OcrUnavailable
from schemas.corpus import Document, MetaKey, ReaderSpec, RejectReason

FONT = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"


def _page(lines: list[str]) -> Image.Image:
    image = Image.new("RGB", (900, 120 + 60 * len(lines)), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.truetype(FONT, 36)
    for i, line in enumerate(lines):
        draw.text((40, 50 + 60 * i), line, fill="black", font=font)
    return image


@pytest.fixture(scope="module")
def pages() -> dict[str, Image.Image]:
    return {"invoice": _page(["Invoice 4471 from Halden Tools", "Total due: 1250 EUR"]),
            "changed": _page(["Invoice 4471 from Halden Tools", "Total due: 1850 EUR"]),
            "other": _page(["Meeting notes", "Budget approved for dock 7", "Next review in July"])}


def test_phash_is_stable_under_re_encoding_and_separates_different_pages(pages: dict[str, Image.Image]) -> None:
    invoice = perceptual_hash(pages["invoice"])
    assert len(invoice) == 16 and invoice == perceptual_hash(pages["invoice"].copy())
    buffer = io.BytesIO()
    pages["invoice"].save(buffer, format="JPEG", quality=70)
    assert phash_distance_bits(invoice, perceptual_hash(Image.open(buffer))) <= 4
    assert phash_distance_bits(invoice, perceptual_hash(pages["invoice"].resize((450, 120)))) <= 6
    assert phash_distance_bits(invoice, perceptual_hash(pages["other"])) > 12


def test_ocr_documents_and_near_duplicates_need_equal_text(tmp_path: Path, pages: dict[str, Image.Image]) -> None:
    pages["invoice"].save(tmp_path / "a_invoice.png")
    pages["invoice"].save(tmp_path / "b_invoice_rescan.jpg", quality=90)
    pages["changed"].save(tmp_path / "c_invoice_changed.png")  # one digit apart: pHash alone would merge it
    pages["other"].save(tmp_path / "d_other.png")
    docs, rejected = read_corpus(str(tmp_path))
    by_id = {doc.doc_id: doc for doc in docs}
    assert sorted(by_id) == ["a_invoice.png", "c_invoice_changed.png", "d_other.png"]
    assert [(r.doc_id, r.reason) for r in rejected] == [("b_invoice_rescan.jpg", RejectReason.NEAR_DUPLICATE_IMAGE)]
    assert "a_invoice.png" in rejected[0].detail
    invoice: Document = by_id["a_invoice.png"]
    assert "1250" in invoice.text and "Halden" in invoice.text and "1850" in by_id["c_invoice_changed.png"].text
    assert invoice.image_path == str((tmp_path / "a_invoice.png").resolve())
    assert invoice.metadata[MetaKey.IMAGE_PHASH.value] == perceptual_hash(pages["invoice"])
    assert by_id["d_other.png"].image_path is not None


def test_near_duplicate_threshold_is_the_specs() -> None:
    def ref(name: str, phash: str, text_key: str = "t" * 64) -> DocRef:
        return DocRef(source=name, doc_id=name, text_key=text_key, image_phash=phash)

    refs = [ref("a.png", "0" * 16), ref("b.png", "0" * 15 + "7"), ref("c.png", "0" * 13 + "3ff"),
            ref("d.png", "0" * 16, text_key="u" * 64)]  # 3 bits, 10 bits, and identical but other text
    assert [r.doc_id for r in cross_file_rejections(refs, ReaderSpec(max_phash_distance_bits=6))] == ["b.png"]
    assert [r.doc_id for r in cross_file_rejections(refs, ReaderSpec(max_phash_distance_bits=10))] == ["b.png", "c.png"]
    assert cross_file_rejections(refs, ReaderSpec(max_phash_distance_bits=2)) == []


def test_a_missing_ocr_engine_stops_the_read_instead_of_quarantining(tmp_path: Path, pages: dict[str, Image.Image],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import pytesseract

    pages["other"].save(tmp_path / "page.png")
    monkeypatch.setattr(pytesseract.pytesseract, "tesseract_cmd", str(tmp_path / "no-tesseract"))
    with pytest.raises(OcrUnavailable, match="not installed"):
        list(read_file(str(tmp_path / "page.png"), str(tmp_path)))
    monkeypatch.undo()
    with pytest.raises(OcrUnavailable, match="klingon"):
        list(read_file(str(tmp_path / "page.png"), str(tmp_path), ReaderSpec(ocr_lang="klingon")))
