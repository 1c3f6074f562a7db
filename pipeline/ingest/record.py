"""Whether a rerun has anything to do: the record of each finished ingest, keyed by what it read and how.

A scheduled re-ingest of a corpus that has not changed would otherwise pay the pipeline's fixed cost
(Ray start-up, reading and chunking every document, the dedup join against the store) to find that
every chunk is stored already. A finished job writes `ingests/<key>.json`: the key is a sha256 over
the corpus's contents (every file's relative path, size and sha256, in path order) and everything
that decides what the job produces (reader limits, chunk size, the variants and the fingerprint of
every entry slot, the embedder). The record names the generation the job published. A later run
with the same key is a no-op exactly when the store still serves that generation: nothing was
published since (no recompile, no other ingest), so rerunning would read the same inputs into the
same store and publish nothing new. `qvpic ingest --force` runs the pipeline anyway.

Hashing reads the corpus once in the driver, streamed (memory flat in corpus size); it costs about
what reading the files costs, a small share of a job that renders, embeds and compiles them.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass
from typing import Any

from pipeline.ingest.corpus import RemoteFiles, discover
from pipeline.ingest.summary import IngestSummary
from pipeline.store import Store, entry_slots, slot_name
from schemas.corpus import ReaderSpec
from schemas.modes import Variant
from schemas.store import Manifest, StoreSpec

RECORDS = "ingests"
_READ_NBYTES = 1 << 20


def corpus_digest(corpus: str, location: StoreSpec | None = None) -> str:
    """sha256 over every corpus file's relative path, size and contents, in path order (names refused by
    `discover` included, so a refused file appearing changes the digest too). `location`: an object-store
    corpus, digested by the same definition (remote.RemoteFiles.digest)."""
    if location is not None:
        return RemoteFiles(location).digest()
    files, refused = discover(corpus)
    digest = hashlib.sha256()
    for f in files:
        content = hashlib.sha256()
        size = 0
        try:
            if os.path.islink(f.path):  # where it points decides what the reader does with it
                content.update(f"link: {os.readlink(f.path)}".encode())
            mode = os.stat(f.path).st_mode
            if not stat.S_ISREG(mode):  # a FIFO, socket or device: opening it could block; the reader rejects it
                content.update(f"not a regular file: {stat.S_IFMT(mode)}".encode())
            else:
                with open(f.path, "rb") as stream:
                    while block := stream.read(_READ_NBYTES):
                        content.update(block)
                        size += len(block)
        except OSError as e:  # unreadable here (a dangling link, no permission): the pipeline quarantines it
            content.update(f"unreadable: {type(e).__name__}".encode())
        digest.update(json.dumps([f.relpath, size, content.hexdigest()]).encode())
    for r in refused:
        digest.update(json.dumps(["refused", r.source]).encode())
    return digest.hexdigest()


def run_key(corpus: str, location: StoreSpec | None, reader: ReaderSpec, chunk_tokens: int,
            variants: tuple[Variant, ...], manifest: Manifest, options: dict[str, Any]) -> str:
    """What a job reads and how it builds: equal keys over an unchanged store produce the same store.
    `options`: the job's other switches that change what it writes (e.g. legibility scores)."""
    slots = {slot_name(t, v): manifest.entry_fingerprint(v, t) for t, v in entry_slots(manifest, variants)}
    spec = {"corpus": corpus_digest(corpus, location), "reader": reader.model_dump(mode="json"),
            "chunk_tokens": chunk_tokens,
            "slots": slots, "lazy_tiers": list(manifest.lazy_tiers),
            "embedder": [manifest.embedder, manifest.embedding_dim],
            "options": options}
    return hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class IngestRecord:
    key: str
    job_id: str
    generation: int  # what the job published
    summary: dict[str, Any]

    @property
    def rel(self) -> str:
        return f"{RECORDS}/{self.key}.json"


def unchanged_since(store: Store, key: str, current_generation: int | None) -> IngestRecord | None:
    """The finished job with this key, when the store still serves the generation it published."""
    try:
        data = json.loads(store.blobs.get(f"{RECORDS}/{key}.json"))
    except FileNotFoundError:
        return None
    record = IngestRecord(key=key, job_id=data["job_id"], generation=int(data["generation"]), summary=data["summary"])
    return record if current_generation == record.generation else None


def write_record(store: Store, key: str, summary: IngestSummary, generation: int) -> None:
    record = {"job_id": summary.job_id, "generation": generation, "summary": summary.to_dict()}
    store.blobs.put(f"{RECORDS}/{key}.json", json.dumps(record, sort_keys=True).encode())


def skipped_summary(job_id: str, record: IngestRecord) -> IngestSummary:
    """This run's summary: the recorded job's accounting (same inputs, same outcome), no work done."""
    s = record.summary
    return IngestSummary(job_id=job_id, inputs=s["inputs"], indexed=s["indexed"], deduplicated=s["deduplicated"],
                         quarantined=dict(s["quarantined"]), num_chunks=s["num_chunks"],
                         num_chunk_texts=s["num_chunk_texts"], num_chunks_compiled=0, num_chunks_embedded=0,
                         num_chunks_published=0, unchanged_since=record.job_id)
