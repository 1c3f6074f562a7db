"""Fidelity of linked chunks inside conversations (issue 35): KL and top-1 agreement against a full prefill of
the *same* conversation, per layout, beside the single-turn layout the rest of BENCHMARKS.md measures.

    python -m benchmarks.quality.conversation_fidelity           # bench-qwen, the fixture tasks + 6 synthetic requests
    python -m benchmarks.quality.conversation_fidelity --quick   # tiny-qwen, fewer requests

For every request its context is chunked, rendered at the lowest tier and compiled (the template variant:
qvpic's); the linked prompt is built as the serving path builds it — the conversation rendered by the
checkpoint's chat template (serve/routing/prompt.py), its texts expanded by the processor, the chunks linked
at the start of the last user message (serve/engine/qvpic/linked_prompt.py `resume`, `assemble_row`) — and the
reference is one full prefill of the same rendered conversation with the pages in the same place
(`VLM.online_segment`). Both teacher-force the item's gold answer. Layouts:

    single-turn   `[template prefix][instruction][chunks][question]` (the native route's; the fidelity table's)
    default       a chat of one user message, the template's default system prompt (the one compile used)
    system-40     the same with a custom ~40-token system prompt (compiled under another one)
    history-3     three earlier user/assistant turns, then the question
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from tqdm import tqdm
from transformers import DynamicCache

from benchmarks.quality.fidelity import items_for
from jobs.help import HelpFormatter
from pipeline.eval import answer_token_ids, markdown_table, trace_full, trace_linked, write_section
from pipeline.ingest import Chunker
from pipeline.runtime import VLM, Renderer, prepare_segment
from schemas.config import DType, ModelSpec
from schemas.conversation import Message
from schemas.corpus import Document
from schemas.modes import Variant
from schemas.render import RenderSpec
from serve.engine.prepared import LinkedPrompt
from serve.engine.qvpic import resume
from serve.engine.qvpic.batch import assemble_row
from serve.routing.prompt import PromptTemplate

SYSTEM_40 = ("You are a careful assistant for a parts warehouse. Read the documents in the user's message, answer "
             "only from them, quote numbers and dates exactly as written, and say so plainly when the documents do "
             "not contain the answer.")
HISTORY = [("What kind of documents are these?", "Scanned pages from an archive."),
           ("Are they complete?", "Some pages may be missing."),
           ("Should I trust the dates in them?", "Yes, quote them as written.")]
LAYOUTS = ("single-turn", "default", "system-40", "history-3")
TARGET_RATIO = 1.5  # no conversation row's median KL above 1.5× the single-turn row's


def conversation(layout: str, question: str) -> list[Message]:
    turns = []
    if layout == "system-40":
        turns.append(Message(role="system", content=SYSTEM_40))
    if layout == "history-3":
        for user, assistant in HISTORY:
            turns += [Message(role="user", content=user), Message(role="assistant", content=assistant)]
    return turns + [Message(role="user", content=question)]


def kl_top1(logits: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """Mean KL(reference ‖ linked) over the answer tokens, and top-1 agreement; logits `[tokens, vocab]`."""
    log_p, log_ref = logits.double().log_softmax(-1), reference.double().log_softmax(-1)
    kl = float((log_ref.exp() * (log_ref - log_p)).sum(-1).mean())
    return kl, float((logits.argmax(-1) == reference.argmax(-1)).double().mean())


@torch.inference_mode()
def conversation_pair(vlm: VLM, prompt: PromptTemplate, messages: list[Message], chunks, pages, answer: list[int],
                      reference_pages=None) -> tuple[float, float]:
    """(KL, top-1) of `chunks` linked against a full prefill of `reference_pages` (default: `pages`)."""
    layout = prompt.conversation(messages)  # one group: the chunks at the start of the last user message
    texts = [prepare_segment(vlm, segment) for segment in layout.texts]
    linked = LinkedPrompt(texts, [list(chunks)], [[b"chunk-%d" % i for i in range(len(chunks))]])
    resumed = resume(vlm, None, b"", linked)  # no prefix cache: the texts are computed, the chunks linked
    columns = (resumed.base.num_tokens if resumed.base is not None else 0) + sum(c.num_tokens for c in resumed.chunks)
    shape = vlm.prefix.kv.shape
    out = torch.empty(shape[0], 2, shape[2], columns, shape[4], dtype=vlm.dtype, device=vlm.device)
    context = assemble_row(vlm, resumed.base, resumed.chunks, out)
    tail, keep = resumed.tail, len(answer)
    ids = torch.tensor([tail.ids + answer[:-1]], device=vlm.device)
    pixels = vlm.adapter.concat_pixels(tail.pixel_values) if tail.pixel_values else None
    grids = torch.cat(tail.grids) if tail.grids else None
    cache = DynamicCache(ddp_cache_data=[(k, v) for k, v in context.layers])
    ours = vlm._forward(ids, cache, context.next_position, pixels, grids, logits_to_keep=keep).logits[0]
    whole = vlm.online_segment(texts, [list(pages if reference_pages is None else reference_pages)])
    ids = torch.tensor([whole.ids + answer[:-1]], device=vlm.device)
    pixels = vlm.adapter.concat_pixels(whole.pixel_values) if whole.pixel_values else None
    grids = torch.cat(whole.grids) if whole.grids else None
    theirs = vlm._forward(ids, DynamicCache(), 0, pixels, grids, logits_to_keep=keep).logits[0]
    return kl_top1(ours, theirs)


def measure(vlm, prompt, item, chunker, renderer, render, answer_tokens) -> dict[str, tuple[float, float]]:
    texts = [c.text for c in chunker.chunk(Document(doc_id=item.id, text=item.context, source="bench"))]
    pages = [renderer.render(t, render.lowest_tier).pages for t in texts]
    answer = answer_token_ids(vlm, item, answer_tokens)
    chunks = [vlm.compile_variant(Variant.TEMPLATE, text, page) for text, page in zip(texts, pages)]
    instruction, query = item.prompt_before_context, item.query_after_context
    reference = trace_full(vlm, [instruction] + list(pages), query, answer)
    single = trace_linked(vlm, vlm.assemble(chunks, instruction), query, answer)
    out = {"single-turn": kl_top1(single.logits, reference.logits)}
    question = (instruction + " " + query).strip()  # what a chat user would type: the instruction and question
    for layout in LAYOUTS[1:]:
        out[layout] = conversation_pair(vlm, prompt, conversation(layout, question), chunks, pages, answer)
    # Controls of the harness itself: one chunk under the prefix it was compiled under is exact (KL ~ 0), and the
    # chunks linked in reverse order against the reference's order must be far off.
    out["control: one chunk"] = conversation_pair(vlm, prompt, conversation("default", question), chunks[:1],
                                                  pages[:1], answer)
    if len(chunks) > 1:
        out["control: reversed"] = conversation_pair(vlm, prompt, conversation("default", question), chunks[::-1],
                                                     pages[::-1], answer, reference_pages=pages)
    return out


def report(results: list[dict[str, tuple[float, float]]]) -> str:
    def spread(values: list[float]) -> str:
        q = statistics.quantiles(values, n=10, method="inclusive") if len(values) > 1 else values * 9
        return f"{statistics.median(values):.4g} [{q[0]:.3g}, {q[-1]:.3g}]"

    base = statistics.median(r["single-turn"][0] for r in results)
    rows = []
    for layout in LAYOUTS:
        kls = [r[layout][0] for r in results]
        rows.append([layout, spread(kls), spread([r[layout][1] for r in results]),
                     f"{statistics.median(kls) / base:.2f}×" if base else "–"])
    for control in ("control: one chunk", "control: reversed"):
        kls = [r[control][0] for r in results if control in r]
        if kls:
            rows.append([control, spread(kls), spread([r[control][1] for r in results if control in r]),
                         f"{statistics.median(kls) / base:.2f}×" if base else "–"])
    worst = max(statistics.median(r[layout][0] for r in results) / base for layout in LAYOUTS[1:]) if base else 0.0
    verdict = (f"Target: no conversation row's median KL above {TARGET_RATIO}× the single-turn row's — "
               f"**{'met' if worst <= TARGET_RATIO else 'missed'}** (worst {worst:.2f}×).")
    table = markdown_table(["layout", "KL median [p10, p90]", "top-1 median [p10, p90]", "KL / single-turn"], rows)
    exact = max(r["control: one chunk"][0] for r in results)
    return (f"{table}\n\n{verdict} Harness controls: one chunk linked under the prefix it was compiled under is "
            f"exact (max KL {exact:.2g} over the requests); the default layout's chunks linked in reverse order "
            f"against the reference's order are the last row.")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.quality.conversation_fidelity",
                                description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--model", default="bench-qwen")
    p.add_argument("--synthetic", type=int, default=6)
    p.add_argument("--limit", type=int, default=2, help="fixture items per task")
    p.add_argument("--chunk-tokens", type=int, default=64)
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="tiny-qwen, one item per task, 2 synthetic requests")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.limit, args.synthetic = "tiny-qwen", 1, 2
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    spec = ModelSpec(path=args.model, dtype=DType.FLOAT32)
    vlm, prompt, render = VLM(spec), PromptTemplate.load(spec), RenderSpec()
    chunker = Chunker(lambda text: len(vlm.adapter.encode(text)), args.chunk_tokens)
    items = items_for(args.synthetic, args.limit)
    results = [measure(vlm, prompt, item, chunker, Renderer(render), render, args.answer_tokens)
               for item in tqdm(items, desc="conversation fidelity", unit="request")]
    body = (f"Model {args.model} (float32, random weights); {len(items)} requests, chunks of ≤{args.chunk_tokens} "
            f"tokens at {render.lowest_tier.dpi} DPI, the template variant linked; ≤{args.answer_tokens} gold answer "
            f"tokens teacher-forced; {time.perf_counter() - started:.0f} s. KL(full ‖ linked) per answer token.\n\n"
            + report(results))
    print(body)
    if not args.no_write:
        write_section("conversation-fidelity", "Fidelity inside conversations: linked chunks vs full prefill of the "
                      "same conversation (issue 35)",
                      ("python -m benchmarks.quality.conversation_fidelity " + " ".join(argv)).strip(), body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
