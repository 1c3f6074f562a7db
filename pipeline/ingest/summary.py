"""What an ingestion job did, in numbers; `indexed + deduplicated + quarantined == inputs`.

The pipeline's last stage returns one small tally row per partition (TALLY_SCHEMA); the driver adds
them up, so its memory does not grow with the corpus. Work is also counted per Ray node of the compile
actors, so a job on a cluster shows how its GPU nodes shared the compiling.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

import pyarrow as pa

TALLY_SCHEMA = pa.schema([
    ("inputs", pa.int64()), ("indexed", pa.int64()), ("deduplicated", pa.int64()),
    ("quarantined_json", pa.string()),  # reason -> count
    ("num_chunks", pa.int64()), ("num_chunk_texts", pa.int64()), ("num_compiled", pa.int64()),
    ("num_embedded", pa.int64()), ("num_published", pa.int64()),
    ("groups_json", pa.string()),  # "<tier or text>.<variant>" -> [entries, pages, vision_tokens, nbytes]
    ("nodes_json", pa.string()),  # Ray node id of the compile actor -> [entries, nbytes]
])
GROUP_FIELDS = ("entries", "pages", "vision_tokens", "nbytes")
NODE_FIELDS = ("entries", "nbytes")


def entry_groups(entries: Iterable[dict[str, Any]]) -> dict[str, list[int]]:
    """Per-entry stats (tier, variant, pages, vision_tokens, nbytes) summed per `<tier or text>.<variant>`."""
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for e in entries:
        g = groups[f"{e['tier'] or 'text'}.{e['variant']}"]
        for i, value in enumerate((1, e["pages"], e["vision_tokens"], e["nbytes"])):
            g[i] += value
    return dict(groups)


def node_work(entries: Iterable[dict[str, Any]]) -> dict[str, list[int]]:
    """Entries and KV bytes compiled per Ray node (each entry's stats carry the node its actor ran on)."""
    nodes: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for e in entries:
        n = nodes[e["node"]]
        n[0], n[1] = n[0] + 1, n[1] + e["nbytes"]
    return dict(nodes)


def _add(into: dict[str, list[int]], more: dict[str, list[int]], width: int) -> None:
    for name, values in more.items():
        into[name] = [a + b for a, b in zip(into.get(name, [0] * width), values)]


@dataclass
class IngestSummary:
    job_id: str
    inputs: int  # documents read + records rejected by the readers
    indexed: int
    deduplicated: int  # documents whose whole text repeats an earlier document's
    quarantined: dict[str, int]  # reason → count
    num_chunks: int  # chunk occurrences of indexed documents (published now or already stored)
    num_chunk_texts: int  # distinct chunk texts among this corpus's chunks that built
    num_chunks_compiled: int  # distinct chunk texts compiled by this job (the rest were already stored)
    num_chunks_embedded: int = 0  # distinct chunk texts embedded by this job
    num_chunks_published: int = 0  # chunk rows written by this job (new or changed)
    groups: dict[str, dict[str, int]] = field(default_factory=dict)  # per entry group compiled by this job
    per_node: dict[str, dict[str, int]] = field(default_factory=dict)  # Ray node id → entries, nbytes compiled there
    wall_s: float = 0.0
    unchanged_since: str | None = None  # a no-op: the job that read the same corpus into the store as it is now

    @classmethod
    def from_tallies(cls, job_id: str, tallies: Iterable[pa.Table]) -> "IngestSummary":
        totals: Counter[str] = Counter()
        quarantined: Counter[str] = Counter()
        groups: dict[str, list[int]] = {}
        nodes: dict[str, list[int]] = {}
        for table in tallies:
            for row in table.to_pylist():
                totals.update({k: v for k, v in row.items() if isinstance(v, int)})
                quarantined.update(json.loads(row["quarantined_json"]))
                _add(groups, json.loads(row["groups_json"]), len(GROUP_FIELDS))
                _add(nodes, json.loads(row["nodes_json"]), len(NODE_FIELDS))
        return cls(job_id=job_id, inputs=totals["inputs"], indexed=totals["indexed"],
                   deduplicated=totals["deduplicated"], quarantined=dict(quarantined), num_chunks=totals["num_chunks"],
                   num_chunk_texts=totals["num_chunk_texts"], num_chunks_compiled=totals["num_compiled"],
                   num_chunks_embedded=totals["num_embedded"], num_chunks_published=totals["num_published"],
                   groups={name: dict(zip(GROUP_FIELDS, values)) for name, values in sorted(groups.items())},
                   per_node={node: dict(zip(NODE_FIELDS, values)) for node, values in sorted(nodes.items())})

    @property
    def num_quarantined(self) -> int:
        return sum(self.quarantined.values())

    @property
    def balanced(self) -> bool:
        return self.indexed + self.deduplicated + self.num_quarantined == self.inputs

    @property
    def per_entry_group(self) -> dict[str, dict[str, int]]:
        """`<tier or text>.<variant>` → entries, pages, vision tokens and KV bytes compiled."""
        return self.groups

    @property
    def chunks_per_s(self) -> float:
        return self.num_chunks_compiled / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(num_quarantined=self.num_quarantined, balanced=self.balanced, chunks_per_s=self.chunks_per_s)
        return out
