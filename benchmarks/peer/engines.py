"""The two engines side by side, in one process on one store: vLLM alone, qvpic's engine, qvpic on vLLM.

    .venv-vllm/bin/python -m benchmarks.peer.engines            # bench-qwen, float32 (~10 min on 2 cores)
    .venv-vllm/bin/python -m benchmarks.peer.engines --quick    # fewer requests and rounds

Needs the vLLM engine's venv (`make install-vllm`). A store of 8 synthetic chunks (benchmarks/tools/ttft_store.py)
is served by two in-process stacks (serve.build_local), one per `generator.engine.kind`:
- **vLLM alone**: vLLM's engine computes the whole prompt, the chunks as their pages (full_image on the vLLM stack:
  vLLM's own prefix caching on, salted apart from the linked requests' blocks);
- **qvpic's engine**: qvpic mode on the qvpic stack;
- **qvpic on vLLM**: qvpic mode on the vLLM stack (the connector supplies the template prefix and the chunks).
TTFT = route + load + generate with one new token, each request alone. Workloads, each request naming 4 of the 8
chunks: *reordered* (a random order each time: a prefix cache keeps little), *zipf* (chunks drawn by Zipf
popularity, s = 1.1), *identical* (one request again and again). The three sides take each request in an order
shuffled per request, after a warm-up; figures are medians. *Follow-up turn*: a conversation's second turn
(the first turn's question and the side's own answer as history, 4 new chunks, a new question) after its first.
Decode: 16 requests at once, 32 new tokens each,
tokens/s of their decode steps (the engines' own timers) — vLLM alone against qvpic on vLLM, `DECODE_ROUNDS` rounds of
the same 16 requests to each side in turn, medians.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import random
import statistics
import sys
import tempfile
import time

from benchmarks.tools import ttft_store
from benchmarks.tools.machine import machine_line
from jobs.help import HelpFormatter
from pipeline.eval import markdown_table, write_section
from schemas.api import AnswerRequest
from schemas.config import DType, ModelSpec
from schemas.modes import Mode
from schemas.render import RenderSpec
from serve import build_local

SIDES = ("vLLM alone", "qvpic's engine", "qvpic on vLLM")
READING = ("In-process, not over HTTP (HTTP adds the same hop to every side). Identical requests: qvpic's engine keeps "
           "a whole prompt's KV and its last logits, so a repeat runs no forward; on vLLM's engine the connector's "
           "claim is assembled again and vLLM prefills the tokens past its last full block (128 tokens on the CPU "
           "backend). Decode is vLLM's own in both vLLM columns: the connector costs it nothing. On the vLLM-alone "
           "side, reanchor is building the prompt: qvpic's own processor expands the pages to lay them out before "
           "vLLM processes them again, a cost vLLM served alone would not pay. Follow-up turn on vLLM's engine: vLLM "
           "computes the history first (its history pass: a prefill-only request of the tokens before the chunks, "
           "finding earlier turns' full blocks in its prefix cache), the connector copies the pass's partial last "
           "block and writes the chunks after it, then vLLM prefills the question: two vLLM steps where qvpic's "
           "engine runs one forward.\n")
CHUNKS, PER_REQUEST, ZIPF_S = 8, 4, 1.1
DECODE_ROUNDS = 5


def stack(uri: str, model: ModelSpec, kind: str):
    return build_local({"store": uri, "model": model.model_dump(), "router": {"max_chunks": PER_REQUEST},
                        "ingress": {"default_top_k": PER_REQUEST},
                        "generator": {"engine": {"kind": kind, "max_batch_size": 16, "max_kv_nbytes": 2 << 30}}})


def workloads(chunk_ids: tuple[str, ...], count: int, rng: random.Random) -> dict[str, list[list[str]]]:
    weights = [1 / (i + 1) ** ZIPF_S for i in range(len(chunk_ids))]

    def zipf() -> list[str]:
        picked: list[str] = []
        while len(picked) < PER_REQUEST:
            c = rng.choices(chunk_ids, weights)[0]
            picked += [c] if c not in picked else []
        return picked

    return {"reordered": [rng.sample(chunk_ids, PER_REQUEST) for _ in range(count)],
            "zipf": [zipf() for _ in range(count)],
            "identical": [list(chunk_ids[:PER_REQUEST])] * count}


PHASES = ("route_ms", "load_ms", "render_ms", "reanchor_ms", "prefill_ms")  # the report's own timers


def ttft_ms(side_stack, mode: Mode, chunk_ids: list[str], query: str,
            phases: dict[str, list[float]] | None = None) -> float:
    """Wall time of one request with one new token; each phase's own time appended to `phases`."""
    request = AnswerRequest(query=query, chunk_ids=chunk_ids, mode=mode, max_new_tokens=1)
    started = time.perf_counter()
    answer = asyncio.run(side_stack.answer(request))
    elapsed = (time.perf_counter() - started) * 1e3
    for phase in PHASES if phases is not None else ():
        phases.setdefault(phase, []).append(getattr(answer.report.timings, phase) or 0.0)
    return elapsed


