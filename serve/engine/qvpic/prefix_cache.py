"""A prefix KV cache whose blocks know which linked chunks lie before them.

A request's KV columns form one stream: `[before][c_1 … c_n re-anchored][after][decoded tokens]`. Every column
gets a 64-bit key (`StreamKeys`): a text token its id; an image token the image's digest and its index in the
image; a linked chunk's column the chunk's identity (entry key: chunk, tier, variant, fingerprint; and the
position it starts at) and its index. The stream is cut into blocks of `block_tokens` columns, and block i's
hash is `sha256(hash_{i-1} ‖ keys of its columns ‖ full identities of the items that start in it)`, with
hash_{-1} the tenant's salt (set by the server from the authenticated tenant, never by the client: vLLM's
`cache_salt`, CVE-2025-46570). So a block matches only when everything before it — every token, image and
chunk, at the same positions, for the same tenant — matches too: an identical request finds its whole stream,
a follow-up turn its earlier turns (decoded tokens included, up to the stream's last column: the partial block
where it ended is kept under its own key), a shared system prompt its blocks; a changed
earlier turn, another chunk set or another tenant misses from the first block that differs (vLLM's
`docs/design/prefix_caching.md`, extended with chunk identities as extra keys).

Each block stores its KV `[layers, 2, kv_heads, block_tokens, head_dim]` and the position the next token
takes after its last column, or -1 where a cut there cannot be resumed (inside an image or a chunk: the rest of
an image cannot be encoded alone). Where a finished prompt ends, the next-token logits its last column produced
are kept too (`logits_key`): a causal model's logits there depend only on the columns before, so an identical
request (a retry, a chat UI's "regenerate") samples its first token from them and prefills nothing.

Bytes are bounded twice: an LRU on the device, whose evictions move to an LRU in host memory (a later hit moves
them back), whose evictions are dropped. One thread uses it (the engine's). On CUDA those moves go through pinned
host memory on a side stream (serve/kv/staging.py), and a request's new blocks are copied out of its slab row in one
gather and one batched copy, not one clone (one kernel launch) per block (issue 59 item 4).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from serve.engine.interface import PrefixCacheStats
from serve.kv.staging import Staging

_DERIVED = np.int64(1) << np.int64(62)  # keys of image and chunk columns; token ids stay far below
_NO_COLUMNS = np.zeros(0, dtype=np.int64)  # a logits entry's next_positions: it holds no columns


@dataclass
class StreamKeys:
    """Column keys of a stream and where it can be resumed."""

    keys: list[np.ndarray] = field(default_factory=list)  # int64 runs, concatenated on demand
    next_positions: list[np.ndarray] = field(default_factory=list)  # int64 runs: position after each column, or -1
    items: dict[int, bytes] = field(default_factory=dict)  # first column of an image or chunk -> its identity
    num_columns: int = 0
    # the runs concatenated, kept until the next add: a request's hashes, partial keys and resume read them many times
    _joined: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False, compare=False)

    def add_tokens(self, ids, positions: np.ndarray) -> None:
        """Text tokens at their own positions (`positions[i]`: where token i sits; the next one follows)."""
        ids = np.asarray(ids, dtype=np.int64)
        self._add(ids, np.asarray(positions, dtype=np.int64) + 1)

    def add_item(self, identity: bytes, num_columns: int, end_position: int) -> None:
        """An image's or a linked chunk's columns: resumable only after its last one."""
        base = np.int64(int.from_bytes(hashlib.sha256(identity).digest()[:7], "big")) | _DERIVED
        self.items[self.num_columns] = identity
        ends = np.full(num_columns, -1, dtype=np.int64)
        ends[-1] = end_position
        self._add(base + np.arange(num_columns, dtype=np.int64), ends)

    def _add(self, keys: np.ndarray, ends: np.ndarray) -> None:
        self.keys.append(keys)
        self.next_positions.append(ends)
        self.num_columns += len(keys)
        self._joined = None

    def joined(self) -> tuple[np.ndarray, np.ndarray]:
        """(column keys, next positions), each `[num_columns]` int64; shared: read them, never write."""
        if self._joined is None:
            empty = np.zeros(0, dtype=np.int64)
            self._joined = (np.concatenate(self.keys) if self.keys else empty,
                            np.concatenate(self.next_positions) if self.next_positions else empty)
        return self._joined


def block_hashes(salt: bytes, stream: StreamKeys, block_tokens: int, num_columns: int | None = None) -> list[bytes]:
    """Chained hashes of the stream's full blocks within its first `num_columns` columns (all by default)."""
    keys, _ = stream.joined()
    limit = len(keys) if num_columns is None else min(num_columns, len(keys))
    hashes, previous = [], hashlib.sha256(b"qvpic-prefix\x00" + salt).digest()
    starts = sorted(stream.items)
    for first in range(0, limit - block_tokens + 1, block_tokens):
        digest = hashlib.sha256(previous)
        digest.update(keys[first:first + block_tokens].tobytes())
        for start in starts:
            if first <= start < first + block_tokens:
                digest.update(stream.items[start])
        previous = digest.digest()
        hashes.append(previous)
    return hashes


