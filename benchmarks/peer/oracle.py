"""vLLM as an outside correctness oracle for qvpic's full prefill (`python -m benchmarks.peer.side_by_side --oracle`).

The same requests go to both engines: qvpic's `full_text` / `full_image` prefill (`VLM.prefill_full`, what the
engine runs for those modes) and vLLM given chat messages of the same parts in the same order (it applies the
checkpoint's chat template, tokenises and preprocesses the images itself). Greedy, float32; per request the
prompt token ids, the first `NEW_TOKENS` tokens and, at the first step where the engines part, both logit
margins (top-1 minus top-2: random weights make near-ties, where float rounding alone may flip the argmax).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.tools import ttft_store
from pipeline.eval import markdown_table, oracle
from pipeline.eval.oracle import transposed_grids  # noqa: F401  (the grid control: benchmarks/peer/side_by_side.py)
from pipeline.runtime import VLM, Renderer
from schemas.config import ModelSpec
from schemas.modes import Mode
from schemas.render import RenderSpec

NEW_TOKENS = 8
TARGET_SHARE = 0.95
POOL_CHUNKS = 12  # the store's first chunks; each request takes 1-3 of them in its own order
CHUNK_TOKENS = 128


@dataclass(frozen=True)
class Request:
    mode: Mode  # FULL_TEXT: pieces are texts; FULL_IMAGE: pieces are lists of page PNG paths
    pieces: tuple  # str | tuple[str, ...] (page paths) per chunk, in prompt order
    query: str

    def parts(self) -> list[dict]:
        """The user turn as vllm_side takes it: the pieces in order, then the query."""
        out = []
        for piece in self.pieces:
            out += [{"text": piece}] if isinstance(piece, str) else [{"image": p} for p in piece]
        return out + [{"text": self.query}]


def requests(spec: ModelSpec, workdir: Path, per_mode: int, seed: int = 0) -> list[Request]:
    """`per_mode` requests of each mode over the same chunks and question; the pages at the lowest tier."""
    texts, _, query = ttft_store.chunk_texts(spec, CHUNK_TOKENS, POOL_CHUNKS, seed)
    render = RenderSpec()
    renderer = Renderer(render)
    pages = []
    for c, text in enumerate(texts):
        paths = []
        for n, page in enumerate(renderer.render(text, render.lowest_tier).pages):
            paths.append(str(workdir / f"chunk{c:02d}-page{n}.png"))
            page.save(paths[-1])
        pages.append(tuple(paths))
    rng = random.Random(seed)
    out = []
    for mode in (Mode.FULL_TEXT, Mode.FULL_IMAGE):
        for i in range(per_mode):
            chosen = rng.sample(range(len(texts)), 1 + i % 3)
            source = texts if mode is Mode.FULL_TEXT else pages
            out.append(Request(mode, tuple(source[c] for c in chosen), f"{query} (request {i})"))
    return out


def reordered(reqs: list[Request]) -> list[Request]:
    """The negative control's requests: each request of 2-3 chunks with its chunks in reverse order (the
    others as they are). The same parts, so the same vision and text tokens: only their order and positions
    differ. If the first tokens still matched vLLM's answers to the original order, agreement would prove
    nothing (random weights that ignore the context); they must not."""
    return [Request(r.mode, r.pieces[::-1], r.query) if len(r.pieces) > 1 else r for r in reqs]


def control_agreement(reqs: list[Request], control: list[dict], theirs: list[dict],
                      modes: tuple[Mode, ...] = (Mode.FULL_TEXT, Mode.FULL_IMAGE), multi_chunk: bool = True) -> str:
    """Per mode, the share of the control's requests whose first tokens still equal vLLM's for the original
    (`multi_chunk`: only the requests of 2-3 chunks, the ones reordering changes)."""
    cells = []
    for mode in modes:
        idx = [i for i, r in enumerate(reqs) if r.mode is mode and (len(r.pieces) > 1 or not multi_chunk)]
        same = sum(control[i]["output_ids"] == theirs[i]["output_ids"][:NEW_TOKENS] for i in idx)
        cells.append(f"{mode.value} {same}/{len(idx)} ({100 * same / max(1, len(idx)):.0f}%)")
    return ", ".join(cells)


def margin_gap(reqs: list[Request], ours: list[dict], theirs: list[dict], mode: Mode) -> str:
    """Median / max over `mode`'s requests of |qvpic's first-step logit margin − vLLM's| (top-1 − top-2 at
    the first new token): greedy tokens agree through near-ties, the margins move with any change of the
    logits, so this shows what a control changes even where it keeps the tokens."""
    gaps = sorted(abs(ours[i]["margins"][0] - theirs[i]["margins"][0]) for i, r in enumerate(reqs)
                  if r.mode is mode and ours[i]["margins"] and theirs[i]["margins"] and
                  theirs[i]["margins"][0] is not None)
    return f"{gaps[len(gaps) // 2]:.2g} / {gaps[-1]:.2g}" if gaps else "—"


def margin(logits: torch.Tensor) -> float:
    return oracle.margin(oracle.top_steps(logits))


@torch.inference_mode()
def run_qvpic(vlm: VLM, reqs: list[Request]) -> list[dict]:
    """Prompt ids, greedy tokens (stopping after an end-of-turn token, as vLLM does) and per-step margins."""
    from PIL import Image

    results = []
    for req in reqs:
        pieces = [p if isinstance(p, str) else [Image.open(path) for path in p] for p in req.pieces]
        state = vlm.prefill_full(pieces, req.query)
        prompt = [t for p in pieces for t in (vlm.adapter.encode(p) if isinstance(p, str) else
                                               vlm.image_inputs(p)[2])]
        prompt = vlm.adapter.prefix_ids + prompt + vlm.query_turn_ids(req.query)
        tokens, margins, logits = [], [], state.logits[0, -1]
        for _ in range(NEW_TOKENS):
            tokens.append(int(logits.argmax()))
            margins.append(margin(logits))
            if tokens[-1] in vlm.adapter.end_of_turn_ids:
                break
            state = vlm.extend(state, [tokens[-1]])
            logits = state.logits[0, -1]
        results.append({"prompt_ids": prompt, "output_ids": tokens, "margins": margins})
    return results


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def report(reqs: list[Request], ours: list[dict], theirs: list[dict]) -> tuple[str, bool]:
    """The agreement table per mode, the differing requests with both margins, and whether the target is met."""
    rows, parted, met = [], [], True
    for mode in (Mode.FULL_TEXT, Mode.FULL_IMAGE):
        idx = [i for i, r in enumerate(reqs) if r.mode is mode]
        same_prompt = sum(ours[i]["prompt_ids"] == theirs[i]["prompt_ids"] for i in idx)
        first = sum(ours[i]["output_ids"][:1] == theirs[i]["output_ids"][:1] for i in idx)
        eight = sum(ours[i]["output_ids"] == theirs[i]["output_ids"][:NEW_TOKENS] for i in idx)
        met &= min(first, eight) >= TARGET_SHARE * len(idx)
        tokens = sorted(len(theirs[i]["prompt_ids"]) for i in idx)
        rows.append([mode.value, len(idx), f"{tokens[0]}–{tokens[-1]}", f"{100 * same_prompt / len(idx):.0f}%",
                     f"{100 * first / len(idx):.0f}%", f"{100 * eight / len(idx):.0f}%"])
        for i in idx:
            step = first_difference(ours[i]["output_ids"], theirs[i]["output_ids"][:NEW_TOKENS])
            if step is not None:
                m_ours = ours[i]["margins"][step] if step < len(ours[i]["margins"]) else None
                m_theirs = theirs[i]["margins"][step] if step < len(theirs[i]["margins"]) else None
                parted.append([mode.value, i, ours[i]["prompt_ids"] == theirs[i]["prompt_ids"], step,
                               _fmt(m_ours), _fmt(m_theirs)])
    table = markdown_table(["mode", "requests", "prompt tokens", "same prompt ids", "same first token",
                            f"same first {NEW_TOKENS} tokens"], rows)
    detail = ("\n\nWhere the engines part (step = first differing new token; margin = top-1 − top-2 logit "
              "there):\n\n" + markdown_table(["mode", "request", "same prompt ids", "step", "qvpic margin",
                                               "vLLM margin"], parted)) if parted else "\n\nNo request parted."
    return table + detail, met


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.4f}"