def follow_up_ms(side_stack, mode: Mode, first: list[str], second: list[str], query: str, index: int) -> float:
    """A conversation's second turn, each turn naming its own chunks (placed at its user message): turn 1 is
    answered (its prompt and answer then sit in the engine's prefix cache), then turn 2 — the history as text, new
    chunks, a new question — is timed as `ttft_ms` times a request."""
    opening = [{"role": "user", "content": f"{query} ({index})"}]
    answer = asyncio.run(side_stack.answer(AnswerRequest(query=query, chunk_ids=first, mode=mode, max_new_tokens=8,
                                                         messages=opening)))
    messages = [*opening, {"role": "assistant", "content": answer.text or "."},
                {"role": "user", "content": "And what else does it say?"}]
    request = AnswerRequest(query="And what else does it say?", chunk_ids=second, mode=mode, max_new_tokens=1,
                            messages=messages)
    started = time.perf_counter()
    asyncio.run(side_stack.answer(request))
    return (time.perf_counter() - started) * 1e3


async def decode_rate(side_stack, mode: Mode, requests: list[list[str]], query: str) -> float:
    """Decoded tokens per second of decode time, 16 requests at once (each request's own decode timer)."""
    answers = await asyncio.gather(*(side_stack.answer(AnswerRequest(query=query, chunk_ids=c, mode=mode,
                                                                     max_new_tokens=32)) for c in requests))
    tokens = sum(a.report.usage.completion_tokens - 1 for a in answers)
    return tokens / (max(a.report.timings.decode_ms for a in answers) / 1e3)


