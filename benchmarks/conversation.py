"""Conversations side by side with vLLM (issue 35): the same 4-turn conversations over the same pages, through
both engines' OpenAI servers, prefix caching on in both. Needs the peer venv (`make peer-vllm`); not in CI.

    python -m benchmarks.conversation            # 4 conversations of 4 turns, 8 chunks retrieved per turn
    python -m benchmarks.conversation --quick    # 2 conversations

Each turn's question is built from one chunk's words, so retrieval finds new chunks for it. qvpic gets the
conversation as a chat request (`qvpic.top_k` 8, every chunk at the lowest tier, `history_chunks`: each earlier
question keeps its chunks) and reports which chunks it placed before which user message (`chunks[].group`);
vLLM gets exactly those pages as images at the start of the same user messages, and the same history (each
earlier answer a fixed "Noted.", so both engines see identical text). One new token per request (TTFT over
HTTP); qvpic with `Cache-Control: no-cache` and no response cache, vLLM's server stopped (SIGSTOP) while qvpic
is timed. Workloads: (a) the first turn sent again `REPEATS` times; (b) turns 1–4 of each conversation; (c)
`INTERLEAVED` further conversations, `IN_FLIGHT` at a time (each its turns in order), streamed with
`DECODE_TOKENS` new tokens per turn: TTFT (first content chunk) p50/p99 per turn and decode throughput (completion
tokens over the phase's wall time), qvpic's phase first with vLLM paused, then vLLM's over the same pages.
Before vLLM's server starts, a control: as many other conversations of the same kind through qvpic alone (a
resident second engine's process, even stopped, slowed qvpic's later turns on a small VM); and (c) again with
each engine alone on the machine — qvpic's phase before vLLM's server first starts, vLLM's on a fresh server
after qvpic's has stopped, over the pages qvpic placed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from benchmarks.machine import cpu_flags
from benchmarks.peer import servers
from benchmarks.peer.speed import build_corpus
from benchmarks.peer.vllm_side import messages as vllm_user_message
from jobs.help import HelpFormatter
from pipeline.eval import markdown_table, write_section
from pipeline.runtime import resolve_path
from schemas.config import DType, ModelSpec

TURNS, CHUNKS_PER_TURN, REPEATS = 4, 8, 5
INTERLEAVED, IN_FLIGHT, DECODE_TOKENS = 16, 4, 32  # (c)
TARGET_THROUGHPUT = 1.0  # (c): qvpic's decode tokens/s over vLLM's
PHASES = ("route", "load", "queue", "reanchor", "prefill")  # qvpic's report (`qvpic.timings`), per request
ANSWER = "Noted."  # every earlier answer, for both engines: the history is the same text
TARGET_IDENTICAL, TARGET_FOLLOW_UP = 1.0, 0.3  # qvpic / vLLM TTFT: (a), and turns 2-4 of (b)


def question(corpus, index: int) -> str:
    words = corpus.texts[index].split()
    return "What does the passage say about " + " ".join(words[3:13]) + "?"


def ask_qvpic(client: httpx.Client, url: str, turns: list[str]) -> tuple[float, dict]:
    """One one-token chat request to qvpic (no response cache): its HTTP time (ms) and its reply."""
    started = time.perf_counter()
    reply = client.post(url + "/v1/chat/completions", json=Pair.qvpic_body(turns),
                        headers={"Cache-Control": "no-cache"})
    ms = (time.perf_counter() - started) * 1e3
    reply.raise_for_status()
    return ms, reply.json()


def streamed(client: httpx.Client, url: str, body: dict, headers: dict | None = None) -> dict:
    """One streamed chat request: time to its first content chunk and to its end, its usage and its last report."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    started, first, usage, report = time.perf_counter(), None, None, None
    with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers or {}) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                first = time.perf_counter()
            usage = event.get("usage") or usage
            report = event.get("qvpic") or report
    ended = time.perf_counter()
    return {"ttft_ms": ((first or ended) - started) * 1e3, "total_ms": (ended - started) * 1e3,
            "tokens": usage["completion_tokens"], "prompt": usage["prompt_tokens"],
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0, "report": report}


