"""qvpic's KV connector for vLLM (`KVConnectorBase_V1`): a request's [template prefix][linked chunks] come from
qvpic, re-anchored where they land; vLLM computes the rest of the prompt (the query) and decodes.

The two sides, as vLLM splits them:
- scheduler side (`get_num_new_matched_tokens`, `update_state_after_alloc`, `build_connector_meta`): a request
  that carries `kv_transfer_params["qvpic_claim"]` (a key the engine registered, see `CLAIMS`) claims its first
  `num_tokens` prompt tokens beyond what vLLM's own prefix cache already holds, and nothing else;
- worker side (`start_load_kv`): for each claimed request of the step, the claim's KV columns
  `[num_computed, num_tokens)` are written into vLLM's paged blocks through the request's slot mapping, layer by
  layer, by the attention backend's own cache write (`impl.do_kv_cache_update`, what vLLM calls for the keys and
  values it computes): the layout is the backend's by construction — CPU_ATTN packs each block per ISA,
  FlashAttention keeps `[blocks, block_size, heads, 2·head_dim]` — and this code never spells either out.

Both sides run in the generator's process (vLLM in-process, one worker): `CLAIMS` is how the KV reaches the
worker without crossing a process boundary. A claim's KV is `[layers, 2, tokens, kv_heads, head_dim]`: the
serving prefix at its own positions, then each chunk with its keys rotated to where it lands
(pipeline.runtime.kv.assemble, the same re-anchoring qvpic's engine uses), made token-major once when it is built.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

CLAIM_KEY = "qvpic_claim"  # the request's kv_transfer_params entry naming its claim
REQUEST_KEY = "qvpic_request"  # and the request id the engine gave it (vLLM suffixes its own internal one)
_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


@dataclass
class Claim:
    """What the connector may supply for one request: the first `num_tokens` prompt tokens' KV."""

    # [layers, 2, num_tokens, kv_heads, head_dim] in the model's dtype: token-major, as a backend's cache write takes
    # keys and values, so a load's columns are views (no copy on the forward's path)
    kv: torch.Tensor
    # per vLLM request id: the columns the worker wrote, [start, end) (vLLM's own prefix cache held those before)
    loads: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.kv.shape[2]


class Claims:
    """Claims by key, registered by the engine before it adds a request and dropped when it ends."""

    def __init__(self):
        self._claims: dict[str, Claim] = {}
        self._lock = threading.Lock()

    def put(self, key: str, claim: Claim) -> None:
        with self._lock:
            self._claims[key] = claim

    def get(self, key: str) -> Claim | None:
        with self._lock:
            return self._claims.get(key)

    def drop(self, key: str) -> Claim | None:
        with self._lock:
            return self._claims.pop(key, None)

    def __len__(self) -> int:
        return len(self._claims)


CLAIMS = Claims()


@dataclass
class Load:
    """One request's load in one step: claim columns `[start, end)` into `slots` (one per column)."""

    key: str
    request_id: str  # the engine's id for it (vLLM's external request id)
    start: int
    end: int
    slots: torch.Tensor  # [end - start] int64: block_id * block_size + offset


@dataclass
class QvpicConnectorMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)


def slots_of(block_ids: list[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """The paged slots of token positions `[start, end)` of a request whose blocks are `block_ids`."""
    positions = torch.arange(start, end)
    blocks = torch.tensor(block_ids, dtype=torch.long)[positions // block_size]
    return blocks * block_size + positions % block_size


class QvpicConnector(KVConnectorBase_V1):
    """Load-only: qvpic supplies a claimed prompt prefix; it never saves (vLLM's prefix cache keeps blocks)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self._pending: dict[str, tuple[str, str, int, int]] = {}  # internal id -> (claim key, engine's id, start, end)
        self._layers: dict[str, int] = {}  # worker: attention layer name -> its decoder layer index

    # ---- scheduler side --------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        key = (request.kv_transfer_params or {}).get(CLAIM_KEY)
        claim = CLAIMS.get(key) if key else None
        if claim is None:
            return 0, False
        # Never the whole prompt: vLLM must compute at least its last token to sample from.
        end = min(claim.num_tokens, request.num_prompt_tokens - 1)
        return max(0, end - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            params = request.kv_transfer_params
            start = request.num_computed_tokens  # vLLM's own prefix-cache hit
            self._pending[request.request_id] = (params[CLAIM_KEY], params.get(REQUEST_KEY, request.request_id),
                                                 start, start + num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = QvpicConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            pending = self._pending.pop(new.req_id, None)
            if pending is not None:
                key, request_id, start, end = pending
                meta.loads.append(Load(key, request_id, start, end,
                                       slots_of(new.block_ids[0], self.block_size, start, end)))
        self._pending.clear()  # a request preempted before its first step recomputes (it is not reloaded)
        return meta

    # ---- worker side -----------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for name in kv_caches:
            found = _LAYER_INDEX.search(name)
            if found is None:
                raise ValueError(f"qvpic's connector cannot tell which decoder layer {name!r} is")
            self._layers[name] = int(found.group(1))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, QvpicConnectorMetadata)
        for load in meta.loads:
            claim = CLAIMS.get(load.key)
            if claim is None:
                raise RuntimeError(f"qvpic claim {load.key} was dropped before its load")
            source = claim.kv.narrow(2, load.start, load.end - load.start)  # [layers, 2, tokens, kv_heads, head_dim]
            slots = None
            for name, index in self._layers.items():
                layer = forward_context.no_compile_layers[name]
                if slots is None:
                    slots = load.slots.to(layer.kv_cache.device, non_blocking=True)
                # contiguous views [tokens, kv_heads, head_dim]; `to` copies only a claim built on another device
                keys, values = (source.select(0, index).select(0, i).to(slots.device, non_blocking=True)
                                for i in (0, 1))
                layer.impl.do_kv_cache_update(layer, keys, values, layer.kv_cache, slots)
            claim.loads[load.request_id] = (load.start, load.end)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # every layer was written in start_load_kv, before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return
