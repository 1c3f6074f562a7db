"""The KV shard format: safetensors files named by the sha256 of their bytes, many entries per file.

A shard packs the entries of one compile batch for one (tier, variant) slot — one file per slot, so a
recompile that replaces a slot's entries leaves whole files unreferenced and collectable. Each entry's
index row records where its bytes are (`byte_offset`, `nbytes` from the start of the file), its `shape`,
`dtype` and the sha256 of its bytes: a reader fetches exactly one entry with one ranged read (one
ranged GET on S3, one pread locally) and verifies it before use, without parsing the file's header.
The header keeps the files readable by any safetensors tool. docs/DEPLOY.md has the numbers behind
the packing. A quantised entry (pipeline/store/kv_quant.py) is one uint8 tensor, its packed record; its row's
`dtype` names the format and its `shape` the logical KV shape, so it too is one range and one checksum.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import threading
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from safetensors.torch import save as safetensors_save

from pipeline.runtime import DTYPE_OF, TORCH_DTYPES, StoredFormat, stored_format
from pipeline.store.blobs import Blobs, StoreError
from pipeline.store.kv_quant import QuantizedKV, record_nbytes
from schemas.config import DType, KVQuant
from schemas.errors import Fault
from schemas.store import ShardEntry, StoreSpec
from schemas.tables import SHARD_PATH

TENSOR_KEY = re.compile(r"[A-Za-z0-9._:\-]{1,200}")
_COALESCE_GAP_NBYTES = 1 << 20  # ranges of one shard closer than this are fetched with one read
Rows = Iterable[Mapping[str, Any]] | pa.Table


class ShardCorruptError(RuntimeError):
    """A KV shard is missing, unreadable, or its bytes do not match the index checksum. The message names the
    shard's path (for `qvpic verify` and logs); `fault` is what a response says instead."""

    def __init__(self, message: str, fault: Fault):
        super().__init__(message)
        self.fault = fault


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of the bytes safetensors stores for `tensor` (contiguous, little-endian)."""
    return hashlib.sha256(_stored_bytes(tensor)).hexdigest()


def _stored_bytes(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


# A load's checksums run on several threads once it holds this many bytes: hashlib releases the GIL over a
# buffer, and sha256 runs at ~1.7 GB/s a core here (8 bench-qwen entries, 6 MB: 3.5 ms on one thread, 2.0 on
# two; a 7B model's 8 chunks, ~90 MB: ~50 ms on one). Below it, a thread hop costs more than it saves.
PARALLEL_SHA256_MIN_NBYTES = 1 << 20
MAX_SHA256_THREADS = 8
_sha256_pool: ThreadPoolExecutor | None = None
_sha256_pool_lock = threading.Lock()


def sha256_many(buffers: Sequence[np.ndarray]) -> list[str]:
    """The sha256 hex digest of each buffer, in order: on up to this process's torch thread count (the CPUs a
    Ray replica reserved, at most `MAX_SHA256_THREADS`) of threads when they hold enough bytes. The threads only
    hash: no torch kernel runs on them, so they start no OpenMP pool (pipeline/runtime/threads.py)."""
    workers = min(MAX_SHA256_THREADS, torch.get_num_threads(), len(buffers))
    if workers < 2 or sum(b.nbytes for b in buffers) < PARALLEL_SHA256_MIN_NBYTES:
        return [hashlib.sha256(b).hexdigest() for b in buffers]
    global _sha256_pool
    with _sha256_pool_lock:
        if _sha256_pool is None:
            _sha256_pool = ThreadPoolExecutor(MAX_SHA256_THREADS, thread_name_prefix="qvpic-sha256")
    # `workers` tasks, each a strided share of the buffers: no more threads busy than the process may use
    shares = list(_sha256_pool.map(lambda k: [hashlib.sha256(b).hexdigest() for b in buffers[k::workers]],
                                   range(workers)))
    return [shares[i % workers][i // workers] for i in range(len(buffers))]


def shard_path(data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    return f"shards/{digest[:2]}/{digest}.safetensors"


StoredKV = torch.Tensor | QuantizedKV  # what a shard stores of one KV entry


def pack(tensors: Mapping[str, StoredKV]) -> tuple[bytes, list[ShardEntry]]:
    """Safetensors bytes of `tensors` (float tensors or quantised records) and where each one lies in them."""
    if not tensors:
        raise ValueError("a shard needs at least one tensor")
    prepared: dict[str, torch.Tensor] = {}
    formats: dict[str, tuple[StoredFormat, tuple[int, ...]]] = {}
    for key, tensor in tensors.items():
        if not isinstance(key, str) or not TENSOR_KEY.fullmatch(key):
            raise ValueError(f"tensor key must match {TENSOR_KEY.pattern}, got {key!r:.80}")
        if isinstance(tensor, QuantizedKV):
            formats[key] = (tensor.quant, tuple(tensor.shape))
            tensor = tensor.record
        elif not isinstance(tensor, torch.Tensor) or tensor.dtype not in DTYPE_OF:
            raise ValueError(f"tensor {key!r} must be a float32/bfloat16/float16 torch.Tensor or a QuantizedKV")
        else:
            formats[key] = (DTYPE_OF[tensor.dtype], tuple(tensor.shape))
        prepared[key] = tensor.detach().to("cpu").contiguous()
    data = safetensors_save(prepared)
    (header_nbytes,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + header_nbytes])
    rel = shard_path(data)
    entries = []
    for key, tensor in prepared.items():
        begin, end = header[key]["data_offsets"]
        entries.append(ShardEntry(key, rel, end - begin, tensor_sha256(tensor), formats[key][0],
                                  8 + header_nbytes + begin, formats[key][1]))
    return data, entries


def write_shard(blobs: Blobs, tensors: Mapping[str, StoredKV]) -> list[ShardEntry]:
    """Write one content-named shard (skipped when present: same name, same bytes)."""
    data, entries = pack(tensors)
    if not blobs.exists([entries[0].shard_path])[0]:
        blobs.put(entries[0].shard_path, data)
    return entries


class ShardReader:
    """Verified reads of index rows' KV tensors; what the cache loader depends on."""

    def __init__(self, blobs: Blobs) -> None:
        self.blobs = blobs

    @classmethod
    def open(cls, store: StoreSpec | str) -> "ShardReader":
        return cls(Blobs.open(store if isinstance(store, StoreSpec) else StoreSpec(uri=store)))

    def load_many(self, rows: Rows) -> list[StoredKV]:
        """KV entries of index rows, in row order: each shard opened once, one ranged read per run of
        nearby entries, every entry's bytes checked against the row's sha256 before use. A quantised
        entry comes back as its QuantizedKV record (dequantise where it is used: pipeline/store/kv_quant.py)."""
        rows = rows.to_pylist() if isinstance(rows, pa.Table) else list(rows)
        by_shard: dict[str, list[int]] = defaultdict(list)
        for i, row in enumerate(rows):
            if not isinstance(row.get("shard_path"), str) or not SHARD_PATH.fullmatch(row["shard_path"]):
                raise StoreError(f"row {i} has no valid shard_path: {row.get('shard_path')!r:.80}")
            by_shard[row["shard_path"]].append(i)
        out: list[StoredKV] = [torch.empty(0)] * len(rows)
        records: list[torch.Tensor] = [torch.empty(0)] * len(rows)  # what each checksum covers
        for rel, positions in by_shard.items():
            wanted = [rows[i] for i in positions]
            tensors = self._read(rel, wanted)
            for i, tensor in zip(positions, tensors):
                row = rows[i]
                record = tensor.record if isinstance(tensor, QuantizedKV) else tensor
                if (record.nbytes != row["nbytes"]
                        or (not isinstance(tensor, QuantizedKV) and list(tensor.shape) != list(row["shape"]))):
                    raise self._corrupt(row)
                out[i], records[i] = tensor, record
        # every entry's checksum, all at once (on several threads when the load is large), before any is used
        for row, digest in zip(rows, sha256_many([_stored_bytes(r) for r in records])):
            if digest != row["checksum"]:
                raise self._corrupt(row)
        return out

    def _corrupt(self, row: Mapping[str, Any]) -> ShardCorruptError:
        return ShardCorruptError(f"tensor {row['tensor_key']!r} of shard {self.blobs.path(row['shard_path'])} "
                                 "fails its checksum", Fault.CHECKSUM_MISMATCH)

    def _read(self, rel: str, rows: Sequence[Mapping[str, Any]]) -> list[StoredKV]:
        spans = sorted((row["byte_offset"], row["byte_offset"] + row["nbytes"]) for row in rows)
        merged: list[list[int]] = []
        for begin, end in spans:
            if merged and begin - merged[-1][1] <= _COALESCE_GAP_NBYTES:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([begin, end])
        path = self.blobs.path(rel)
        try:
            blocks = self.blobs.get_ranges(rel, [(begin, end - begin) for begin, end in merged])
        except FileNotFoundError as e:
            raise ShardCorruptError(f"shard {path} is missing", Fault.SHARD_MISSING) from e
        except OSError as e:
            raise ShardCorruptError(f"shard {path} is unreadable: {e}", Fault.SHARD_UNREADABLE) from e
        out = []
        for row in rows:
            begin, end = row["byte_offset"], row["byte_offset"] + row["nbytes"]
            block_begin, block = next((b, data) for (b, e), data in zip(merged, blocks) if b <= begin and end <= e)
            data = block[begin - block_begin:end - block_begin]
            if len(data) != row["nbytes"]:
                raise ShardCorruptError(f"shard {path} is torn: {len(data)} of {row['nbytes']} bytes at {begin}",
                                        Fault.SHARD_TORN)
            try:
                out.append(_entry(bytearray(data), stored_format(row["dtype"]), tuple(row["shape"])))
            except (RuntimeError, ValueError) as e:
                raise ShardCorruptError(f"entry {row['tensor_key']!r} of shard {path}: {e}",
                                        Fault.ENTRY_MALFORMED) from e
        return out


def _entry(data: bytearray, fmt: StoredFormat, shape: tuple[int, ...]) -> StoredKV:
    """An entry over `data`: a float tensor of `shape`, or a quantised record of a KV of `shape`
    (whose size must be that record's: a row cannot pass an int8 record off as another shape)."""
    if isinstance(fmt, DType):
        return torch.frombuffer(data, dtype=TORCH_DTYPES[fmt]).reshape(shape)
    if len(data) != record_nbytes(shape, fmt):
        raise ValueError(f"{len(data)} bytes are not a {fmt.value} record of KV {list(shape)}")
    return QuantizedKV(KVQuant(fmt), shape, torch.frombuffer(data, dtype=torch.uint8))
