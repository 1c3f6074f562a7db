"""A corpus built to break ingestion: every input is accounted for, duplicates compile once, memory stays bounded.

Binary garbage, invalid UTF-8 (in records and in file names), zero-width and bidi text, a 10 MB single
line, 100k short duplicate documents, JSON nested past the parser's limit, a decompression bomb,
truncated and fake images, a FIFO, and links that escape the root, dangle or loop. The ingest runs in
this process, so the driver's resident memory is sampled while it runs.
"""

from __future__ import annotations

import io
import json
import os
import random
import struct
import threading
import time
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from PIL import Image

from benchmarks.scale.load import rss_nbytes
from pipeline.ingest import IngestConfig, ingest
from pipeline.store import Store
from schemas.store import StoreSpec
from tests.e2e.test_ingest_e2e import assert_complete
from tests.support.ray_fixtures import ray_session  # noqa: F401  (pytest fixture)

pytestmark = pytest.mark.e2e

NUM_DUPLICATES = 100_000
DUPLICATE_TEXT = "The Harbour Office opens at 07:30 and closes at 16:00 on weekdays."
GARBAGE_LINES = 200
HUGE_LINE_CHARS = 10_000_000  # above ReaderSpec.max_doc_chars (5M): quarantined, never chunked
DRIVER_RSS_GROWTH_LIMIT_NBYTES = 1 << 30  # measured ~0.7 GiB; gathering every row on the driver took 2.1 GiB

UNICODE_TEXTS = {  # all of these are prose a user may legitimately send: indexed, not rejected
    "zero-width": "Zero\u200bwidth\u200cjoin\u200ders and a BOM\ufeff inside the part number ZW-\u200b5521.",
    "bidi": "Bidi override \u202egnirts desrever\u202c and isolates \u2066\u05e9\u05dc\u05d5\u05dd\u2069 around RTL.",
    "mixed-scripts": "Mixed: \u0627\u0644\u0633\u0644\u0627\u0645 \u05e9\u05dc\u05d5\u05dd \u4f60\u597d "
                     "e\u0301\u0301\u0301 \U0001f469\u200d\U0001f52c.",
    "only-invisible": "\u200b\u200c\u200d\u2060\u2066\u2069",  # nothing visible: a blank page, still a document
}


@dataclass(frozen=True)
class Expected:
    inputs: int
    indexed: int
    deduplicated: int
    quarantined: dict[str, int]  # reason -> count
    distinct_texts: int


