"""qvpic's connector for a plain vLLM server (Ray Serve LLM, `vllm serve`): `QvpicConnector` whose claims come from
the request's own plan (serve/engine/vllm/store_plan.py) instead of qvpic's engine.

Configured by `store_plan.kv_transfer_config(store, model)`: `kv_connector_extra_config` names the store
(`qvpic_store`) and its model (`qvpic_model`, a ModelSpec). On the scheduler side, the first time vLLM asks about a
request that carries `kv_transfer_params["qvpic"]`, the plan is turned into a claim and registered in `CLAIMS` under
a key of the request's own; from there the request goes through `QvpicConnector` unchanged (the claim's columns
written into its blocks on the worker side). When the request ends its claim is dropped, and the response's
`kv_transfer_params["qvpic"]` reports what was claimed — `claimed` (the prompt columns the claim covered, vLLM's
own prefix-cache hits among them) and `loaded` (the ones the connector wrote) — or why the plan was refused
(`refused`: vLLM then computed the whole prompt, its placeholders as the text ids they are).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from schemas.config import ModelSpec
from serve.engine.vllm.claims import CLAIM_KEY, CLAIMS, REQUEST_KEY, Claim
from serve.engine.vllm.connector import QvpicConnector
from serve.engine.vllm.store_plan import PLAN_KEY, PlanClaims, PlanRefused, StorePlan

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
REFUSED_KEY = "qvpic_refused"  # set on a request whose plan was refused: asked once, not at every schedule


class QvpicStoreConnector(QvpicConnector):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)
        config = vllm_config.kv_transfer_config
        store = config.get_from_extra_config("qvpic_store", None)
        model = config.get_from_extra_config("qvpic_model", None)
        if not store or not model:
            raise ValueError("QvpicStoreConnector needs kv_connector_extra_config 'qvpic_store' (a store URI) and "
                             "'qvpic_model' (its ModelSpec): serve.engine.vllm.store_plan.kv_transfer_config")
        self.plans = PlanClaims(store, ModelSpec.model_validate(model))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params and PLAN_KEY in params and CLAIM_KEY not in params and REFUSED_KEY not in params:
            key = f"qvpic-plan-{request.request_id}"
            try:
                kv = self.plans.claim_kv(request.prompt_token_ids, StorePlan.parse(params[PLAN_KEY]))
            except PlanRefused as error:
                log.warning("qvpic plan of %s refused: %s", request.request_id, error)
                params[REFUSED_KEY] = str(error)
            else:
                CLAIMS.put(key, Claim(kv))
                params[CLAIM_KEY], params[REQUEST_KEY] = key, request.request_id
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params or {}
        held = super().request_finished(request, block_ids)  # a plan's request is never a history pass: not held
        if PLAN_KEY not in params:
            return held
        if REFUSED_KEY in params:
            return False, {PLAN_KEY: {"refused": params[REFUSED_KEY]}}
        claim = CLAIMS.drop(params[CLAIM_KEY])
        start, end = claim.loads.get(request.request_id, (0, 0)) if claim is not None else (0, 0)
        return False, {PLAN_KEY: {"claimed": end, "loaded": end - start}}
