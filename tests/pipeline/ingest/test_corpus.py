"""Corpus readers: every input record ends as exactly one Document or one Rejection."""

from __future__ import annotations

import json
import os
import random
import struct
import tracemalloc
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.ingest.corpus import DocRef, discover, read_file
from pipeline.ingest.corpus.readers import CorpusError, read_corpus
from pipeline.ingest.corpus.records import parse_record
from pipeline.ingest.corpus.repeats import cross_file_rejections
from schemas.corpus import (
    Chunk,
    Document,
    FileFormat,
    MetaKey,
    ReaderSpec,
    Rejection,
    RejectReason,
    chunk_key,
    normalise_chunk_text,
)
from tests.support.paths import REPO

DATA = REPO / "jobs" / "data"
R = RejectReason


def _read(path: Path, spec: ReaderSpec = ReaderSpec()) -> list[Document | Rejection]:
    return list(read_file(str(path), str(path.parent), spec))


def _reasons(items: list[Document | Rejection]) -> list[RejectReason | None]:
    return [item.reason if isinstance(item, Rejection) else None for item in items]


def test_chunk_key_normalises_composition_trailing_space_and_blank_edges() -> None:
    composed, decomposed = "Caf\u00e9 menu", "Cafe\u0301 menu"
    assert chunk_key(composed) == chunk_key(decomposed)
    assert chunk_key("\n\n  a  \t\nb\n\n") == chunk_key("  a\nb") != chunk_key("a\nb")  # leading indent kept
    assert normalise_chunk_text("x \r\n y\t\n\n") == "x\n y"
    chunk = Chunk.build("doc#7", 3, "text", 1)
    assert chunk.chunk_id == "doc#7#00003" and chunk.chunk_key == chunk_key("text")


def test_rows_round_trip_and_rejections_match_the_quarantine_columns() -> None:
    from schemas.tables import QUARANTINE_SCHEMA

    doc = Document(doc_id="d", text="t\u200b", source="f.jsonl#L1", metadata={"k": "v", "b": "\u202e"})
    assert Document.from_row(doc.to_row()) == doc
    row = Rejection(source="f.jsonl#L2", doc_id=None, reason=R.TOO_LARGE, detail="x").model_dump(mode="json")
    assert row["reason"] == "too_large"
    assert set(row) == set(QUARANTINE_SCHEMA.names) - {"job_id", "rejected_at"}


def test_sample_corpus_reads_clean_and_questions_point_at_their_answers() -> None:
    items = _read(DATA / "sample_corpus.jsonl")
    docs = {item.doc_id: item for item in items if isinstance(item, Document)}
    assert len(items) == len(docs) == 12
    assert sum(len(d.text) for d in docs.values()) < 300_000
    questions = [json.loads(line) for line in (DATA / "questions.jsonl").read_text().splitlines()]
    assert len(questions) >= 6
    for q in questions:
        for doc_id in q["doc_ids"]:
            assert all(answer in docs[doc_id].text for answer in q["answers"]), q["id"]