class Pair:
    """Both servers and one HTTP client; qvpic's conversations as sent, vLLM's built from qvpic's placement."""

    def __init__(self, spec: ModelSpec, corpus, ours: str, vllm):
        self.spec, self.corpus, self.ours, self.vllm = spec, corpus, ours, vllm
        self.client = httpx.Client(timeout=900)
        self.index = {chunk_id: i for i, chunk_id in enumerate(corpus.chunk_ids)}

    @staticmethod
    def qvpic_body(turns: list[str], max_tokens: int = 1) -> dict:
        history = []
        for q in turns[:-1]:
            history += [{"role": "user", "content": q}, {"role": "assistant", "content": ANSWER}]
        return {"model": "qvpic", "messages": history + [{"role": "user", "content": turns[-1]}],
                "max_tokens": max_tokens, "temperature": 0.0,
                "qvpic": {"top_k": CHUNKS_PER_TURN, "max_high_res": 0, "mode": "qvpic"}}

    def vllm_body(self, turns: list[str], placed: list[dict], max_tokens: int = 1) -> dict:
        chat = []
        for group, q in enumerate(turns):
            pages = [{"image": page} for c in placed if c["group"] == group
                     for page in self.corpus.pages[self.index[c["chunk_id"]]]]
            chat += vllm_user_message(pages + [{"text": q}])
            if group < len(turns) - 1:
                chat.append({"role": "assistant", "content": ANSWER})
        return {"model": str(resolve_path(self.spec)), "messages": chat, "max_tokens": max_tokens, "temperature": 0.0}

    def streamed(self, url: str, body: dict, headers: dict | None = None) -> dict:
        return streamed(self.client, url, body, headers)

    def ask_qvpic(self, turns: list[str]) -> tuple[float, dict]:
        with self.vllm.paused():
            return ask_qvpic(self.client, self.ours, turns)

    def ask_vllm(self, turns: list[str], placed: list[dict]) -> tuple[float, dict]:
        body = self.vllm_body(turns, placed)
        started = time.perf_counter()
        reply = self.client.post(self.vllm.url + "/v1/chat/completions", json=body)
        ms = (time.perf_counter() - started) * 1e3
        reply.raise_for_status()
        return ms, reply.json()

    def turn(self, turns: list[str]) -> dict:
        ours_ms, ours = self.ask_qvpic(turns)
        theirs_ms, theirs = self.ask_vllm(turns, ours["qvpic"]["chunks"])
        details = theirs["usage"].get("prompt_tokens_details") or {}
        timings = ours["qvpic"]["timings"]
        phases = {f"qvpic_{phase}": timings[f"{phase}_ms"] or 0.0 for phase in PHASES}
        return {"qvpic_ms": ours_ms, **phases, "vllm_ms": theirs_ms, "qvpic_prompt": ours["usage"]["prompt_tokens"],
                "qvpic_cached": ours["usage"]["prompt_tokens_details"]["cached_tokens"],
                "qvpic_prefix": ours["qvpic"]["usage"]["prefix_cached_tokens"],
                "vllm_prompt": theirs["usage"]["prompt_tokens"], "vllm_cached": details.get("cached_tokens"),
                "chunks": len(ours["qvpic"]["chunks"])}


def qvpic_phase(pair: Pair, plans: list[list[str]]) -> tuple[list[list[dict]], float]:
    """(c) on qvpic: the conversations of `plans`, `IN_FLIGHT` at a time, each its turns in order; per conversation,
    per turn, the streamed measurements, and the phase's wall seconds."""
    def conversation(turns: list[str]) -> list[dict]:
        return [pair.streamed(pair.ours, pair.qvpic_body(turns[:t + 1], DECODE_TOKENS),
                              {"Cache-Control": "no-cache"}) for t in range(len(turns))]

    started = time.perf_counter()
    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        return list(pool.map(conversation, plans)), time.perf_counter() - started


def vllm_phase(pair: Pair, plans: list[list[str]], ours: list[list[dict]]) -> tuple[list[list[dict]], float]:
    """(c) on vLLM, each turn with the pages qvpic placed in that turn (`ours`: `qvpic_phase`'s measurements)."""
    def conversation(args) -> list[dict]:
        turns, measured = args
        return [pair.streamed(pair.vllm.url, pair.vllm_body(turns[:t + 1], m["report"]["chunks"], DECODE_TOKENS))
                for t, m in enumerate(measured)]

    started = time.perf_counter()
    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        return list(pool.map(conversation, zip(plans, ours))), time.perf_counter() - started


