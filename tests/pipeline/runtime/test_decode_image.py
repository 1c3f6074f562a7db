"""Issue 60: a chat image is judged by the decoders of the formats accepted and by its header's size before a pixel
is decoded (pipeline/runtime/conversation.py `decode_image`)."""

from __future__ import annotations

import io

import pytest
from PIL import Image, ImageFile

from pipeline.runtime.conversation import decode_image


def encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


@pytest.fixture
def tried(monkeypatch) -> list[str]:
    """The formats whose decoder Pillow asked whether it reads the bytes (its plugins' `accept`)."""
    Image.preinit()
    asked = []
    for fmt in ("BMP", "GIF", "PPM"):  # registered before PNG: Pillow asks them first
        factory, accept = Image.OPEN[fmt]
        monkeypatch.setitem(Image.OPEN, fmt, (factory, lambda prefix, fmt=fmt, accept=accept:
                                              asked.append(fmt) or (accept(prefix) if accept else True)))
    return asked


def test_only_the_accepted_formats_decoders_are_tried(tried):
    image = Image.new("RGB", (8, 8), "red")
    decoded = decode_image(encoded(image, "PNG"), 10**6)
    assert (decoded.width_px, decoded.height_px) == (8, 8)
    with pytest.raises(ValueError, match="does not decode as PNG, JPEG or WebP"):
        decode_image(encoded(image, "GIF"), 10**6)  # a format Pillow reads, not one accepted
    assert tried == []


def test_a_large_image_is_refused_from_its_header_before_any_pixel_is_decoded(monkeypatch):
    data = encoded(Image.new("1", (4_000, 4_000)), "PNG")  # 16 MP, a few kB: what a decompression bomb looks like
    loads = []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: loads.append(1))
    with pytest.raises(ValueError, match="4000x4000 = 16000000 pixels; at most 1000000"):
        decode_image(data, 10**6)
    assert loads == []
    decode_image(encoded(Image.new("1", (10, 10)), "PNG"), 10**6)
    assert loads == [1]  # control: within the limit, it is decoded
