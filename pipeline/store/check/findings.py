"""What `qvpic verify` reports: one `Finding` per kind of inconsistency, and the evidence `--repair` acts on.

Imports nothing heavy, so the command line can describe a report without the store stack.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum

MAX_EXAMPLES = 5  # named in a finding; counts are always complete


class Check(str, Enum):
    """What a finding is about, in the order a store is checked."""

    MANIFEST = "manifest"  # manifest.json missing or unreadable
    GENERATION = "generation"  # the current serving generation's record or snapshot is broken
    SEAL = "seal"  # the current generation's HMAC seal is missing or does not match the key (--hmac-key-file)
    MISSING_PART = "missing_part"  # a part the current generation was built from is gone
    UNPUBLISHED_PART = "unpublished_part"  # a part written after the current generation (a note, not a problem)
    CHANGED_PART = "changed_part"  # a part changed size since (parts are written once)
    UNREADABLE_PART = "unreadable_part"  # a part's footer cannot be read, or its rows differ from the record
    ORPHAN_FILE = "orphan_file"  # a file in a table dir that no reader reads (a crashed write's temp file, a stray)
    MISSING_SHARD = "missing_shard"  # index rows point at a shard that is gone
    TORN_ENTRY = "torn_entry"  # an index row's byte range runs past its shard's end
    CORRUPT_ENTRY = "corrupt_entry"  # an entry's bytes fail its checksum (--deep)
    SERVED_SHARD_MISSING = "served_shard_missing"  # a live generation serves entries whose shard is gone
    MISSING_ENTRIES = "missing_entries"  # chunks lacking entries their manifest requires
    ORPHAN_SHARD = "orphan_shard"  # a shard no index row and no live generation references


class Severity(str, Enum):
    PROBLEM = "problem"  # the store is inconsistent: `qvpic verify` exits 1
    NOTE = "note"  # worth knowing, nothing wrong (e.g. parts a later job wrote, not yet published)


@dataclass(frozen=True)
class Finding:
    check: Check
    severity: Severity
    count: int
    detail: str
    examples: tuple[str, ...] = ()
    repair: str = ""  # what `--repair` does about it; "" when it cannot


@dataclass
class Evidence:
    """What `--repair` needs, collected by the scans (only bad things: small on a healthy store)."""

    bad_rows: dict[str, set[tuple[str, str]]] = field(default_factory=dict)  # part -> torn/corrupt (shard, key)
    missing_shards: set[str] = field(default_factory=set)
    parts_with_missing_shards: set[str] = field(default_factory=set)  # index parts with rows naming one
    orphan_files: list[str] = field(default_factory=list)  # store-relative
    lost_index_parts: int = 0
    lost_chunk_parts: int = 0
    num_orphan_shards: int = 0


@dataclass
class Report:
    store: str
    deep: bool
    findings: list[Finding] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)  # what was checked
    evidence: Evidence = field(default_factory=Evidence)
    repaired: list[str] = field(default_factory=list)  # what --repair did, in words

    @property
    def problems(self) -> list[Finding]:
        return [f for f in self.findings if f.severity is Severity.PROBLEM]

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, check: Check, count: int, detail: str, examples=(), repair: str = "",
            severity: Severity = Severity.PROBLEM) -> None:
        """Record a finding (none for a zero count); one of the same check and severity absorbs it."""
        if not count:
            return
        for i, f in enumerate(self.findings):
            if (f.check, f.severity) == (check, severity):
                self.findings[i] = Finding(check, severity, f.count + count,
                                           f.detail if detail == f.detail else f"{f.detail}; {detail}",
                                           (f.examples + tuple(examples))[:MAX_EXAMPLES], f.repair or repair)
                return
        self.findings.append(Finding(check, severity, count, detail, tuple(examples)[:MAX_EXAMPLES], repair))

    def to_json(self) -> dict:
        return {"store": self.store, "deep": self.deep, "ok": self.ok, "counts": self.counts,
                "findings": [{**asdict(f), "check": f.check.value, "severity": f.severity.value}
                             for f in self.findings],
                "repaired": self.repaired}
