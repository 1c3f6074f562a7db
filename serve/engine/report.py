"""A request's `AnswerReport`: what was served (after any fallback), what it cost in tokens, where its
time went."""

from __future__ import annotations

from schemas.api import FinishReason
from schemas.report import AnswerReport, ChunkReport, Timings, TokenUsage
from serve.engine.context import Context
from serve.engine.sequence import End, Sequence
from serve.plan import Plan

FINISH = {End.STOP: FinishReason.STOP, End.LENGTH: FinishReason.LENGTH}


def answer_report(plan: Plan, context: Context, seq: Sequence, query_tokens: int) -> AnswerReport:
    """`query_tokens`: the query turn's, as the model tokenises `plan.text_after_chunks`."""
    chunks = []
    online = [None] * len(plan.chunks)
    for planned, served, source, nbytes in zip(plan.chunks, context.served, context.sources or online,
                                               context.kv_nbytes or online):  # served: after any fallback; None online
        chunks.append(ChunkReport(
            chunk_id=planned.chunk_id, doc_id=planned.doc_id, relevance=planned.relevance,
            tier=served.tier if served else planned.tier, variant=served.variant if served else None,
            num_tokens=served.num_tokens if served else planned.num_tokens,
            vision_tokens=served.vision_tokens if served else planned.vision_tokens,
            position_span=served.position_span if served else planned.position_span,
            tier_reason=planned.tier_reason, kv_source=source, kv_nbytes=nbytes, group=planned.group,
        ))
    vision_tokens = sum(c.vision_tokens for c in chunks)
    context_tokens = seq.num_prompt_tokens - query_tokens  # as prefilled (the engine sets it)
    cached = seq.prefix_cached_tokens  # then the chunks linked after the cached run (none online)
    cached += seq.resumed.linked_tokens if seq.resumed is not None else seq.linked_tokens
    usage = TokenUsage(
        context_tokens=context_tokens, context_vision_tokens=vision_tokens,
        context_text_tokens=context_tokens - vision_tokens, cached_tokens=cached,
        prefix_cached_tokens=seq.prefix_cached_tokens,
        query_tokens=query_tokens, completion_tokens=sum(len(s.token_ids) for s in seq.members),  # every choice
    )
    phases = (plan.route_ms, context.load_ms, context.render_ms, seq.queue_ms, seq.reanchor_ms, seq.prefill_ms,
              seq.decode_ms)
    timings = Timings(route_ms=plan.route_ms, load_ms=context.load_ms, render_ms=context.render_ms,
                      queue_ms=seq.queue_ms, reanchor_ms=seq.reanchor_ms, prefill_ms=seq.prefill_ms,
                      decode_ms=seq.decode_ms, total_ms=sum(phases))
    return AnswerReport(mode=plan.mode, finish_reason=FINISH[seq.end], chunks=chunks, usage=usage,
                        timings=timings, cache=context.cache, fallbacks=list(context.fallbacks),
                        generation=plan.generation)