def interleaved(pair: Pair, plans: list[list[str]]) -> dict:
    """(c) with both servers up: qvpic's phase (vLLM paused), then vLLM's over the pages qvpic placed."""
    with pair.vllm.paused():
        ours, ours_s = qvpic_phase(pair, plans)
    theirs, theirs_s = vllm_phase(pair, plans, ours)
    return {"qvpic": ours, "vllm": theirs, "wall_s": {"qvpic": ours_s, "vllm": theirs_s}}


def qvpic_alone(url: str, plans: list[list[str]]) -> list[tuple[int, dict]]:
    """(b)'s kind of turns with qvpic alone on the machine, before vLLM's server starts: (turn, measurements) per
    request, the first conversation a warm-up (not returned). On a small VM a second engine's resident process,
    even stopped, slowed qvpic's later turns 2-10x (docs/BENCHMARKS.md): this is the control for that."""
    out = []
    with httpx.Client(timeout=900) as client:
        for c, turns in enumerate(plans):
            for t in range(TURNS):
                ms, reply = ask_qvpic(client, url, turns[:t + 1])
                timings = reply["qvpic"]["timings"]
                if c:
                    out.append((t, {"ms": ms, **{p: timings[f"{p}_ms"] or 0.0 for p in PHASES}}))
    return out


def alone_report(measured: list[tuple[int, dict]]) -> str:
    table = []
    for t in range(TURNS):
        cells = [m for turn, m in measured if turn == t]
        q = statistics.median(m["ms"] for m in cells)
        phases = [statistics.median(m[p] for m in cells) for p in PHASES]
        table.append([f"turn {t + 1}", f"{q:.0f} / {max(m['ms'] for m in cells):.0f}",
                      " / ".join(f"{v:.0f}" for v in phases) + f" / {q - sum(phases):.0f}"])
    header = ["turn", "qvpic TTFT p50 / max ms", "qvpic ms: " + " / ".join(PHASES) + " / the rest"]
    return (f"The control: {len(measured) // TURNS} other conversations of the same kind (questions of their own) "
            f"sent to qvpic before vLLM's server was started, so no second engine's process was resident:\n\n"
            f"{markdown_table(header, table)}")


def run(spec: ModelSpec, quick: bool, workdir: Path) -> str:
    conversations = 2 if quick else 4
    mixed = IN_FLIGHT if quick else INTERLEAVED  # (c)'s conversations
    # room for each question's chunk and its neighbours: the paired conversations and their warm-up, the control's
    # (the same count and a warm-up), then (c)'s, paired and alone
    pool = (2 * (conversations + 1) + 2 * mixed) * TURNS * 2
    started = time.perf_counter()
    corpus = build_corpus(spec, workdir, pool)
    build_s = time.perf_counter() - started
    max_images = TURNS * CHUNKS_PER_TURN * max(len(p) for p in corpus.pages)

    def plans(first: int, count: int) -> list[list[str]]:
        return [[question(corpus, ((first + c) * TURNS + t) * 2 % len(corpus.texts)) for t in range(TURNS)]
                for c in range(count)]

    rows = []  # (conversation, turn, measurements)
    identical = []
    alone_plans = plans(2 * (conversations + 1) + mixed, mixed)  # (c) with each engine alone on the machine
    with servers.qvpic_server(spec, corpus.store_uri) as ours:
        alone = qvpic_alone(ours, plans(conversations + 1, conversations + 1))
        ours_alone, ours_alone_s = qvpic_phase(Pair(spec, corpus, ours, None), alone_plans)
        with servers.vllm_server(spec, max_images, workdir / "vllm-server.log",
                                 extra=("--enable-prompt-tokens-details",)) as vllm:
            pair = Pair(spec, corpus, ours, vllm)
            plan = plans(0, conversations + 1)
            for t in range(TURNS):  # warm-up conversation: neither engine's first requests are timed
                pair.turn(plan[-1][:t + 1])
            for c in range(conversations):
                for t in range(TURNS):
                    rows.append((c, t, pair.turn(plan[c][:t + 1])))
            for _ in range(REPEATS):  # (a): the first turn of the first conversation, again
                identical.append(pair.turn(plan[0][:1]))
            mixed_run = interleaved(pair, plans(2 * (conversations + 1), mixed))
    # qvpic's server is gone: vLLM alone, as qvpic was in its alone phase (a fresh server: its prefix cache empty)
    with servers.vllm_server(spec, max_images, workdir / "vllm-server-alone.log",
                             extra=("--enable-prompt-tokens-details",)) as vllm:
        theirs_alone, theirs_alone_s = vllm_phase(Pair(spec, corpus, None, vllm), alone_plans, ours_alone)
    alone_run = {"qvpic": ours_alone, "vllm": theirs_alone,
                 "wall_s": {"qvpic": ours_alone_s, "vllm": theirs_alone_s}}
    return (report(spec, quick, conversations, rows, identical, build_s, time.perf_counter() - started)
            + "\n\n" + alone_report(alone) + "\n\n" + interleaved_report(mixed_run, PAIRED)
            + "\n\n" + interleaved_report(alone_run, ALONE))


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