def _jsonl_cases() -> list[tuple[bytes, RejectReason | None]]:
    ok = lambda i, text, **kw: json.dumps({"doc_id": i, "text": text, **kw}).encode()  # noqa: E731
    return [
        (ok("a", "plain text"), None),
        (ok("b", ""), R.EMPTY_TEXT),
        (ok("c", " \n\t "), R.EMPTY_TEXT),
        (json.dumps({"text": "no id"}).encode(), R.MISSING_ID),
        (ok("   ", "blank id"), R.MISSING_ID),
        (ok("a", "second a"), R.DUPLICATE_ID),
        (ok("d", 42), R.NON_STRING_TEXT),
        (ok("e", None), R.NON_STRING_TEXT),
        (ok("f", ["x"]), R.NON_STRING_TEXT),
        (b'{"doc_id": "g", "text": "caf\xe9"}', R.INVALID_UTF8),
        (ok("h", "bin\x00ary"), R.CONTROL_CHARACTERS),
        (ok("i", "lone \ud800 surrogate"), R.INVALID_UTF8),
        (b'{"doc_id": "j", "text": ', R.MALFORMED_RECORD),
        (b'["not", "an", "object"]', R.MALFORMED_RECORD),
        (b'{"doc_id": "k", "text": "x", "deep": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", R.MALFORMED_RECORD),
        (ok("l", "x" * 101), R.TOO_LARGE),
        (ok("m", "x", metadata={"qvpic.image_path": "/etc/passwd"}), R.MALFORMED_RECORD),
        (ok("n", "x", metadata=["not", "a", "dict"]), R.MALFORMED_RECORD),
        (ok({"nested": "id"}, "x"), R.MALFORMED_RECORD),
        (ok("o\nline", "x"), R.MALFORMED_RECORD),
        (json.dumps({"doc_id": "p"}).encode(), R.MALFORMED_RECORD),
        (ok(7, "integer ids are fine"), None),
        (ok("q", "zero\u200bwidth \u202ebidi\u202c kept"), None),
        (json.dumps({"_id": "lb1", "context": "Passage 1: ...", "input": "Q?", "answers": ["A"]}).encode(), None),
    ]


def test_every_jsonl_line_becomes_exactly_one_document_or_rejection(tmp_path: Path) -> None:
    cases = _jsonl_cases()
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join(line for line, _ in cases) + b"\n\n   \n")  # blank lines are not records
    items = _read(path, ReaderSpec(max_doc_chars=100))
    assert _reasons(items) == [reason for _, reason in cases]
    assert [item.source for item in items] == [f"mixed.jsonl#L{i + 1}" for i in range(len(cases))]
    docs = {item.doc_id: item for item in items if isinstance(item, Document)}
    assert docs["q"].text == "zero\u200bwidth \u202ebidi\u202c kept"
    assert docs["lb1"].text == "Passage 1: ..." and json.loads(docs["lb1"].metadata["answers"]) == ["A"]
    assert docs["lb1"].metadata["input"] == "Q?"
    duplicate = items[5]
    assert isinstance(duplicate, Rejection) and duplicate.doc_id == "a" and "mixed.jsonl#L1" in duplicate.detail


def test_text_policy_newlines_controls_and_bom(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    record = {"doc_id": "x", "text": "a\r\nb\rc\fd\x1b[31me\x7f\tf", "metadata": {"n": 3, "s": "v"}}
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(record).encode())
    [doc] = _read(path)
    assert isinstance(doc, Document)
    assert doc.text == "a\nb\nc\nd[31me\tf"
    assert doc.metadata == {"n": "3", "s": "v", MetaKey.REMOVED_CONTROL_CHARS.value: "2"}


def test_random_garbage_lines_are_all_accounted_for(tmp_path: Path) -> None:
    rng = random.Random(7)
    alphabet = b'{}[]":,\\ \x00\x01\xff\xfe\xc3\xa9abc0123456789'
    lines = [bytes(rng.choice(alphabet) for _ in range(rng.randint(1, 60))).replace(b"\n", b"")
             for _ in range(400)]
    lines += [json.dumps({"doc_id": f"d{i}", "text": "t" * rng.randint(0, 3)}).encode() for i in range(50)]
    rng.shuffle(lines)
    path = tmp_path / "garbage.jsonl"
    path.write_bytes(b"\n".join(lines))
    items = _read(path)
    assert len(items) == sum(1 for line in lines if line.strip(b" \t\r\x0b\x0c"))
    assert sum(isinstance(i, Document) for i in items) >= 30


