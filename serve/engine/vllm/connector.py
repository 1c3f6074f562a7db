"""qvpic's KV connector for vLLM (`KVConnectorBase_V1`): a request's [template prefix][linked chunks] come from
qvpic, re-anchored where they land; vLLM computes the rest of the prompt (the query) and decodes.

The two sides, as vLLM splits them:
- scheduler side (`get_num_new_matched_tokens`, `update_state_after_alloc`, `build_connector_meta`): a request
  that carries `kv_transfer_params["qvpic_claim"]` (a key the engine registered in `CLAIMS`, claims.py) claims its
  first `num_tokens` prompt tokens beyond what vLLM's own prefix cache already holds, and nothing else;
- worker side (`start_load_kv`, `wait_for_layer_load`): for each claimed request of the step, the claim's KV columns
  `[num_computed, num_tokens)`, carried by the step's metadata, are written into vLLM's paged blocks through the
  request's slot mapping, layer by layer — each just before that layer's attention reads it, on CUDA from a side
  stream while the layers before it run — by the attention backend's own cache write (`impl.do_kv_cache_update`,
  what vLLM calls for the keys and values it computes): the layout is the backend's by construction — CPU_ATTN
  packs each block per ISA, FlashAttention keeps `[blocks, block_size, heads, 2·head_dim]` — and this
  code never spells either out.

A conversation's follow-up turn: its claim starts after the earlier turns (`Claim.offset`), which vLLM computed
first in a prefill-only request of their own (the engine's history pass; it carries `HISTORY_KEY`). That request's
blocks are held when it finishes (`request_finished` → True); the follow-up's load copies the ones vLLM's prefix
cache does not already share with it — the partial last block, whole, in the backend's own packing — block to block
on the cache's device, before the chunks' columns are written after them. The held blocks are handed back through
`get_finished` once the claim is dropped.

The engine registers each claim in `CLAIMS`, which the scheduler side reads (vLLM's scheduler runs in the
generator's process); the worker side reads only the step's metadata: each load carries its columns' KV (a view
in-process, pickled into each worker process under tensor parallelism, where each rank writes its share of the
heads), and the held blocks to hand back. A claim's KV is `[layers, 2, tokens, kv_heads, head_dim]`: the
serving prefix at its own positions (none when the history pass computed it), then each chunk with its keys rotated
to where it lands (pipeline.runtime.kv.assemble, the same re-anchoring qvpic's engine uses), made token-major once
when it is built.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

from serve.engine.vllm.claims import CLAIM_KEY, CLAIMS, HISTORY_KEY, REQUEST_KEY, Claim

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


@dataclass
class Load:
    """One request's load in one step, as the worker takes it: no registry, so any worker process can run it."""

    # [layers, 2, tokens, kv_heads, head_dim]: the claim's columns to write (a view of the claim in-process; with
    # worker processes vLLM pickles it into each, and each writes its tensor-parallel share of the heads)
    kv: torch.Tensor
    slots: torch.Tensor  # [tokens] int64: block_id * block_size + offset, one per column of `kv`
    # [copies, 2] int64 (source block, destination block): the history pass's blocks this request does not share
    copies: torch.Tensor | None = None


@dataclass
class QvpicConnectorMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
    released: set[str] = field(default_factory=set)  # history passes whose held blocks vLLM may free now


