"""Should KV shards pack many entries per file? Writes and reads the same entries one per file and packed
8 and 32 to a file, on local disk (fsync per file, as the store writes) and on S3 (a moto server on
loopback: request counts are real, latencies are loopback's), side by side in one run, medians.

Reads are what serving does on a cache miss: one entry by its (byte_offset, nbytes) — one ranged GET on
S3 whatever the packing — next to fetching the whole object (what per-entry files allowed).

    python -m benchmarks.scale.shard_packing            # 512 entries of 32 KiB and of 1 MiB
    python -m benchmarks.scale.shard_packing --quick    # 128 entries
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from pipeline.eval import markdown_table, write_section
from pipeline.store import Blobs, ShardReader, write_shard
from schemas.store import StoreSpec

S3_KEYS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true"}
PUT_USD_PER_1K, GET_USD_PER_1K = 0.005, 0.0004  # S3 Standard, us-east-1


def entries(num: int, nbytes: int) -> list[torch.Tensor]:
    tokens = max(1, nbytes // (2 * 2 * 2 * 64 * 4))  # float32 [layers=2, 2, kv_heads=2, tokens, head_dim=64]
    return [torch.randn(2, 2, 2, tokens, 64, generator=torch.Generator().manual_seed(i)) for i in range(num)]


def write(blobs: Blobs, tensors: list[torch.Tensor], per_file: int) -> tuple[float, list[dict]]:
    started, rows = time.perf_counter(), []
    for start in range(0, len(tensors), per_file):
        group = {f"e{start + i}": t for i, t in enumerate(tensors[start:start + per_file])}
        rows += [e.index_fields() for e in write_shard(blobs, group)]
    return time.perf_counter() - started, rows


def read_ms(blobs: Blobs, rows: list[dict], samples: int, whole_object: bool) -> float:
    reader, rng, times = ShardReader(blobs), random.Random(0), []
    for row in rng.sample(rows, min(samples, len(rows))):
        started = time.perf_counter()
        if whole_object:
            blobs.get(row["shard_path"])
        else:
            reader.load_many([row])
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def moto() -> tuple[object, str]:
    from moto.server import ThreadedMotoServer

    os.environ.update(S3_KEYS)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    time.sleep(0.5)
    return server, f"http://127.0.0.1:{port}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale.shard_packing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=512)
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[32, 1024])
    parser.add_argument("--packing", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.entries = 128
    server, endpoint = moto()
    import boto3

    rows_out = []
    try:
        with tempfile.TemporaryDirectory(prefix="qvpic-packing-") as tmp:
            for size_kib in args.sizes_kib:
                tensors = entries(args.entries, size_kib * 1024)
                for per_file in args.packing:
                    for backend in ("local", "s3"):
                        if backend == "local":
                            blobs = Blobs.open(StoreSpec(uri=str(Path(tmp) / f"{size_kib}-{per_file}")), create=True)
                        else:
                            bucket = f"pack-{size_kib}-{per_file}"
                            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
                            blobs = Blobs.open(StoreSpec(uri=f"s3://{bucket}/store", endpoint_url=endpoint))
                        write_s, rows = write(blobs, tensors, per_file)
                        files = -(-args.entries // per_file)
                        one = read_ms(blobs, rows, 32, whole_object=False)
                        whole = read_ms(blobs, rows, 32, whole_object=True)
                        rows_out.append([f"{size_kib} KiB", per_file, backend, files,
                                         f"{write_s * 1e3 / args.entries:.2f}", f"{one:.2f}", f"{whole:.2f}"])
                        print(rows_out[-1], flush=True)
    finally:
        server.stop()
    entries_1m = 4_000_000  # a 1M-chunk store: four entries a chunk
    cost = [[per_file, f"{entries_1m // per_file:,}", f"${entries_1m / per_file / 1000 * PUT_USD_PER_1K:,.2f}",
             f"{entries_1m // per_file // 1000:,}"] for per_file in args.packing]
    body = ("Write: wall ms per entry (local: temp file + fsync + rename per file; S3: one PUT per file). Read: median "
            "ms to load one random entry through `ShardReader` (one ranged read of its bytes, checksum verified) "
            "next to fetching its whole file.\n\n"
            + markdown_table(["entry size", "entries / file", "backend", "files", "write ms / entry",
                              "read one entry, ms", "read its whole file, ms"], rows_out)
            + ("\n\nAt 1M chunks (4M entries), PUT requests and LIST calls to enumerate the shards "
               "(for orphan collection):\n\n")
            + markdown_table(["entries / file", "PUTs", "PUT cost", "LIST calls (1k keys each)"], cost))
    print(body)
    if not args.no_write:
        write_section("shard-packing", "Shard packing: one file per entry or per compile batch",
                      "python -m benchmarks.scale.shard_packing "
                      + " ".join(argv if argv is not None else sys.argv[1:]),
                      body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