def test_a_10mb_line_is_rejected_without_holding_it_and_the_next_line_is_read(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    with path.open("wb") as out:
        out.write(b'{"doc_id": "huge", "text": "' + b"y" * 10_000_000 + b'"}\n')
        out.write(b'{"doc_id": "after", "text": "fine"}\n')
    tracemalloc.start()
    items = _read(path, ReaderSpec(max_doc_chars=1000))
    _, peak_nbytes = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert _reasons(items) == [R.TOO_LARGE, None]
    assert peak_nbytes < 4_000_000
    assert _reasons(_read(path)) == [R.TOO_LARGE, None]  # default limits: parsed, then over max_doc_chars


def test_parquet_rows_are_validated_like_jsonl(tmp_path: Path) -> None:
    bad_utf8 = pa.Array.from_buffers(pa.binary(), 5, [None, pa.py_buffer(struct.pack("<6i", 0, 1, 2, 3, 4, 6)),
                                                     pa.py_buffer(b"abcd\xff\xfe")])
    table = pa.table({"doc_id": ["r0", "r1", None, "r0", "r4"], "text": bad_utf8,
                      "metadata": [{"k": "v"}, None, None, None, None]})
    path = tmp_path / "t.parquet"
    pq.write_table(table, path)
    items = _read(path)
    assert _reasons(items) == [None, None, R.MISSING_ID, R.DUPLICATE_ID, R.INVALID_UTF8]
    assert items[0].source == "t.parquet#row0" and items[0].metadata == {"k": "v"}
    pq.write_table(pa.table({"doc_id": ["a"], "body": ["x"]}), tmp_path / "cols.parquet")
    assert _reasons(_read(tmp_path / "cols.parquet")) == [R.MALFORMED_RECORD]
    (tmp_path / "corrupt.parquet").write_bytes(b"PAR1 this is not parquet")
    assert _reasons(_read(tmp_path / "corrupt.parquet")) == [R.UNREADABLE_FILE]
    pq.write_table(pa.table({"doc_id": ["n"], "text": [5]}), tmp_path / "ints.parquet")
    assert _reasons(_read(tmp_path / "ints.parquet")) == [R.NON_STRING_TEXT]


def test_folder_of_text_files_links_and_special_files(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.txt").write_text("outside the root")
    (root / "a.txt").write_text("alpha")
    (root / "sub" / "b.md").write_text("# beta\n")
    (root / "empty.md").write_text("  \n")
    (root / "latin1.txt").write_bytes(b"caf\xe9")
    (root / "big.txt").write_text("z" * 50)
    (root / "table.csv").write_text("a,b\n")
    os.symlink(outside / "secret.txt", root / "escape.txt")
    os.symlink(outside, root / "escape_dir")
    os.symlink(root / "a.txt", root / "alias.txt")
    os.symlink(root / "missing.txt", root / "dangling.txt")
    os.symlink(root / "sub", root / "sub_alias")  # inside the root: the walk reaches sub/ already
    os.mkfifo(root / "pipe.txt")
    (root / "new\nline.txt").write_text("a name no id may carry")
    os.close(os.open(os.path.join(os.fsencode(root), b"caf\xe9.txt"), os.O_CREAT | os.O_WRONLY))
    entries, refused = discover(str(root))
    assert [(r.source, r.reason) for r in refused] == [("caf\\xe9.txt", R.INVALID_UTF8)]
    assert [e.relpath for e in entries] == sorted(e.relpath for e in entries)
    spec = ReaderSpec(max_doc_chars=10)
    got = {e.relpath: _reasons(list(read_file(e.path, e.root, spec))) for e in entries}
    assert got == {"a.txt": [None], "sub/b.md": [None], "empty.md": [R.EMPTY_TEXT], "latin1.txt": [R.INVALID_UTF8],
                   "big.txt": [R.TOO_LARGE], "table.csv": [R.UNSUPPORTED_FILE], "escape.txt": [R.PATH_OUTSIDE_ROOT],
                   "escape_dir": [R.PATH_OUTSIDE_ROOT], "alias.txt": [None], "dangling.txt": [R.UNREADABLE_FILE],
                   "pipe.txt": [R.UNREADABLE_FILE], "new\nline.txt": [R.MALFORMED_RECORD]}
    [doc] = list(read_file(str(root / "sub" / "b.md"), str(root)))
    assert doc.doc_id == doc.source == "sub/b.md" and doc.text == "# beta\n"


def test_discover_a_single_file_and_a_missing_root(tmp_path: Path) -> None:
    path = tmp_path / "one.jsonl"
    path.write_text('{"doc_id": "x", "text": "y"}\n')
    [entry], [] = discover(str(path))
    assert entry.relpath == "one.jsonl" and entry.format is FileFormat.JSONL
    assert len(list(read_file(str(path), str(path)))) == 1
    with pytest.raises(CorpusError, match="does not exist"):
        discover(str(tmp_path / "nope"))


def test_cross_file_duplicate_ids_first_in_file_order_wins_whatever_the_input_order() -> None:
    refs = [DocRef(source=s, doc_id=d, text_key="k" * 64) for s, d in
            [("b.jsonl#L1", "x"), ("a.jsonl#L10", "y"), ("a.jsonl#L9", "y"), ("c.txt", "x"), ("a.jsonl#L2", "z")]]
    expected = {("a.jsonl#L10", "y"), ("c.txt", "x")}  # L9 < L10 numerically; b.jsonl < c.txt
    rng = random.Random(3)
    for _ in range(5):
        rng.shuffle(refs)
        rejected = cross_file_rejections(refs)
        assert {(r.source, r.doc_id) for r in rejected} == expected
        assert {r.reason for r in rejected} == {R.DUPLICATE_ID}


def test_read_corpus_accounts_for_every_input(tmp_path: Path) -> None:
    (tmp_path / "one.jsonl").write_text('{"doc_id": "x", "text": "1"}\n{"doc_id": "y", "text": ""}\n')
    (tmp_path / "two.jsonl").write_text('{"doc_id": "x", "text": "2"}\nnot json\n')
    (tmp_path / "x").write_text("a text file named like an id, no extension")
    docs, rejected = read_corpus(str(tmp_path))
    assert [d.source for d in docs] == ["one.jsonl#L1"]
    assert sorted((r.source, r.reason) for r in rejected) == [
        ("one.jsonl#L2", R.EMPTY_TEXT), ("two.jsonl#L1", R.DUPLICATE_ID), ("two.jsonl#L2", R.MALFORMED_RECORD),
        ("x", R.UNSUPPORTED_FILE)]


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def test_unreadable_images_are_quarantined(tmp_path: Path) -> None:
    from PIL import Image

    Image.new("RGB", (400, 300), "white").save(tmp_path / "blank.png")
    good = (tmp_path / "blank.png").read_bytes()
    (tmp_path / "truncated.png").write_bytes(good[: len(good) // 2])
    header = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 0, 0, 0, 0)  # 10 Gpx grey, declared only
    (tmp_path / "bomb.png").write_bytes(b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header)
                                        + _png_chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + _png_chunk(b"IEND", b""))
    (tmp_path / "text.jpg").write_text("not an image")
    Image.new("RGB", (20, 20)).save(tmp_path / "gif_inside.png", format="GIF")
    got = {name: _reasons(_read(tmp_path / name)) for name in
           ["blank.png", "truncated.png", "bomb.png", "text.jpg", "gif_inside.png"]}
    assert got == {"blank.png": [R.OCR_EMPTY], "truncated.png": [R.IMAGE_UNREADABLE], "bomb.png": [R.IMAGE_UNREADABLE],
                   "text.jpg": [R.IMAGE_UNREADABLE], "gif_inside.png": [R.IMAGE_UNREADABLE]}
    assert _reasons(_read(tmp_path / "blank.png", ReaderSpec(max_image_pixels=1000))) == [R.IMAGE_UNREADABLE]


def test_a_documents_collection_comes_from_its_metadata():
    spec = ReaderSpec()
    assert parse_record({"doc_id": "a", "text": "x", "metadata": {"collection": "acme"}}, "f#L1", spec).collection \
        == "acme"
    assert parse_record({"doc_id": "a", "text": "x", "collection": "acme.eu"}, "f#L1", spec).collection == "acme.eu"
    assert parse_record({"doc_id": "a", "text": "x"}, "f#L1", spec).collection == "public"
    for bad in ("acme corp", "", "*", "x" * 65, ["acme"]):
        rejected = parse_record({"doc_id": "a", "text": "x", "metadata": {"collection": bad}}, "f#L1", spec)
        assert isinstance(rejected, Rejection) and rejected.reason is RejectReason.MALFORMED_RECORD, bad
        assert "metadata 'collection' must be 1-64 characters" in rejected.detail
