"""The rerun key's corpus digest: by content, never blocked by what the readers reject."""

from __future__ import annotations

import os

from pipeline.ingest.record import corpus_digest


def test_the_digest_follows_content_not_timestamps_and_never_opens_a_fifo(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"doc_id": "a", "text": "Atlas pump AP-100."}\n')
    os.mkfifo(tmp_path / "pipe.txt")  # opening it for reading would block until a writer came
    os.symlink(tmp_path / "missing.txt", tmp_path / "dangling.txt")
    first = corpus_digest(str(tmp_path))
    os.utime(tmp_path / "a.jsonl", (0, 0))
    assert corpus_digest(str(tmp_path)) == first  # touched, same bytes
    (tmp_path / "a.jsonl").write_text('{"doc_id": "a", "text": "Atlas pump AP-101."}\n')
    assert corpus_digest(str(tmp_path)) != first  # one character
    changed = corpus_digest(str(tmp_path))
    (tmp_path / "missing.txt").write_text("now the link resolves")
    assert corpus_digest(str(tmp_path)) != changed  # a new file, and the link now reads it
