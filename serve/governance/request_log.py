"""Append-only request log: one row per governed request, as Parquet part files under a URI.

Rows are buffered in the ingress and written as one part per batch (`batch_rows` rows, or when the
oldest buffered row is `flush_interval_s` old), on a background thread so the event loop never waits
for storage, and once more on shutdown (`close`). Parts are written whole (local: temp file + rename;
object stores: one PUT), named by replica and sequence, so several ingress replicas append to the same
URI without coordination and a reader never sees half a part. A failed write is logged and counted
(`qvpic_request_log_rows{outcome="lost"}`), never raised into a request. `jobs/cost_report.py` reads it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.store import resolve_filesystem
from serve.governance.config import RequestLogConfig
from serve.metrics import serve_metrics

log = logging.getLogger(__name__)

REQUEST_LOG_SCHEMA = pa.schema([
    pa.field("time", pa.timestamp("ms", tz="UTC"), nullable=False),  # when the request arrived
    pa.field("request_id", pa.string(), nullable=False),
    pa.field("tenant", pa.string(), nullable=False),
    pa.field("task_type", pa.string()),
    pa.field("route", pa.string(), nullable=False),  # answer | chat | completions | embeddings | estimate
    pa.field("mode", pa.string(), nullable=False),
    pa.field("status", pa.int16(), nullable=False),  # HTTP status (a stream's error event counts as its status)
    pa.field("cache_level", pa.string()),  # l1 | l2 | l3 when the response cache answered; null: the model did
    pa.field("num_chunks", pa.int32(), nullable=False),
    pa.field("high_res_chunks", pa.int32(), nullable=False),
    pa.field("context_tokens", pa.int64(), nullable=False),  # 0 when rejected before routing
    pa.field("vision_tokens", pa.int64(), nullable=False),
    pa.field("text_tokens", pa.int64(), nullable=False),
    pa.field("query_tokens", pa.int64(), nullable=False),
    pa.field("completion_tokens", pa.int64(), nullable=False),
    pa.field("kv_loaded_bytes", pa.int64(), nullable=False),
    pa.field("ttft_ms", pa.float64()),  # null when no token was produced
    pa.field("total_ms", pa.float64(), nullable=False),
    pa.field("end_user", pa.string()),  # the request's `user` (OpenAI's end-user id): who, within the tenant
])


@dataclass
class RequestRecord:
    time: datetime
    request_id: str
    tenant: str
    task_type: str | None
    route: str
    mode: str
    status: int = 200
    cache_level: str | None = None
    num_chunks: int = 0
    high_res_chunks: int = 0
    context_tokens: int = 0
    vision_tokens: int = 0
    text_tokens: int = 0
    query_tokens: int = 0
    completion_tokens: int = 0
    kv_loaded_bytes: int = 0
    ttft_ms: float | None = None
    total_ms: float = 0.0
    end_user: str | None = None


class RequestLog:
    def __init__(self, config: RequestLogConfig):
        if config.location is None:
            raise ValueError("RequestLog needs a location")
        self.config = config
        self.fs, self.root = resolve_filesystem(config.location, None)
        self._local = isinstance(self.fs, pafs.LocalFileSystem)
        if self._local:
            os.makedirs(self.root, exist_ok=True)
        self._writer_id = uuid.uuid4().hex[:12]  # this replica's parts never collide with another's
        self._sequence = 0
        self._rows: list[RequestRecord] = []
        self._oldest_s = 0.0
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="request-log")  # parts in order

    def append(self, record: RequestRecord) -> None:
        with self._lock:
            if not self._rows:
                self._oldest_s = time.monotonic()
            self._rows.append(record)
            due = (len(self._rows) >= self.config.batch_rows
                   or time.monotonic() - self._oldest_s >= self.config.flush_interval_s)
        if due:
            self.flush()

    def flush(self) -> Future | None:
        """Hand the buffered rows to the writer thread; the future resolves when the part is written."""
        with self._lock:
            rows, self._rows = self._rows, []
            if not rows:
                return None
            self._sequence += 1
            name = f"part-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{self._writer_id}-{self._sequence:06d}.parquet"
        return self._executor.submit(self._write, name, rows)

    def _write(self, name: str, rows: list[RequestRecord]) -> None:
        table = pa.Table.from_pylist([asdict(r) for r in rows], schema=REQUEST_LOG_SCHEMA)
        path = f"{self.root}/{name}"
        try:
            if self._local:
                temp = f"{self.root}/.tmp-{name}"  # readers skip dot-files
                pq.write_table(table, temp, filesystem=self.fs)
                os.replace(temp, path)
            else:
                pq.write_table(table, path, filesystem=self.fs)
        except (OSError, pa.ArrowException) as error:
            log.error("request log: lost %d rows, writing %s failed: %s", len(rows), path, error)
            serve_metrics().request_log_rows.inc(len(rows), outcome="lost")
            return
        serve_metrics().request_log_rows.inc(len(rows), outcome="written")

    def close(self) -> None:
        """Write what is buffered and wait for every part (shutdown)."""
        self.flush()
        self._executor.shutdown(wait=True)
