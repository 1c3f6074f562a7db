"""Choosing the next token from one step's logits: OpenAI's penalties and logit bias, then greedy or temperature +
nucleus sampling. The serving engine (serve/engine/qvpic/sampler.py) and `VLM.decode` both call these: one rule for
both."""

from __future__ import annotations

import torch

from schemas.sampling import Sampling


def adjust_logits(logits: torch.Tensor, generated: list[int], sampling: Sampling) -> torch.Tensor:
    """OpenAI's penalties and logit bias on one step's logits `[..., vocab]` (a new tensor):
    `logit[j] - count[j] * frequency_penalty - (count[j] > 0) * presence_penalty + bias[j]`, where `count[j]` is
    how often token j was decoded so far in this answer (the prompt's tokens are not counted, as OpenAI's
    reference formula and vLLM's output-token penalties do)."""
    logits = logits.float().clone()
    if generated and (sampling.presence_penalty or sampling.frequency_penalty):
        ids = torch.tensor(generated, device=logits.device)
        counts = torch.zeros(logits.shape[-1], device=logits.device).index_add_(
            0, ids, torch.ones(len(generated), device=logits.device))
        logits -= counts * sampling.frequency_penalty + (counts > 0).float() * sampling.presence_penalty
    if sampling.logit_bias:  # index_add_: a token named twice ("5" and "05") gets both biases, not an arbitrary one
        ids = torch.tensor([token for token, _ in sampling.logit_bias], device=logits.device)
        biases = torch.tensor([bias for _, bias in sampling.logit_bias], device=logits.device)
        logits.index_add_(-1, ids, biases.expand(*logits.shape[:-1], len(ids)))
    return logits


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The log-probability of `token` under `logits` `[vocab]` (a log-softmax in float32), and the `top` most
    likely tokens with theirs, best first."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best = torch.topk(logprobs, top) if top else None
    alternatives = () if best is None else tuple(zip(best.indices.tolist(), best.values.tolist()))
    return float(logprobs.select(-1, token)), alternatives


def select_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """Greedy at temperature 0, else temperature + nucleus (top-p) sampling. logits: [1, vocab]."""
    return int(choose_token(logits, sampling, generator))


def choose_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """`select_token`'s choice left on the logits' device, a 0-d tensor: the engine reads every row's at once (one
    transfer a step, not one a row)."""
    if sampling.temperature == 0:
        return logits.argmax(-1).reshape(())
    logits = logits.double()  # a temperature below float32's range would round to 0 there
    # Shift the best logit to 0 before dividing: a tiny temperature then sends the rest to -inf instead
    # of overflowing them all to inf (inf - inf = NaN in the softmax).
    probs = torch.softmax((logits - logits.max()) / sampling.temperature, dim=-1).squeeze(0)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < sampling.top_p  # always keeps the top token
        # zeroed, not dropped: boolean indexing would size its output from the data (a device sync on a GPU)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs * keep)
    return torch.multinomial(probs / probs.sum(), 1, generator=generator).reshape(())