def partial_key(salt: bytes, stream: StreamKeys, full_hashes: list[bytes], block_tokens: int, end: int) -> bytes:
    """Key of the columns after the last full block up to `end` (where a text before the chunks, a prompt or a
    whole stream with its decoded tokens ends, rarely a block multiple): cached too, so those columns need no
    forward of their own when they repeat."""
    keys, _ = stream.joined()
    first = (end // block_tokens) * block_tokens
    previous = full_hashes[first // block_tokens - 1] if first else hashlib.sha256(b"qvpic-prefix\x00" + salt).digest()
    digest = hashlib.sha256(b"partial\x00" + previous)
    digest.update(keys[first:end].tobytes())
    for start, identity in stream.items.items():
        if first <= start < end:
            digest.update(identity)
    return digest.digest()


def logits_key(salt: bytes, stream: StreamKeys, full_hashes: list[bytes], block_tokens: int, end: int) -> bytes:
    """Key of the logits after column `end - 1` (a prompt's end): everything before it, as `partial_key` says."""
    return hashlib.sha256(b"logits\x00" + partial_key(salt, stream, full_hashes, block_tokens, end)).digest()


@dataclass
class Block:
    kv: torch.Tensor  # [layers, 2, kv_heads, block_tokens, head_dim]; a logits entry: `[vocab]` float
    next_positions: np.ndarray  # [block_tokens]: position after each column, -1 where no resume is possible

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class PrefixCache:
    def __init__(self, block_tokens: int, device_nbytes: int, host_nbytes: int, device: torch.device):
        self.block_tokens, self.device = block_tokens, device
        self.max_device_nbytes, self.max_host_nbytes = device_nbytes, host_nbytes
        self._device: OrderedDict[bytes, Block] = OrderedDict()
        self._host: OrderedDict[bytes, Block] = OrderedDict()
        self.stats = PrefixCacheStats()
        self.staging = Staging(device)

    @property
    def enabled(self) -> bool:
        return self.max_device_nbytes > 0  # 0 switches the cache off

    def __len__(self) -> int:
        return len(self._device) + len(self._host)

    def match(self, hashes: list[bytes]) -> list[Block]:
        """The longest run of cached blocks from the first, each moved to the device tier's most recent end."""
        self.stats.lookups += 1
        run, promoted = [], []  # promoted: (index in run, key) of the blocks found on the host
        for key in hashes:
            block = self._device.get(key)
            if block is not None:
                self._device.move_to_end(key)
            elif (block := self._host.pop(key, None)) is not None:
                self.stats.host_nbytes -= block.nbytes
                promoted.append((len(run), key))
            else:
                break
            run.append(block)
        if promoted:  # back onto the device together (on CUDA: pinned, on the side stream, the step's stream fenced)
            moved = self.staging.to_device([run[i].kv for i, _ in promoted])
            for (i, key), kv in zip(promoted, moved):
                run[i] = Block(kv, run[i].next_positions)
                self._put_device(key, run[i])
        return run

    def get(self, key: bytes) -> Block | None:
        """One block by its key (a segment's partial last block, see `partial_key`), made most recent."""
        run = self.match([key])
        self.stats.lookups -= 1
        return run[0] if run else None

    def put(self, key: bytes, kv: torch.Tensor, next_positions: np.ndarray) -> None:
        if self.enabled and key not in self._device and key not in self._host:
            self.stats.inserted_blocks += 1
            self._put_device(key, Block(kv.clone(), next_positions.copy()))

    def put_logits(self, key: bytes, logits: torch.Tensor) -> None:
        """A prompt's last-column logits `[vocab]` (under `logits_key`), in the same LRU as the blocks."""
        self.put(key, logits, _NO_COLUMNS)

    def get_logits(self, key: bytes) -> torch.Tensor | None:
        entry = self.get(key)
        if entry is None:
            return None
        self.stats.logits_hits += 1
        return entry.kv

    def insert(self, hashes: list[bytes], kv: torch.Tensor, next_positions: np.ndarray) -> None:
        """Store the blocks of `kv` `[layers, 2, kv_heads, columns, head_dim]` not cached yet (hashes: its blocks)."""
        if not self.enabled:
            return
        size = self.block_tokens
        new = []  # (block index, key) of the blocks not cached yet
        for i, key in enumerate(hashes):
            if key in self._device:
                self._device.move_to_end(key)
            elif key not in self._host:
                new.append((i, key))
        for (i, key), block_kv in zip(new, self._copies(kv, [i for i, _ in new])):
            self.stats.inserted_blocks += 1
            self._put_device(key, Block(block_kv, next_positions[i * size:(i + 1) * size].copy()))

    def _copies(self, kv: torch.Tensor, blocks: list[int]) -> list[torch.Tensor]:
        """Blocks `blocks` of `kv` `[layers, 2, kv_heads, columns, head_dim]`, each a tensor of its own (evicted
        one by one, each block's bytes go back). On the CPU one clone each (one pass over the bytes). On a GPU
        that is a kernel launch per block (~90 for a 1,500-column conversation): there one gather of them all
        into `[n, layers, 2, kv_heads, block_tokens, head_dim]` and one batched copy into the n blocks' own
        memory (dense and alike, so `_foreach_copy_` takes its multi-tensor kernel)."""
        size = self.block_tokens
        if not blocks:
            return []
        if kv.device.type != "cuda":
            return [kv[:, :, :, i * size:(i + 1) * size].clone() for i in blocks]
        return batched_copies(kv, blocks, size)

    def clear(self) -> None:
        self._device.clear()
        self._host.clear()
        self.stats.device_nbytes = self.stats.host_nbytes = 0

    def _put_device(self, key: bytes, block: Block) -> None:
        self._device[key] = block
        self.stats.device_nbytes += block.nbytes
        while self.stats.device_nbytes > self.max_device_nbytes and self._device:
            old_key, old = self._device.popitem(last=False)
            self.stats.device_nbytes -= old.nbytes
            if self.max_host_nbytes >= old.nbytes:  # (on CUDA: pinned, on the side stream; read back only by `match`)
                self._host[old_key] = Block(self.staging.to_host([old.kv])[0], old.next_positions)
                self.stats.host_nbytes += old.nbytes
                self.stats.demoted_blocks += 1
                while self.stats.host_nbytes > self.max_host_nbytes and self._host:
                    self.stats.host_nbytes -= self._host.popitem(last=False)[1].nbytes
                    self.stats.evicted_blocks += 1
            else:
                self.stats.evicted_blocks += 1


def resume_point(blocks: list[Block], block_tokens: int, limit: int) -> int:
    """How many columns of the matched `blocks` can be used: the most, at most `limit`, that end where a
    computation can resume (after a text token, or after a whole image or chunk)."""
    covered = min(len(blocks) * block_tokens, limit)
    for column in range(covered, 0, -1):
        block, offset = divmod(column - 1, block_tokens)
        if blocks[block].next_positions[offset] >= 0:
            return column
    return 0


def batched_copies(kv: torch.Tensor, blocks: list[int], size: int) -> list[torch.Tensor]:
    """`PrefixCache._copies` on a GPU: blocks `blocks` of `size` columns of `kv`, each in memory of its own, by
    one gather and one multi-tensor copy (any device computes the same; only a GPU gains)."""
    whole = kv.narrow(3, 0, (max(blocks) + 1) * size).unflatten(3, (-1, size)).movedim(3, 0)  # [blocks, ...]
    gathered = whole.index_select(0, torch.tensor(blocks, device=kv.device))  # one gather, contiguous
    out = [torch.empty(gathered.shape[1:], dtype=kv.dtype, device=kv.device) for _ in blocks]
    torch._foreach_copy_(out, list(gathered.unbind(0)))
    return out