def png_bomb(width_px: int, height_px: int) -> bytes:
    """A real PNG of white greyscale pixels: ~70 KB on disk, width*height bytes once decoded."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\x00" + b"\xff" * width_px  # filter byte + pixels
    packer = zlib.compressobj(9)
    body = b"".join(packer.compress(row) for _ in range(height_px)) + packer.flush()
    header = struct.pack(">IIBBBBB", width_px, height_px, 8, 0, 0, 0, 0)  # 8-bit greyscale
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", body) + chunk(b"IEND", b"")


def build_hostile_corpus(root: Path) -> Expected:
    rng = random.Random(8)
    root.mkdir(parents=True)
    quarantined: Counter[str] = Counter()
    inputs = indexed = deduplicated = 0

    # binary garbage: every line holds a byte that is never valid UTF-8, and no line is blank
    lines = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))).replace(b"\n", b"") + b"\xff"
             for _ in range(GARBAGE_LINES)]
    (root / "garbage.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (root / "garbage.bin").write_bytes(os.urandom(4096))
    inputs += GARBAGE_LINES + 1
    quarantined.update({"invalid_utf8": GARBAGE_LINES, "unsupported_file": 1})

    # invalid UTF-8 inside records and files, lone surrogates, NUL, and a file name that is not UTF-8
    (root / "encodings.jsonl").write_bytes(b"\n".join([
        b'{"doc_id": "latin1", "text": "caf\xe9 cr\xe8me"}',
        b'{"doc_id": "surrogate", "text": "half a pair \\ud800 here"}',
        b'{"doc_id": "nul", "text": "binary\\u0000inside"}',
        b'{"doc_id": "overlong", "text": "\xc0\xaf slash"}',
    ]) + b"\n")
    (root / "latin1.txt").write_bytes(b"Stra\xdfe ohne UTF-8")
    (root / os.fsdecode(b"name-\xff\xfe.txt")).write_text("a valid body behind an invalid name")
    inputs += 6
    quarantined.update({"invalid_utf8": 5, "control_characters": 1})

    # zero-width and bidi characters are text: indexed like any other
    (root / "unicode.jsonl").write_text("".join(json.dumps({"doc_id": k, "text": v}) + "\n"
                                                for k, v in UNICODE_TEXTS.items()))
    inputs += len(UNICODE_TEXTS)

    # a 10 MB single line, as a JSONL record and as a text file
    huge = "x" * HUGE_LINE_CHARS
    (root / "huge_line.jsonl").write_text(json.dumps({"doc_id": "huge", "text": huge}) + "\n")
    (root / "huge_line.txt").write_text(huge)
    inputs += 2
    quarantined.update({"too_large": 2})

    # 100k short documents with one text: one compile, 99,999 deduplicated
    with open(root / "duplicates.jsonl", "w") as out:
        for i in range(NUM_DUPLICATES):
            out.write(json.dumps({"doc_id": f"dup-{i:06d}", "text": DUPLICATE_TEXT}) + "\n")
    inputs += NUM_DUPLICATES
    indexed += 1
    deduplicated += NUM_DUPLICATES - 1

    # JSON nested beyond the parser's recursion limit, in the record and in its metadata
    deep = 200_000
    (root / "nested.jsonl").write_text("\n".join([
        "[" * deep + "]" * deep,
        '{"doc_id": "deep-meta", "text": "shallow text", "metadata": {"m": ' + "[" * deep + "]" * deep + "}}",
        '{"doc_id": "fine", "text": "A shallow record after the deep ones still reads."}',
    ]) + "\n")
    inputs += 3
    indexed += 1
    quarantined.update({"malformed_record": 2})

    # images: a decompression bomb (8000 x 8000 px in ~70 KB), truncated PNG and JPEG, text posing as a PNG
    (root / "bomb.png").write_bytes(png_bomb(8000, 8000))
    page = Image.effect_noise((600, 400), 64).convert("RGB")
    for suffix, fmt in (("png", "PNG"), ("jpg", "JPEG")):
        buffer = io.BytesIO()
        page.save(buffer, format=fmt)
        (root / f"truncated.{suffix}").write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    (root / "fake.png").write_text("this is not a PNG")
    inputs += 4
    quarantined.update({"image_unreadable": 4})

    # links and special files: escaping file and folder, dangling, a loop, a FIFO, one link that stays inside
    (root / "inside.txt").write_text("A file that a link inside the corpus points at.")
    (root / "escape.txt").symlink_to("/etc/hostname")
    (root / "escape_dir").symlink_to("/etc")
    (root / "dangling.txt").symlink_to(root / "missing.txt")
    (root / "loop.txt").symlink_to(root / "loop.txt")
    (root / "alias.txt").symlink_to(root / "inside.txt")
    os.mkfifo(root / "pipe.txt")
    inputs += 7
    indexed += 1
    deduplicated += 1  # alias.txt repeats inside.txt's text
    quarantined.update({"path_outside_root": 2, "unreadable_file": 3})
    return Expected(inputs=inputs, indexed=indexed, deduplicated=deduplicated, quarantined=dict(quarantined),
                    distinct_texts=3 + len(UNICODE_TEXTS))


class PeakRss:
    """Samples this process's resident set every 20 ms (the driver's, where ingest gathers its rows)."""

    def __init__(self) -> None:
        self.start_nbytes = self.peak_nbytes = rss_nbytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak_nbytes = max(self.peak_nbytes, rss_nbytes())

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth_nbytes(self) -> int:
        return self.peak_nbytes - self.start_nbytes


def test_hostile_corpus_is_accounted_for_with_bounded_memory(ray_session, tmp_path):
    from ray.data import DataContext

    DataContext.get_current().enable_progress_bars = False
    expected = build_hostile_corpus(tmp_path / "corpus")
    store_uri = str(tmp_path / "store")
    with PeakRss() as rss:
        started = time.perf_counter()
        summary = ingest(IngestConfig(corpus=str(tmp_path / "corpus"), store=StoreSpec(uri=store_uri), chunk_tokens=64))
        wall_s = time.perf_counter() - started
    print(f"hostile ingest: {wall_s:.1f} s, driver RSS +{rss.growth_nbytes / 2**20:.0f} MiB, {summary.to_dict()}")
    assert summary.balanced, summary.to_dict()
    assert (summary.inputs, summary.deduplicated) == (expected.inputs, expected.deduplicated)
    assert summary.quarantined == expected.quarantined
    assert summary.indexed == expected.indexed + len(UNICODE_TEXTS)  # invisible and bidi text is still text
    assert summary.num_chunks_compiled == expected.distinct_texts  # the 100k duplicates compiled once
    assert rss.growth_nbytes < DRIVER_RSS_GROWTH_LIMIT_NBYTES
    store = Store.open(store_uri)
    assert store.quarantined(job_id=summary.job_id).num_rows == summary.num_quarantined
    assert_complete(store)
