"""vLLM as a recorded correctness oracle (issue 38): the requests, qvpic's side of them, the stamps and the checks.

vLLM cannot run in CI (no peer venv there), so its answers are recorded once, by
`python -m benchmarks.peer.record_oracle` in the peer venv, into tests/data/vllm_oracle.json: per request the
prompt token ids vLLM built (its own chat templating and image preprocessing), its greedy tokens and the top
`TOP` log-probabilities of every step. tests/pipeline/eval/test_vllm_oracle.py recomputes qvpic's side here on every
run and
compares — on the full prefill (`VLM.prefill_full`, what full_text/full_image serve) and on the linked path
(each chunk compiled alone under the template prefix, then assembled, re-anchored, and only the query turn
prefilled: what qvpic mode serves). The recording is stamped with what it depends on (vLLM's version, the
checkpoint's weights and chat template, the rendered pages' pixels): a stamp that no longer matches what this
machine would record fails the test instead of comparing against a stale oracle.

Random weights make near-ties, where float rounding alone flips an argmax; the logit margin (top-1 − top-2
log-probability) shows what changes the logits even where the greedy tokens survive. The two negative controls
perturb qvpic's side only — chunks in reverse order, and every image token's M-RoPE height and width swapped —
and must move agreement and margins well away from the as-compiled ones.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from pipeline.runtime import VLM, Renderer, resolve_path
from schemas.config import DType, ModelSpec
from schemas.modes import Mode
from schemas.render import RenderSpec

MODEL = "oracle-qwen"  # pipeline/runtime/tiny.py: the smallest checkpoint vLLM's CPU attention runs
NEW_TOKENS = 8
TOP = 5  # log-probabilities kept per step
REQUESTS_PER_MODE = 9  # a third each of one, two and three chunks
SEED = 38
CHUNKS = (
    "Invoice 4471 for part XK-4471-B was issued on 2 March; the part ships on 12 March from the Leeds depot.",
    "The warranty covers two years of normal use and excludes damage from water, dropping or unauthorised repair.",
    "To reset the router, hold the recessed button for ten seconds until the amber light blinks twice.",
    "Bake the loaf at 220 degrees for 35 minutes, then let it cool on a wire rack for at least an hour.",
    "Part QZ-19 ships on 3 April; orders placed after 28 March move to the next consignment in May.",
    "The museum opens at nine on weekdays and at ten on Sundays; the east wing is closed for restoration.",
)
QUERIES = ("When does the part ship?", "What does the text say about the dates?", "Summarise the passage.",
           "Which numbers appear, and what do they mean?")


@dataclass(frozen=True)
class OracleRequest:
    mode: Mode  # FULL_TEXT: the chunks as text; FULL_IMAGE: as their rendered pages
    chunks: tuple[int, ...]  # indices into CHUNKS, in prompt order
    query: str

    def reversed(self) -> OracleRequest:
        return OracleRequest(self.mode, self.chunks[::-1], self.query)


def spec() -> ModelSpec:
    return ModelSpec(path=MODEL, dtype=DType.FLOAT32, device="cpu")


def requests() -> list[OracleRequest]:
    """`REQUESTS_PER_MODE` requests per mode of 1–3 chunks. With one chunk the linked path is exact (the chunk was
    compiled where it sits, after the template prefix); with more, each later chunk is re-anchored without having
    attended to the ones before it — the position-independent approximation — and reversing them changes the
    prompt (the controls)."""
    rng = random.Random(SEED)
    return [OracleRequest(mode, tuple(rng.sample(range(len(CHUNKS)), 1 + i % 3)), QUERIES[i % len(QUERIES)])
            for mode in (Mode.FULL_TEXT, Mode.FULL_IMAGE) for i in range(REQUESTS_PER_MODE)]


def pages() -> list[list[Image.Image]]:
    """Each chunk's pages, rendered at the lowest tier (what the linked path compiles and vLLM is sent)."""
    render = RenderSpec()
    renderer = Renderer(render)
    return [renderer.render(text, render.lowest_tier).pages for text in CHUNKS]


def stamp(pages_: list[list[Image.Image]]) -> dict[str, str]:
    """What a recording depends on besides vLLM: the checkpoint's weights and chat template, the pages' pixels."""
    from safetensors import safe_open

    folder = resolve_path(spec())
    weights = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for name in sorted(f.keys()):
                weights.update(name.encode())
                weights.update(f.get_tensor(name).contiguous().numpy().tobytes())
    pixels = hashlib.sha256()
    for chunk in pages_:
        for page in chunk:
            pixels.update(f"{page.size}".encode())
            pixels.update(page.convert("RGB").tobytes())
    return {"model": MODEL, "weights_sha256": weights.hexdigest(),
            "template_sha256": hashlib.sha256((folder / "chat_template.jinja").read_bytes()).hexdigest(),
            "pages_sha256": pixels.hexdigest()}


def save_pages(pages_: list[list[Image.Image]], folder: Path) -> list[list[str]]:
    paths = []
    for c, chunk in enumerate(pages_):
        paths.append([])
        for n, page in enumerate(chunk):
            paths[-1].append(str(folder / f"chunk{c}-page{n}.png"))
            page.save(paths[-1][-1])
    return paths