PAIRED = ("both servers up, qvpic's phase with vLLM's server paused (SIGSTOP), then vLLM's with qvpic's idle; "
          "each turn of vLLM's with the pages qvpic placed in that turn")
ALONE = ("each engine alone on the machine: qvpic's phase before vLLM's server first started (other conversations "
         "than the paired phase's), vLLM's on a fresh server after qvpic's had stopped, with the pages qvpic placed. "
         "A second engine's resident process, even stopped, slowed qvpic's turns (the control above): this is the "
         "same workload with neither engine beside the other")


def interleaved_report(run: dict, how: str) -> str:
    """(c)'s table: TTFT p50/p99 per turn for both engines, cached tokens, then decode throughput."""
    table = []
    for t in range(TURNS):
        cells = {name: [conversation[t] for conversation in run[name]] for name in ("qvpic", "vllm")}
        q, v = ([m["ttft_ms"] for m in cells[name]] for name in ("qvpic", "vllm"))
        table.append([f"(c) turn {t + 1}", f"{_pct(q, 0.5):.0f} / {_pct(q, 0.99):.0f}",
                      f"{_pct(v, 0.5):.0f} / {_pct(v, 0.99):.0f}", f"{_pct(q, 0.5) / _pct(v, 0.5):.2f}×",
                      f"{statistics.median(m['cached'] for m in cells['qvpic']):.0f} of "
                      f"{statistics.median(m['prompt'] for m in cells['qvpic']):.0f}",
                      f"{statistics.median(m['cached'] for m in cells['vllm']):.0f} of "
                      f"{statistics.median(m['prompt'] for m in cells['vllm']):.0f}"])
    rates = {name: sum(m["tokens"] for c in run[name] for m in c) / run["wall_s"][name] for name in ("qvpic", "vllm")}
    tokens = {name: sum(m["tokens"] for c in run[name] for m in c) for name in ("qvpic", "vllm")}
    ratio = rates["qvpic"] / rates["vllm"]
    met = "met" if ratio >= TARGET_THROUGHPUT else "missed"
    header = ["workload", "qvpic TTFT p50 / p99 ms", "vLLM TTFT p50 / p99 ms", "qvpic / vLLM (p50)",
              "qvpic cached tokens (median)", "vLLM cached tokens (median)"]
    return (f"(c) {len(run['qvpic'])} conversations of {TURNS} turns, {IN_FLIGHT} in flight, streamed, up to "
            f"{DECODE_TOKENS} new tokens a turn (greedy); TTFT = the first content chunk; {how}.\n\n"
            f"{markdown_table(header, table)}\n\nThroughput: qvpic {rates['qvpic']:.1f} tokens/s ({tokens['qvpic']} "
            f"tokens in {run['wall_s']['qvpic']:.1f} s), vLLM {rates['vllm']:.1f} tokens/s ({tokens['vllm']} tokens "
            f"in {run['wall_s']['vllm']:.1f} s): {ratio:.2f}×. Target: (c) ≥ {TARGET_THROUGHPUT}× vLLM's tokens/s "
            f"— **{met}**. The phase's wall time includes every turn's prefill, as a user's conversations would.")


def _median(cells: list[dict], key: str) -> float:
    return statistics.median(m[key] or 0 for m in cells)


