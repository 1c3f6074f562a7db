"""An append-only log of Parquet parts: how the index, chunks and quarantine tables are stored.

Layout: `<table>/part-<ns>-<token>[-c<ns>-<NNNN>].parquet` (20-digit ns). Names sort in write order; a part is
written once (atomically) and never modified, so readers cache parts by name. A writer that passes
`stamp_ns` and `token` (a job's start time and a digest of the rows) gets a deterministic name: a
retried Ray task rewrites the same part instead of adding a copy.

Readers see the newest row per key (`time_column` first, ties and key-only tables by part order).

Compaction rewrites parts into parts of at most `target_rows`, writing every new part before deleting
any old one: a reader sees the old parts, the new ones, or both (duplicates, which it dedupes), never
missing rows; a reader whose listing names a part deleted under it lists again. A compaction killed
midway leaves both sets (readable, deduped); the next compaction finishes the job. A compacted part
takes the name of the newest part it replaces plus `-c<its own time>-<NNNN>`, so it sorts where its
rows were written and parts appended during the compaction still sort after it.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.store.blobs import Blobs, StoreError
from schemas.tables import with_optional

PART_PREFIX, PART_SUFFIX = "part-", ".parquet"
TARGET_ROWS = 250_000  # per compacted part: a 1M-chunk store's index (4 entries a chunk) is 16 files
_LIST_RETRIES = 5
_COMPACTED = re.compile(r"-c\d{20}-\d{4}$")  # the suffix a compacted part adds to the name it takes


def part_stem(name: str) -> str:
    """A part's name without its compaction suffix: a compacted part has the stem of the newest part it
    replaced, so parts sort by stem in the order their rows were written."""
    return _COMPACTED.sub("", name.removesuffix(PART_SUFFIX))


def is_compacted(name: str) -> bool:
    return bool(_COMPACTED.search(name.removesuffix(PART_SUFFIX)))


def newest_per_key(table: pa.Table, keys: Sequence[str], time_column: str | None) -> pa.Table:
    """One row per key: the latest `time_column`, ties (or no time column) broken by row order."""
    if table.num_rows == 0 or not keys:
        return table
    if time_column is not None:
        table = table.take(pc.sort_indices(table[time_column]))  # stable: ties keep part order
    rank = pa.array(np.arange(table.num_rows))
    newest = table.append_column("__rank", rank).group_by(list(keys), use_threads=False).aggregate(
        [("__rank", "max")])["__rank_max"]
    return table.filter(pc.is_in(rank, value_set=newest))


class PartLog:
    def __init__(self, blobs: Blobs, directory: str, schema: pa.Schema, keys: Sequence[str] = (),
                 time_column: str | None = None) -> None:
        self.blobs, self.directory, self.schema = blobs, directory, schema
        self.keys, self.time_column = tuple(keys), time_column
        self._tables: dict[str, pa.Table] = {}  # part name -> rows (parts are immutable)
        self._raw: tuple[tuple[str, ...], pa.Table] | None = None
        self._current: tuple[pa.Table, pa.Table] | None = None  # (raw it came from, deduped)

    # ---- writes --------------------------------------------------------------------------------
    def part_name(self, stamp_ns: int | None = None, token: str | None = None) -> str:
        stamp = time.time_ns() if stamp_ns is None else stamp_ns
        return f"{PART_PREFIX}{stamp:020d}-{token or uuid.uuid4().hex[:16]}{PART_SUFFIX}"

    def append(self, table: pa.Table, stamp_ns: int | None = None, token: str | None = None) -> str:
        """Write `table` (already of `schema`) as one new part; returns its name."""
        name = self.part_name(stamp_ns, token)
        self._put(name, table)
        return name

    def _put(self, name: str, table: pa.Table) -> None:
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, row_group_size=64 * 1024)
        self.blobs.put(f"{self.directory}/{name}", sink.getvalue().to_pybytes())

    # ---- reads ---------------------------------------------------------------------------------
    def parts(self) -> list[pafs.FileInfo]:
        """The live parts (one listing: names and sizes), in write order."""
        infos = [i for i in self.blobs.list(self.directory)
                 if i.base_name.startswith(PART_PREFIX) and i.base_name.endswith(PART_SUFFIX)]
        return sorted(infos, key=lambda i: i.base_name)

    def part_paths(self) -> list[str]:
        """Store-relative paths of the live parts, in write order."""
        return [f"{self.directory}/{i.base_name}" for i in self.parts()]

    def num_rows(self, rel: str) -> int:
        """Rows of part `rel`, from its footer (a ranged read or two on S3)."""
        with self.blobs.open_input(rel) as f:
            return pq.ParquetFile(f).metadata.num_rows

    def _read_part(self, rel: str) -> pa.Table:
        try:
            table = with_optional(pq.read_table(pa.BufferReader(self.blobs.get(rel))), self.schema)
            return table.select(self.schema.names).cast(self.schema)
        except (KeyError, pa.ArrowException) as e:
            raise StoreError(f"part {self.blobs.path(rel)} does not match the {self.directory} schema: {e}") from e

    def raw(self) -> pa.Table:
        """Every row of every part, in write order (duplicates included)."""
        for _ in range(_LIST_RETRIES):
            paths = tuple(self.part_paths())
            if self._raw is not None and self._raw[0] == paths:
                return self._raw[1]
            try:
                for rel in paths:
                    if rel not in self._tables:
                        self._tables[rel] = self._read_part(rel)
            except FileNotFoundError:  # a compaction deleted a part we listed: its rows are in newer parts
                continue
            for rel in set(self._tables) - set(paths):
                del self._tables[rel]
            merged = pa.concat_tables([self._tables[p] for p in paths]) if paths else self.schema.empty_table()
            self._raw = (paths, merged)
            return merged
        raise StoreError(f"{self.blobs.path(self.directory)} kept changing under {_LIST_RETRIES} reads")

    def current(self) -> pa.Table:
        """The newest row per key (every row for a key-less table)."""
        raw = self.raw()
        if self._current is None or self._current[0] is not raw:
            self._current = (raw, newest_per_key(raw, self.keys, self.time_column))
        return self._current[1]

    def distinct(self, column: str) -> set:
        """Distinct values of `column` over every part, read one part and one column at a time."""
        for _ in range(_LIST_RETRIES):
            values: set = set()
            try:
                for rel in self.part_paths():
                    with self.blobs.open_input(rel) as f:
                        values.update(pc.unique(pq.read_table(f, columns=[column])[column]).to_pylist())
                return values
            except FileNotFoundError:  # a compaction replaced a part we listed: list again
                continue
        raise StoreError(f"{self.blobs.path(self.directory)} kept changing under {_LIST_RETRIES} reads")

    # ---- repair --------------------------------------------------------------------------------
    def put_in_place_of(self, stem: str, table: pa.Table) -> str:
        """Write `table` as a part named like a compaction of the part(s) with `stem`: it sorts where their
        rows were written, and a reader or checker tells it replaced them. Returns its name."""
        name = f"{stem}-c{time.time_ns():020d}-0000{PART_SUFFIX}"
        self._put(name, table)
        return name

    def rewrite(self, rel: str, keep: Callable[[pa.Table], pa.Table]) -> int:
        """Replace part `rel` by the rows `keep` keeps, the new part written before the old is deleted (a
        reader sees either, or both deduped). Returns the number of rows dropped."""
        table = self._read_part(rel)
        kept = keep(table)
        if kept.num_rows != table.num_rows:
            self.put_in_place_of(part_stem(rel.rsplit("/", 1)[1]), kept)
            self.blobs.delete(rel)
        return table.num_rows - kept.num_rows

    # ---- compaction ----------------------------------------------------------------------------
    def compact(self, full: bool = False, keep: Callable[[pa.Table], pa.Table] | None = None,
                target_rows: int = TARGET_ROWS) -> int:
        """Rewrite parts into parts of ≤ `target_rows`; returns the number of parts replaced.

        Default (the end of every job): each run of consecutive parts under `target_rows / 2` rows is
        merged in order and deduped within the run; large parts stay, so the work and memory are
        bounded by what jobs appended since. `full=True` (recompile) rewrites every part, deduped
        across the whole table and filtered by `keep`, one key range at a time so memory stays near
        `target_rows` rows whatever the table's size.
        """
        paths = self.part_paths()
        if full:
            return self._replace(paths, self._full_tables(paths, keep, target_rows), target_rows) if paths else 0
        replaced, run = 0, []
        for path in paths + [None]:
            if path is not None and self.num_rows(path) < target_rows // 2:
                run.append(path)
                continue
            if len(run) > 1:
                replaced += self._replace(run, self._run_tables(run, target_rows), target_rows)
            run = []
        return replaced

    def _replace(self, paths: list[str], tables: Iterator[pa.Table], target_rows: int) -> int:
        """Write `tables` as parts named after the newest of `paths`, then delete `paths`."""
        base = part_stem(paths[-1].rsplit("/", 1)[1])
        token, written = f"{time.time_ns():020d}", 0
        for table in tables:
            for start in range(0, table.num_rows, target_rows):
                self._put(f"{base}-c{token}-{written:04d}{PART_SUFFIX}", table.slice(start, target_rows))
                written += 1
        if not written:  # every row filtered out: an empty part still says these parts were replaced
            self._put(f"{base}-c{token}-0000{PART_SUFFIX}", self.schema.empty_table())
        for rel in paths:  # only once every replacement exists
            self.blobs.delete(rel)
        return len(paths)

    def _run_tables(self, run: list[str], target_rows: int) -> Iterator[pa.Table]:
        pending: list[pa.Table] = []
        for rel in run:
            pending.append(self._read_part(rel))
            if sum(t.num_rows for t in pending) >= target_rows or rel == run[-1]:
                yield newest_per_key(pa.concat_tables(pending), self.keys, self.time_column)
                pending = []

    def _full_tables(self, paths: list[str], keep: Callable[[pa.Table], pa.Table] | None,
                     target_rows: int) -> Iterator[pa.Table]:
        for lo, hi in self._key_ranges(paths, target_rows):
            table = pa.concat_tables([_key_range(self._read_part(p), self.keys, lo, hi) for p in paths])
            table = newest_per_key(table, self.keys, self.time_column)
            table = keep(table) if keep is not None else table
            yield table.sort_by(self.keys[0]) if self.keys else table

    def _key_ranges(self, paths: list[str], target_rows: int) -> list[tuple[str | None, str | None]]:
        """[lo, hi) ranges of the first key column, each holding about `target_rows` distinct keys (a key the
        other key columns refine — one chunk's entries — never straddles two ranges)."""
        if not self.keys:
            return [(None, None)]
        column = self.keys[0]
        keys = pa.chunked_array([pq.read_table(pa.BufferReader(self.blobs.get(p)), columns=[column])[column]
                                 for p in paths], pa.string())
        distinct = pc.unique(keys.combine_chunks())
        distinct = distinct.take(pc.sort_indices(distinct))
        cuts = [distinct[i].as_py() for i in range(target_rows, len(distinct), target_rows)]
        return list(zip([None, *cuts], [*cuts, None]))


def _key_range(table: pa.Table, keys: Sequence[str], lo: str | None, hi: str | None) -> pa.Table:
    """Rows whose first key column lies in [lo, hi) (None: unbounded). Key columns are never null."""
    if not keys or (lo is None and hi is None):
        return table
    column = table[keys[0]]
    masks = (([pc.greater_equal(column, lo)] if lo is not None else [])
             + ([pc.less(column, hi)] if hi is not None else []))
    return table.filter(masks[0] if len(masks) == 1 else pc.and_(*masks))