def parts(request: OracleRequest, page_paths: list[list[str]]) -> list[dict]:
    """The user turn as benchmarks/peer/vllm_side.py sends it: the chunks in order, then the query."""
    out = []
    for c in request.chunks:
        out += [{"text": CHUNKS[c]}] if request.mode is Mode.FULL_TEXT else [{"image": p} for p in page_paths[c]]
    return out + [{"text": request.query}]


def top_steps(logits: torch.Tensor) -> list[list[float]]:
    """The `TOP` best (token id, log-probability) of one step's logits `[vocab]`, best first."""
    best = torch.log_softmax(logits.float(), -1).topk(TOP)
    return [[int(i), float(v)] for i, v in zip(best.indices, best.values)]


@torch.inference_mode()
def greedy(vlm: VLM, state) -> dict:
    """Greedy tokens from a prefill state (stopping after an end-of-turn token, as vLLM does) and each step's top."""
    tokens, tops, logits = [], [], state.logits[0, -1]
    for _ in range(NEW_TOKENS):
        tops.append(top_steps(logits))
        tokens.append(tops[-1][0][0])
        if tokens[-1] in vlm.adapter.end_of_turn_ids:
            break
        state = vlm.extend(state, [tokens[-1]])
        logits = state.logits[0, -1]
    return {"output_ids": tokens, "top": tops}


def pieces(request: OracleRequest, pages_: list[list[Image.Image]]) -> list:
    return [CHUNKS[c] if request.mode is Mode.FULL_TEXT else pages_[c] for c in request.chunks]


@torch.inference_mode()
def run_full(vlm: VLM, reqs: list[OracleRequest], pages_: list[list[Image.Image]]) -> list[dict]:
    """qvpic's full prefill of each request (full_text / full_image), with the prompt ids it built."""
    out = []
    for request in reqs:
        chunk_pieces = pieces(request, pages_)
        prompt = [t for p in chunk_pieces for t in (vlm.adapter.encode(p) if isinstance(p, str)
                                                     else vlm.image_inputs(p)[2])]
        result = greedy(vlm, vlm.prefill_full(chunk_pieces, request.query))
        out.append({"prompt_ids": vlm.adapter.prefix_ids + prompt + vlm.query_turn_ids(request.query), **result})
    return out


@torch.inference_mode()
def run_linked(vlm: VLM, reqs: list[OracleRequest], pages_: list[list[Image.Image]]) -> list[dict]:
    """qvpic's linked path: each chunk compiled alone (template prefix, stripped), assembled in request order with
    re-anchored positions, then only the query turn prefilled."""
    compiled: dict[tuple[Mode, int], object] = {}
    out = []
    for request in reqs:
        for c in request.chunks:
            if (request.mode, c) not in compiled:
                compiled[request.mode, c] = (vlm.compile_text(CHUNKS[c]) if request.mode is Mode.FULL_TEXT
                                             else vlm.compile_images(pages_[c]))
        context = vlm.assemble([compiled[request.mode, c] for c in request.chunks])
        out.append(greedy(vlm, vlm.prefill_query(context, request.query)))
    return out


@contextlib.contextmanager
def transposed_grids(vlm: VLM) -> Iterator[None]:
    """A negative control for images: every image token's M-RoPE height and width positions swapped (row r,
    column c sits at (c, r)). The same tokens and vision features, the text after an image at the same positions
    (it starts past the largest axis, which a swap keeps): only the grid moved."""
    real = vlm.positions

    def swapped(input_ids: torch.Tensor, grids: torch.Tensor | None, start: int = 0) -> torch.Tensor:
        pos = real(input_ids, grids, start)  # (axes, 1, L): temporal, height, width
        if grids is None or pos.shape[0] < 3:
            return pos
        image = input_ids[0] == vlm.adapter.image_token_id
        pos = pos.clone()
        pos[1, 0, image], pos[2, 0, image] = pos[2, 0, image], pos[1, 0, image].clone()
        return pos

    vlm.positions = swapped
    try:
        yield
    finally:
        del vlm.positions  # the class's method again


# ---- the comparison --------------------------------------------------------------------------------------
def margin(step: list[list[float]]) -> float:
    """Top-1 minus top-2 log-probability of one step."""
    return step[0][1] - step[1][1]


def agreement(ours: list[dict], theirs: list[dict], indices: list[int]) -> float:
    """Share of the requests at `indices` whose greedy tokens equal vLLM's, all `NEW_TOKENS` of them."""
    same = sum(ours[i]["output_ids"] == theirs[i]["output_ids"][:NEW_TOKENS] for i in indices)
    return same / len(indices)


def margin_gaps(ours: list[dict], theirs: list[dict], indices: list[int]) -> list[float]:
    """|qvpic's first-step margin − vLLM's| per request, sorted."""
    return sorted(abs(margin(ours[i]["top"][0]) - margin(theirs[i]["top"][0])) for i in indices)


def logprob_gaps(ours: list[dict], theirs: list[dict], indices: list[int]) -> list[float]:
    """|Δ log-probability| of every top token both engines list, over every step where their tokens still agree."""
    gaps = []
    for i in indices:
        for step, (mine, other) in enumerate(zip(ours[i]["top"], theirs[i]["top"])):
            theirs_by_id = {int(t): lp for t, lp in other}
            gaps += [abs(lp - theirs_by_id[int(t)]) for t, lp in mine if int(t) in theirs_by_id]
            if ours[i]["output_ids"][step] != theirs[i]["output_ids"][step]:
                break
    return sorted(gaps)