def row(name: str, cells: list[dict]) -> tuple[list, float]:
    """A table row of medians (and the slowest TTFT) over `cells`; its qvpic / vLLM TTFT ratio."""
    q, v = _median(cells, "qvpic_ms"), _median(cells, "vllm_ms")
    return [name, f"{q:.0f} / {max(m['qvpic_ms'] for m in cells):.0f}",
            f"{v:.0f} / {max(m['vllm_ms'] for m in cells):.0f}", f"{q / v:.2f}×",
            f"{_median(cells, 'qvpic_cached'):.0f} of {_median(cells, 'qvpic_prompt'):.0f} "
            f"({_median(cells, 'qvpic_prefix'):.0f} prefix cache)",
            f"{_median(cells, 'vllm_cached'):.0f} of {_median(cells, 'vllm_prompt'):.0f}",
            f"{_median(cells, 'chunks'):.0f}",
            " / ".join(f"{_median(cells, 'qvpic_' + phase):.0f}" for phase in PHASES)
            + f" / {q - sum(_median(cells, 'qvpic_' + phase) for phase in PHASES):.0f}"], q / v


def report(spec, quick, conversations, rows, identical, build_s, wall_s) -> str:
    first, identical_ratio = row("(a) first turn again", identical)
    table, ratios = [first], []
    for t in range(TURNS):
        line, ratio = row(f"(b) turn {t + 1}", [m for _, turn, m in rows if turn == t])
        table.append(line)
        ratios.append(ratio)
    follow = max(ratios[1:])
    met_a = "met" if identical_ratio <= TARGET_IDENTICAL else "missed"
    met_b = "met" if follow <= TARGET_FOLLOW_UP else "missed"
    verdict = (f"Targets: (a) ≤ {TARGET_IDENTICAL}× vLLM's TTFT — **{met_a}** ({identical_ratio:.2f}×); (b) turns "
               f"2–{TURNS} ≤ {TARGET_FOLLOW_UP}× vLLM's — **{met_b}** (worst turn {follow:.2f}×).")
    header = ["workload", "qvpic TTFT p50 / max ms", "vLLM TTFT p50 / max ms", "qvpic / vLLM",
              "qvpic cached tokens (median)", "vLLM cached tokens (median)", "chunks",
              "qvpic ms: " + " / ".join(PHASES) + " / the rest"]
    return (f"{spec.path} {spec.dtype.value}, {torch.get_num_threads()} threads for each engine; CPU flags: "
            f"{cpu_flags()}. {conversations} conversations of {TURNS} turns (plus one warm-up conversation, not "
            f"timed), {CHUNKS_PER_TURN} chunks retrieved per turn, every chunk at the lowest tier; (a) "
            f"{REPEATS} repeats. Store built in {build_s:.0f} s; the whole run {wall_s:.0f} s. TTFT: the whole "
            f"one-token HTTP response. Cached tokens: `usage.prompt_tokens_details.cached_tokens` (qvpic: linked "
            f"chunk KV from the store plus its prefix cache; vLLM: its prefix cache, "
            f"`--enable-prompt-tokens-details`). qvpic's phases are its report's medians (`qvpic.timings`); the rest "
            f"is the HTTP response's time outside them (ingress, Serve's hops between deployments, serialisation)."
            f"\n\n{markdown_table(header, table)}\n\n{verdict}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.conversation", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 conversations instead of 4, and 4 instead of 16 in (c)")
    p.add_argument("--model", default="bench-qwen")
    p.add_argument("--dtype", type=DType, default=DType.FLOAT32, choices=list(DType),
                   help="both engines' dtype (bfloat16 only where the CPU has native bf16: AMX or avx512_bf16)")
    p.add_argument("--no-write", action="store_true", help="do not update docs/BENCHMARKS.md")
    args = p.parse_args(argv)
    command = ("python -m benchmarks.conversation " + " ".join(argv)).strip()
    spec = ModelSpec(path=args.model, dtype=args.dtype, device="cpu")
    resolve_path(spec)
    with tempfile.TemporaryDirectory(prefix="qvpic-conversation-") as folder:
        body = run(spec, args.quick, Path(folder))
    print(body, flush=True)
    if not args.no_write:
        write_section("conversation", "Conversations side by side with vLLM: TTFT per turn (issue 35)", command, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
