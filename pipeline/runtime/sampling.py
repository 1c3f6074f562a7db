"""Choosing the next token from one step's logits, in vLLM's order: logit bias, vLLM's repetition penalty, OpenAI's
penalties; then greedy, or temperature, min-p, top-k and nucleus (top-p) sampling. The serving engine
(serve/engine/qvpic/sampler.py) and `VLM.decode` both call these: one rule for both."""

from __future__ import annotations

import torch

from schemas.sampling import Sampling


def adjust_logits(logits: torch.Tensor, generated: list[int], sampling: Sampling,
                  prompt_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """OpenAI's penalties and logit bias on one step's logits `[..., vocab]` (a new tensor):
    `logit[j] - count[j] * frequency_penalty - (count[j] > 0) * presence_penalty + bias[j]`, where `count[j]` is
    how often token j was decoded so far in this answer (the prompt's tokens are not counted, as OpenAI's
    reference formula and vLLM's output-token penalties do). Before those, vLLM's (and HF's) repetition penalty
    `r`: a token in the prompt (`prompt_tokens`, a bool mask `[vocab]` on the logits' device) or in the answer has
    its logit divided by `r` when positive, multiplied by `r` otherwise. Batched tensor ops: no host read."""
    logits = logits.float().clone()
    if sampling.logit_bias:  # index_add_: a token named twice ("5" and "05") gets both biases, not an arbitrary one
        ids = torch.tensor([token for token, _ in sampling.logit_bias], device=logits.device)
        biases = torch.tensor([bias for _, bias in sampling.logit_bias], device=logits.device)
        logits.index_add_(-1, ids, biases.expand(*logits.shape[:-1], len(ids)))
    if sampling.repetition_penalty != 1.0:
        seen = (torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device) if prompt_tokens is None
                else prompt_tokens.clone())
        if generated:
            seen.index_fill_(0, torch.tensor(generated, device=logits.device), True)
        penalised = torch.where(logits > 0, logits / sampling.repetition_penalty, logits * sampling.repetition_penalty)
        logits = torch.where(seen, penalised, logits)
    if generated and (sampling.presence_penalty or sampling.frequency_penalty):
        ids = torch.tensor(generated, device=logits.device)
        counts = torch.zeros(logits.shape[-1], device=logits.device).index_add_(
            0, ids, torch.ones(len(generated), device=logits.device))
        logits -= counts * sampling.frequency_penalty + (counts > 0).float() * sampling.presence_penalty
    return logits


def token_mask(token_ids, vocab: int, device: torch.device) -> torch.Tensor:
    """A bool mask `[vocab]` on `device`, true at `token_ids` (ids past `vocab` left out): one host→device copy."""
    ids = torch.tensor([t for t in token_ids if 0 <= t < vocab], dtype=torch.long, device=device)
    return torch.zeros(vocab, dtype=torch.bool, device=device).index_fill_(0, ids, True)


def ban_tokens(logits: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
    """`logits` with the tokens of the bool mask `banned` `[vocab]` at -inf (min_tokens: no end before it)."""
    return logits.masked_fill(banned, float("-inf"))


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The log-probability of `token` under `logits` `[vocab]` (a log-softmax in float32), and the `top` most
    likely tokens with theirs, best first."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best = torch.topk(logprobs, top) if top else None
    alternatives = () if best is None else tuple(zip(best.indices.tolist(), best.values.tolist()))
    return float(logprobs.select(-1, token)), alternatives


def select_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """Greedy at temperature 0 (top-k, min-p and top-p do not apply, as vLLM's), else temperature, then min-p,
    top-k and top-p (vLLM's order). logits: [1, vocab]."""
    return int(choose_token(logits, sampling, generator))


def choose_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """`select_token`'s choice left on the logits' device, a 0-d tensor: the engine reads every row's at once (one
    transfer a step, not one a row)."""
    if sampling.temperature == 0:
        return logits.argmax(-1).reshape(())
    return torch.multinomial(sampling_distribution(logits, sampling), 1, generator=generator).reshape(())


def sampling_distribution(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """What a sampled token is drawn from (temperature > 0): `[vocab]` probabilities in float64 summing to 1, after
    temperature, min-p, top-k and top-p."""
    logits = logits.double()  # a temperature below float32's range would round to 0 there
    # Shift the best logit to 0 before dividing: a tiny temperature then sends the rest to -inf instead
    # of overflowing them all to inf (inf - inf = NaN in the softmax).
    probs = torch.softmax((logits - logits.max()) / sampling.temperature, dim=-1).squeeze(0)
    # masks by multiplication, never boolean indexing (its output's size is data: a device sync on a GPU)
    if sampling.min_p > 0:  # vLLM's: keep p >= min_p * p_max, after temperature
        probs = probs * (probs >= sampling.min_p * probs.max())
    if 0 < sampling.top_k < probs.shape[-1]:  # the k-th largest probability and every token tied with it stay
        probs = probs * (probs >= probs.topk(sampling.top_k).values.min())
    if sampling.top_p < 1.0:
        probs = probs / probs.sum()  # top-p over what min-p and top-k left, as vLLM's
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < sampling.top_p  # always keeps the top token
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs * keep)
    return probs / probs.sum()
