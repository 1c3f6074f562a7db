"""What an ingestion or recompile job did, in numbers; `indexed + deduplicated + quarantined == inputs`."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class IngestSummary:
    job_id: str
    inputs: int  # documents read + records rejected by the readers
    indexed: int
    deduplicated: int  # documents whose whole text repeats an earlier document's
    quarantined: dict[str, int]  # reason → count
    num_chunks: int  # chunk occurrences published
    num_chunk_texts: int  # distinct chunk texts among them
    num_chunks_compiled: int  # distinct chunk texts compiled by this job (the rest were already stored)
    entries: list[dict[str, Any]] = field(default_factory=list)  # tier, variant, nbytes, vision_tokens, pages
    wall_s: float = 0.0

    @property
    def num_quarantined(self) -> int:
        return sum(self.quarantined.values())

    @property
    def balanced(self) -> bool:
        return self.indexed + self.deduplicated + self.num_quarantined == self.inputs

    @property
    def per_entry_group(self) -> dict[str, dict[str, int]]:
        """`<tier or text>.<variant>` → entries, pages, vision tokens and KV bytes compiled."""
        groups: dict[str, dict[str, int]] = defaultdict(lambda: {"entries": 0, "pages": 0, "vision_tokens": 0, "nbytes": 0})
        for e in self.entries:
            g = groups[f"{e['tier'] or 'text'}.{e['variant']}"]
            g["entries"] += 1
            g["pages"] += e["pages"]
            g["vision_tokens"] += e["vision_tokens"]
            g["nbytes"] += e["nbytes"]
        return dict(sorted(groups.items()))

    @property
    def chunks_per_s(self) -> float:
        return self.num_chunks_compiled / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["entries"]
        out.update(num_quarantined=self.num_quarantined, balanced=self.balanced,
                   groups=self.per_entry_group, chunks_per_s=self.chunks_per_s)
        return out