def command_line(argv: list[str] | None, module: str, doc: str) -> tuple[argparse.Namespace, int, ModelSpec]:
    """The options of the engines benchmarks (this one and its HTTP twin, engines_http): them, the requests per
    workload, the checkpoint; exits where vLLM does not import."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=HelpFormatter)
    parser.add_argument("--model", default="bench-qwen")
    parser.add_argument("--requests", type=int, default=12, help="requests per workload")
    parser.add_argument("--quick", action="store_true", help="5 requests per workload")
    parser.add_argument("--seed", type=int, default=58)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("vllm") is None:
        sys.exit(f"{module} needs vLLM: run it with .venv-vllm/bin/python (`make install-vllm`)")
    return args, 5 if args.quick else args.requests, ModelSpec(path=args.model, dtype=DType.FLOAT32, device="cpu")


def main(argv: list[str] | None = None) -> None:
    args, count, model = command_line(argv, __name__, __doc__)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="qvpic-engines-") as folder:
        store = ttft_store.build(folder, model, RenderSpec(), chunk_tokens=96, num_chunks=CHUNKS)
        qvpic, on_vllm = stack(folder, model, "qvpic"), stack(folder, model, "vllm")
        sides = {SIDES[0]: (on_vllm, Mode.FULL_IMAGE), SIDES[1]: (qvpic, Mode.QVPIC),
                 SIDES[2]: (on_vllm, Mode.QVPIC)}
        for side_stack, mode in sides.values():  # warm-up: every side's first request pays its start
            for chunk_ids in workloads(store.chunk_ids, 2, random.Random(0))["reordered"]:
                ttft_ms(side_stack, mode, chunk_ids, store.query)
        rows, medians = [], {}
        phases: dict[str, dict[str, list[float]]] = {side: {} for side in SIDES}  # reordered requests, by phase
        for name, requests in workloads(store.chunk_ids, count, rng).items():
            for s in (qvpic, on_vllm):
                s.generator.clear_prefix_cache()
            times: dict[str, list[float]] = {side: [] for side in SIDES}
            for chunk_ids in requests:
                for side in rng.sample(SIDES, len(SIDES)):
                    times[side].append(ttft_ms(*sides[side], chunk_ids, store.query,
                                               phases[side] if name == "reordered" else None))
            medians[name] = {side: statistics.median(t) for side, t in times.items()}
            alone = medians[name][SIDES[0]]
            rows.append([name] + [f"{medians[name][side]:.0f}" + ("" if side == SIDES[0] else
                                                                  f" ({medians[name][side] / alone:.2f}×)")
                                  for side in SIDES])
        follow_ups: dict[str, list[float]] = {side: [] for side in SIDES}
        for i in range(count):
            first, second = (rng.sample(store.chunk_ids, PER_REQUEST) for _ in range(2))
            for side in rng.sample(SIDES, len(SIDES)):
                follow_ups[side].append(follow_up_ms(*sides[side], first, second, store.query, i))
        follow = {side: statistics.median(t) for side, t in follow_ups.items()}
        rows.append(["follow-up turn"] + [f"{follow[side]:.0f}" + ("" if side == SIDES[0] else
                                                                  f" ({follow[side] / follow[SIDES[0]]:.2f}×)")
                                          for side in SIDES])
        rates: dict[str, list[float]] = {SIDES[0]: [], SIDES[2]: []}
        for _ in range(DECODE_ROUNDS):  # the same 16 requests to each side, in turns: a burst of load hits both
            batch = [rng.sample(store.chunk_ids, PER_REQUEST) for _ in range(16)]
            for side in rng.sample(list(rates), len(rates)):
                rates[side].append(asyncio.run(decode_rate(*sides[side], batch, store.query)))
        decode = {side: statistics.median(r) for side, r in rates.items()}
    body = (f"Machine: {machine_line()}. {args.model} float32; {CHUNKS} chunks of ~96 tokens, {PER_REQUEST} per "
            f"request; {count} requests per workload, each alone, one new token; the sides in an order shuffled per "
            f"request; medians. TTFT ms (ratio to vLLM alone):\n\n"
            + markdown_table(["workload", *SIDES], rows)
            + "\n\nWhere the reordered requests' time goes (ms, medians of each phase's own timer; prefill on vLLM's "
              "engine is its queue, the claim's load and the prefill):\n\n"
            + markdown_table(["side", *(p.removesuffix("_ms") for p in PHASES)],
                             [[side] + [f"{statistics.median(phases[side][p]):.1f}" for p in PHASES] for side in SIDES])
            + f"\n\nDecode, 16 requests at once, 32 new tokens, medians of {DECODE_ROUNDS} rounds (the same "
              f"requests to each side in turn): vLLM alone {decode[SIDES[0]]:.0f} tokens/s, qvpic on "
              f"vLLM {decode[SIDES[2]]:.0f} tokens/s ({decode[SIDES[2]] / decode[SIDES[0]]:.2f}×).\n\n" + READING)
    print(body)
    if not args.no_write:
        print(write_section("engines", "The two engines side by side: vLLM alone, qvpic's engine, qvpic on vLLM",
                            ".venv-vllm/bin/python -m benchmarks.peer.engines", body))


if __name__ == "__main__":
    main()