def slots_of(block_ids: list[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """The paged slots of token positions `[start, end)` of a request whose blocks are `block_ids`."""
    positions = torch.arange(start, end)
    blocks = torch.tensor(block_ids, dtype=torch.long)[positions // block_size]
    return blocks * block_size + positions % block_size


class QvpicConnector(KVConnectorBase_V1):
    """Load-only: qvpic supplies a claimed prompt prefix; it saves nothing (vLLM's prefix cache keeps blocks, and a
    history pass's blocks are held in place, not copied out)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self._pending: dict[str, tuple[str, str, int, int]] = {}  # internal id -> (claim key, engine's id, start, end)
        self._layers: dict[str, int] = {}  # worker: attention layer name -> its decoder layer index
        self._todo: dict[str, tuple[Any, list]] = {}  # worker, this step: layer name -> (the layer, loads) to write
        self._ready: dict[str, tuple] = {}  # worker, this step, CUDA: layer name -> (its writes' event, device)
        self._stream: Any = None  # worker, CUDA: the side stream loads run on
        # scheduler: vLLM's own prefix-cache hit of a request the claim extends (vLLM sets the request's
        # num_computed_tokens only after update_state_after_alloc, so that reads 0 for a new request)
        self._hits: dict[str, int] = {}

    # ---- scheduler side --------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        key = (request.kv_transfer_params or {}).get(CLAIM_KEY)
        claim = CLAIMS.get(key) if key else None
        if claim is None or not claim.ready:  # the engine adds a follow-up only once its history pass ended
            return 0, False
        # Never the whole prompt: vLLM must compute at least its last token to sample from.
        end = min(claim.num_tokens, request.num_prompt_tokens - 1)
        self._hits[request.request_id] = num_computed_tokens
        return max(0, end - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            params = request.kv_transfer_params
            start = self._hits.pop(request.request_id, request.num_computed_tokens)  # vLLM's own prefix-cache hit
            self._pending[request.request_id] = (params[CLAIM_KEY], params.get(REQUEST_KEY, request.request_id),
                                                 start, start + num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = QvpicConnectorMetadata(released=CLAIMS.released())
        for new in scheduler_output.scheduled_new_reqs:
            pending = self._pending.pop(new.req_id, None)
            claim = CLAIMS.get(pending[0]) if pending is not None else None
            if claim is None:
                continue
            _, request_id, start, end = pending
            blocks, first = new.block_ids[0], max(start, claim.offset)  # the claim's first column its KV holds
            meta.loads.append(Load(claim.kv.narrow(2, first - claim.offset, end - first),
                                   slots_of(blocks, self.block_size, first, end), self._copies(claim, blocks, start)))
            claim.loads[request_id] = (start, end)
        self._pending.clear()  # a request preempted before its first step recomputes (it is not reloaded)
        return meta

    def _copies(self, claim: Claim | None, blocks: list[int], start: int) -> torch.Tensor | None:
        """The history pass's blocks from the one holding column `start` (a block boundary: vLLM's prefix-cache hits
        are whole blocks) to the one holding column `offset - 1`, where they are not the request's own already."""
        if claim is None or claim.history is None:
            return None
        source = claim.history[1]
        pairs = [(source[b], blocks[b]) for b in range(start // self.block_size, -(-claim.offset // self.block_size))
                 if source[b] != blocks[b]]
        return torch.tensor(pairs, dtype=torch.long).reshape(-1, 2) if pairs else None

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A history pass that ended as asked (its one token) keeps its blocks for its follow-up's load."""
        from vllm.v1.request import RequestStatus

        self._hits.pop(request.request_id, None)
        key = (request.kv_transfer_params or {}).get(HISTORY_KEY)
        claim = CLAIMS.get(key) if key else None
        if claim is None or request.status is RequestStatus.FINISHED_ABORTED:
            return False, None
        if len(block_ids) * self.block_size < claim.offset:
            raise RuntimeError(f"qvpic history pass {request.request_id} ended with {len(block_ids)} blocks, short "
                               f"of its {claim.offset} tokens")
        claim.history = (request.request_id, list(block_ids))
        CLAIMS.hold(key, request.request_id)
        return True, None

    # ---- worker side -----------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        for name in kv_caches:
            found = _LAYER_INDEX.search(name)
            if found is None:
                raise ValueError(f"qvpic's connector cannot tell which decoder layer {name!r} is")
            self._layers[name] = int(found.group(1))
        self._rank = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()

    def heads(self, kv: torch.Tensor) -> torch.Tensor:
        """This worker's share of `kv`'s heads (dim 3), as vLLM shards KV heads across tensor-parallel ranks: an
        equal slice each, or, with fewer KV heads than ranks, the one head a rank's group replicates."""
        rank, world = getattr(self, "_rank", (0, 1))
        total = kv.shape[3]
        if world == 1:
            return kv
        if total >= world:
            return kv.narrow(3, rank * (total // world), total // world)
        return kv.narrow(3, rank * total // world, 1)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """The step's loads, layer by layer, each before its attention reads it (`wait_for_layer_load`). A history
        pass's whole blocks are copied first, here, on the forward's stream: the forward's own cache write of the
        query's tokens may share the last of them, and must land after. On CUDA the chunks' columns then go on a
        side stream that waits for the forward's stream once (blocks just freed may still be read by the previous
        step), one event a layer: layer i's attention waits for layer i's writes alone, and layers after it load
        while it runs. Elsewhere each layer is written when its attention asks (no stream to overlap on)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, QvpicConnectorMetadata)
        self._todo.clear()
        self._ready.clear()
        if not meta.loads:
            return
        device = next(iter(forward_context.no_compile_layers[name] for name in self._layers)).kv_cache.device
        loads = [(self.heads(load.kv), load.slots.to(device, non_blocking=True),
                  load.copies.to(device, non_blocking=True) if load.copies is not None else None)
                 for load in meta.loads]  # [layers, 2, tokens, heads, head_dim] (this rank's heads), slots, copies
        layers = {name: forward_context.no_compile_layers[name] for name in self._layers}
        for _source, _slots, copies in loads:
            if copies is not None:  # vLLM's per-layer cache is [blocks, …] in any layout: whole blocks on dim 0
                for layer in layers.values():
                    cache = layer.kv_cache
                    cache.index_copy_(0, copies.select(1, 1), cache.index_select(0, copies.select(1, 0)))
        self._todo = {name: (layer, loads) for name, layer in layers.items()}
        if device.type != "cuda":
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        self._stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._stream):
            for name in sorted(self._todo, key=self._layers.__getitem__):  # in the order the forward reaches them
                self._write(*self._todo.pop(name), self._layers[name])
                event = torch.cuda.Event()
                event.record(self._stream)
                self._ready[name] = (event, device)

    @staticmethod
    def _write(layer: Any, loads: list, index: int) -> None:
        """Every load's columns of decoder layer `index` into `layer`'s cache, by the backend's own cache write."""
        for source, slots, _copies in loads:
            # views [tokens, kv_heads, head_dim] (contiguous unless a rank's share of the heads); `to` copies only a
            # claim built on another device
            keys, values = (source.select(0, index).select(0, i).to(slots.device, non_blocking=True) for i in (0, 1))
            if not keys.is_contiguous():
                keys, values = keys.contiguous(), values.contiguous()
            layer.impl.do_kv_cache_update(layer, keys, values, layer.kv_cache, slots)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before `layer_name`'s attention (vLLM's `maybe_transfer_kv_layer`): its columns are in the cache."""
        ready = self._ready.pop(layer_name, None)
        if ready is not None:  # CUDA: the forward's stream waits on the device, the host does not
            event, device = ready
            torch.cuda.current_stream(device).wait_event(event)
            return
        todo = self._todo.pop(layer_name, None)
        if todo is not None:
            self._write(*todo, self._layers[layer_name])

    def wait_for_save(self) -> None:
        """The end of the forward: a layer whose attention never asked (none does in a normal step) is loaded now."""
        for name in list(self._todo):
            self.wait_for_layer_load(name)
        for name in list(self._ready):
            self.wait_for_layer_load(name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """History passes whose blocks may be freed (their claims were dropped), as vLLM's finished sends: every
        worker reports them, and vLLM frees them once all have."""
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        return (set(meta.released) or None) if isinstance(meta, QvpicConnectorMetadata) else None, None
