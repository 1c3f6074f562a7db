"""A qvpic plan carried by a plain vLLM server's request (Ray Serve LLM, `vllm serve`): the request names its chunks'
store entries in vLLM's `kv_transfer_params`, and qvpic's store connector (serve/engine/vllm/store_connector.py)
loads them from the store itself, re-anchors them and claims them — no qvpic engine in the serving process.

The request, as `completion_request` builds it for the user's client (`/v1/completions`, prompt as token ids):

    prompt             [texts[0]: the template prefix][each entry's placeholder ids][the query turn]
    kv_transfer_params {"qvpic": {"entries": [cache key, …], "offset": len(texts[0])}}

The claim is `[texts[0] KV][each entry's KV re-anchored where it lands]`, as the vLLM engine's own linked prompt
(serve/engine/vllm/prompt.py): texts[0]'s KV from the store's model (`VLM.text_kv`, loaded once in the process that
runs vLLM's scheduler), the entries' from the store, re-anchored by pipeline.runtime.kv.assemble. A plan is checked
against the prompt before anything is claimed: every entry is a text entry of this store, and the prompt holds its
placeholder ids (`identity_ids` of its cache key) right where the plan says — a plan that does not describe its
prompt is refused (`PlanRefused`), and vLLM computes the prompt as the tokens it is.

Image entries are not served this way: their placeholders are image pads whose grids and (zero) embeddings must
travel with the prompt, which the OpenAI completions API does not carry as token ids (docs/DEPLOY.md, untested).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.runtime import VLM, ChunkKV
from pipeline.runtime.kv import assemble
from pipeline.store import QuantizedKV, Store
from pipeline.store.kv_quant import dequantize
from schemas.config import EngineKind, ModelSpec
from schemas.modes import ChunkKind
from schemas.store import CacheKey, CacheKeyError
from serve.engine.vllm.prompt import identity_ids

PLAN_KEY = "qvpic"  # the request's kv_transfer_params entry holding its plan (and the response's, its report)
CONNECTOR = "QvpicStoreConnector"
CONNECTOR_MODULE = "serve.engine.vllm.store_connector"


class PlanRefused(ValueError):
    """A request's plan that does not describe its prompt, or names what this store does not hold."""


@dataclass(frozen=True)
class StorePlan:
    entries: tuple[CacheKey, ...]
    offset: int  # the prompt tokens before the first entry's placeholders: texts[0]

    @classmethod
    def parse(cls, plan: Any) -> StorePlan:
        if not isinstance(plan, Mapping) or not isinstance(plan.get("entries"), list):
            raise PlanRefused("a qvpic plan is {'entries': [cache key, ...], 'offset': int}")
        offset = plan.get("offset")
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 1:
            raise PlanRefused(f"the plan's offset must be a positive int (texts[0]'s tokens), got {offset!r:.40}")
        try:
            entries = tuple(CacheKey.parse(key) for key in plan["entries"])
        except CacheKeyError as error:
            raise PlanRefused(str(error)) from None
        return cls(entries, offset)


def placeholder_avoid(vlm: VLM) -> set[int]:
    return {vlm.adapter.image_token_id, *vlm.adapter.end_of_turn_ids}


def placeholders(vlm: VLM, key: CacheKey, num_tokens: int) -> list[int]:
    """The prompt ids standing for entry `key`: drawn from its cache key (vLLM's prefix cache keys blocks by ids)."""
    return identity_ids(key.to_str().encode(), num_tokens, vlm.vocab_size, placeholder_avoid(vlm))


def entry_rows(store: Store, keys: Sequence[CacheKey]) -> list[dict[str, Any]]:
    """The index rows of `keys`, in order; PlanRefused naming the first the store lacks or that is not text."""
    table = store.lookup(chunk_keys=[k.chunk_key for k in keys], fingerprints={k.fingerprint for k in keys})
    rows = {(r["chunk_key"], r["tier"], r["variant"], r["fingerprint"]): r for r in table.to_pylist()}
    out = []
    for key in keys:
        row = rows.get((key.chunk_key, key.tier, key.variant.value, key.fingerprint))
        if row is None:
            raise PlanRefused(f"store {store.uri} holds no entry {key.to_str()}")
        if row["kind"] != ChunkKind.TEXT.value:
            raise PlanRefused(f"{key.to_str()} is an image entry: only text entries are served through a plan")
        out.append(row)
    return out


