"""What a served linked answer must equal, computed without the serving graph.

The served answer (`POST /v1/answer`, qvpic mode, greedy) names the chunks it linked: their ids, tiers and KV
variants, in the order they were assembled. `independent_answer` takes only that list and the query, reads
those entries' KV files straight from the store (`pipeline.store.Store`, none of serve/kv's loaders, tiers or
wire codec), lays them out with the batch-1 runtime (`VLM.assemble`: serving prefix, chunks re-anchored in the
reported order, `VLM.prefill_query`) and decodes greedily with plain forwards, keeping each step's
log-probabilities. No Router, CacheLoader, Generator, engine batch, scheduler, prefix cache or detokenizer runs.

Why this and not a full prefill of the pages: a full prefill lets each chunk attend to the chunks before it;
linked KV does not (each chunk was compiled alone), so the two answers may legitimately differ. The batch-1
runtime used here is itself checked against an independent block-mask full forward from the raw pages
(tests/pipeline/runtime/test_runtime_exactness.py, logits within 1e-5), and the stored KV against a one-node compile
of the same
texts (tests/cluster/test_cluster.py); the served answer is checked against this, token for token and log-probability
for log-probability (`mismatch`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.runtime import VLM
from pipeline.runtime.kv import ChunkKV
from pipeline.store import Store
from schemas.modes import ChunkKind, Variant

# |served − reference| log-probability, float32 tiny-qwen: the served generator runs the fused forward with
# prepacked weights (serve/config-gpu.yaml), the reference transformers' own forward; rounding of two summation
# orders, ~1e-6 here. A chunk placed one slot off moves them by 1e-2 or more (the control in
# tests/cluster/test_cluster.py).
LOGPROB_ATOL = 1e-4


@dataclass(frozen=True)
class Reference:
    token_ids: list[int]  # the greedy answer, end of turn excluded
    text: str  # as the detokenizer's contract states it: decode(ids, skip special tokens), no U+FFFD
    logprobs: list[torch.Tensor]  # log-softmax of each step's logits (one more than token_ids at an end of turn)


def linked_chunks(store: Store, reported: list[dict]) -> list[ChunkKV]:
    """The KV of each reported chunk (`chunk_id`, `tier`, `variant` of the response's `chunks`), read from the
    store's index and shards, at compile-time positions."""
    keys = store.chunks_for([c["chunk_id"] for c in reported])["chunk_key"].to_pylist()
    chunks = []
    for chunk, key in zip(reported, keys):
        rows = store.lookup([key], tiers=[chunk["tier"]], variants=[Variant(chunk["variant"])]).to_pylist()
        assert len(rows) == 1, f"{chunk['chunk_id']}: {len(rows)} index rows for one entry"
        (row,), (kv,) = rows, store.load_many(rows)
        chunks.append(ChunkKV(kv.float(), row["position_span"], row["compile_start"], ChunkKind(row["kind"]),
                              [tuple(g) for g in row["grid_thw"] or []], row["vision_tokens"]))
    return chunks


@torch.inference_mode()
def independent_answer(vlm: VLM, chunks: list[ChunkKV], query: str, max_new_tokens: int) -> Reference:
    """Greedy decoding of `[serving prefix][chunks re-anchored in order][query turn]` by plain forwards."""
    context = vlm.assemble(chunks)
    state = vlm.prefill_query(context, query)
    logits, position = state.logits[0, -1], state.next_position
    cache = state.cache
    tokens: list[int] = []
    logprobs: list[torch.Tensor] = []
    for _ in range(max_new_tokens):
        logprobs.append(torch.log_softmax(logits.float(), dim=-1))
        token = int(logits.argmax())
        if token in vlm.adapter.end_of_turn_ids:
            break
        tokens.append(token)
        out = vlm._forward(torch.tensor([[token]]), cache, position)
        logits, position, cache = out.logits[0, -1], out.next_position, out.cache
    text = vlm.tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return Reference(tokens, text.replace("\ufffd", ""), logprobs)


def mismatch(body: dict, reference: Reference, atol: float = LOGPROB_ATOL) -> str | None:
    """Why the served `/v1/answer` body (asked with `logprobs: true, top_logprobs: k`) is not the reference
    answer, or None: its text, its token count, each token's log-probability and the k best at each step."""
    if body["answer"] != reference.text:
        return f"answer {body['answer']!r} != reference {reference.text!r}"
    content = body["logprobs"]["content"]
    if body["usage"]["completion_tokens"] != len(reference.token_ids) or len(content) > len(reference.logprobs):
        return f"{body['usage']['completion_tokens']} tokens served, {len(reference.token_ids)} in the reference"
    worst = 0.0
    for step, (served, expected) in enumerate(zip(content, reference.logprobs)):
        top = [t["logprob"] for t in served["top_logprobs"]]
        wanted = [float(expected.max())] + expected.topk(len(top)).values.tolist()
        worst = max(worst, *(abs(a - b) for a, b in zip([served["logprob"], *top], wanted)))
        if worst > atol:
            return f"step {step}: log-probabilities {[served['logprob'], *top]} != reference {wanted} (atol {atol:g})"
    return None
