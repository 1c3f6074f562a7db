"""vLLM's request outputs in qvpic's terms: a prompt's cached and linked columns, and a step's logprobs."""

from __future__ import annotations

from serve.engine.sequence import Sequence
from serve.engine.vllm.claims import Claim


def count_prompt(seq: Sequence, claim: Claim | None, output) -> None:
    """`seq`'s prompt accounting at its first tokens: the columns the connector loaded (`linked_tokens`) and those
    found in a prefix cache (`prefix_cached_tokens`). vLLM counts its own prefix-cache hits and the connector's load
    together (`output.num_cached_tokens`); the columns of a history pass were computed for this request (cached:
    what that pass found in the prefix cache)."""
    start, end = claim.loads.get(output.request_id, (0, 0)) if claim is not None else (0, 0)
    offset = claim.offset if claim is not None else 0
    seq.linked_tokens = max(0, end - max(start, offset))
    seq.prefix_cached_tokens = (claim.history_cached + max(0, start - offset) if offset
                                else (output.num_cached_tokens or 0) - (end - start))


def logprob_entry(step: dict, token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """vLLM's logprobs of one step (`{token id: Logprob}`) as qvpic's entry: the token's, then the `top` best."""
    best = sorted(step.items(), key=lambda item: item[1].rank)[:top]
    return step[token].logprob, tuple((int(t), float(lp.logprob)) for t, lp in best)