class PlanClaims:
    """Builds a plan's claim KV: the store's entries re-anchored after texts[0]'s KV. The store and the model are
    opened on the first plan (the connector is built in every vLLM process; only the scheduler's builds claims)."""

    def __init__(self, store_uri: str, model: ModelSpec):
        self.store_uri, self.model = store_uri, model
        self._opened: tuple[Store, VLM] | None = None
        self._lock = threading.Lock()

    def opened(self) -> tuple[Store, VLM]:
        with self._lock:
            if self._opened is None:
                from pipeline.runtime.checkpoint import check_store

                store = Store.open(self.store_uri)
                check_store(store.load_manifest_or_raise(), self.model)  # the store's KV is this model's
                self._opened = store, VLM(self.model.weights_for(EngineKind.VLLM))  # vLLM's copy is the GPU's
            return self._opened

    def claim_kv(self, prompt_ids: Sequence[int], plan: StorePlan) -> torch.Tensor:
        """The claim's KV `[layers, 2, tokens, kv_heads, head_dim]` (token-major, as the connector writes it)."""
        store, vlm = self.opened()
        rows = entry_rows(store, plan.entries)
        column = plan.offset
        for key, row in zip(plan.entries, rows):
            expected = placeholders(vlm, key, row["num_tokens"])
            if list(prompt_ids[column:column + len(expected)]) != expected:
                raise PlanRefused(f"the prompt does not hold {key.to_str()}'s placeholders at column {column}")
            column += len(expected)
        if column >= len(prompt_ids):  # vLLM computes at least the prompt's last token, to sample from
            raise PlanRefused(f"the plan covers {column} of the prompt's {len(prompt_ids)} tokens: no query after it")
        chunks = []
        for row, stored in zip(rows, store.load_many(rows)):  # each verified against its checksum
            kv = dequantize(stored, vlm.dtype) if isinstance(stored, QuantizedKV) else stored
            chunks.append(ChunkKV(kv.to(vlm.device, vlm.dtype), row["position_span"], row["compile_start"],
                                  ChunkKind.TEXT))
        before = vlm.text_kv(list(prompt_ids[:plan.offset]))
        layers, _, heads, _, head_dim = before.kv.shape
        kv = torch.empty(layers, 2, heads, column, head_dim, dtype=before.kv.dtype, device=before.kv.device)
        assemble(before, chunks, vlm.rotations, out=kv)
        return kv.transpose(2, 3).contiguous()


def completion_request(vlm: VLM, store: Store, entries: Sequence[str], query: str, model: str,
                       max_tokens: int = 64, **body: Any) -> dict[str, Any]:
    """The `/v1/completions` body for a plain vLLM server running qvpic's store connector: `query` over `entries`
    (cache key strings of the store's text entries, e.g. a qvpic plan's), after the template prefix."""
    keys = [CacheKey.parse(key) for key in entries]
    rows = entry_rows(store, keys)
    before = list(vlm.adapter.prefix_ids)
    ids = before + [t for key, row in zip(keys, rows) for t in placeholders(vlm, key, row["num_tokens"])]
    ids += vlm.query_turn_ids(query)
    return {"model": model, "prompt": ids, "max_tokens": max_tokens,
            "kv_transfer_params": {PLAN_KEY: {"entries": [k.to_str() for k in keys], "offset": len(before)}}, **body}


def kv_transfer_config(store_uri: str, model: ModelSpec) -> dict[str, Any]:
    """vLLM's `kv_transfer_config` naming qvpic's store connector over `store_uri` (`engine_kwargs` of a Ray Serve
    LLM `LLMConfig`, or `vllm serve --kv-transfer-config`)."""
    return {"kv_connector": CONNECTOR, "kv_role": "kv_both", "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_connector_extra_config": {"qvpic_store": store_uri, "qvpic_model": model.model_dump(mode="json")}}
