"""Conversations side by side with vLLM (issue 35): the same 4-turn conversations over the same pages, through
both engines' OpenAI servers, prefix caching on in both. Needs the peer venv (`make peer-vllm`); not in CI.

    python -m benchmarks.peer.conversation            # 4 conversations of 4 turns, 8 chunks retrieved per turn
    python -m benchmarks.peer.conversation --quick    # 2 conversations

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
resident second engine's process, even stopped, slowed qvpic's later turns on a small VM), sent to vLLM alone too
once qvpic's server has stopped (a fresh server, a warm-up conversation first, the pages qvpic placed); and (c)
again with each engine alone on the machine — qvpic's phase before vLLM's server first starts, vLLM's on that
fresh server, over the pages qvpic placed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from benchmarks.peer import servers
from benchmarks.peer.conversation_report import (
    ALONE,
    CHUNKS_PER_TURN,
    DECODE_TOKENS,
    IN_FLIGHT,
    INTERLEAVED,
    PAIRED,
    PHASES,
    REPEATS,
    TURNS,
    alone_report,
    interleaved_report,
    report,
)
from benchmarks.peer.speed import build_corpus
from benchmarks.peer.vllm_side import messages as vllm_user_message
from jobs.help import HelpFormatter
from pipeline.eval import write_section
from pipeline.runtime import resolve_path
from schemas.config import DType, ModelSpec

ANSWER = "Noted."  # every earlier answer, for both engines: the history is the same text


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


def qvpic_alone(url: str, plans: list[list[str]]) -> list[dict]:
    """(b)'s kind of turns with qvpic alone on the machine, before vLLM's server starts: one record per request
    (its conversation, turn, HTTP ms, phases and the chunks placed), the first conversation a warm-up. On a small VM
    a second engine's resident process, even stopped, slowed qvpic's later turns 2-10x (docs/benchmarks/notes.md):
    this is the control for that, and `vllm_alone` sends vLLM the same turns when qvpic's server is gone."""
    out = []
    with httpx.Client(timeout=900) as client:
        for c, turns in enumerate(plans):
            for t in range(TURNS):
                ms, reply = ask_qvpic(client, url, turns[:t + 1])
                timings = reply["qvpic"]["timings"]
                out.append({"conversation": c, "turn": t, "ms": ms, "chunks": reply["qvpic"]["chunks"],
                            **{p: timings[f"{p}_ms"] or 0.0 for p in PHASES}})
    return out


def vllm_alone(pair: Pair, plans: list[list[str]], ours: list[dict]) -> list[dict]:
    """The control's turns (`qvpic_alone`'s records) on vLLM alone on the machine, each with the pages qvpic placed
    in it, one request at a time, the warm-up conversation first as for qvpic: `ours` with vLLM's HTTP ms added."""
    out = []
    for m in ours:
        ms, _ = pair.ask_vllm(plans[m["conversation"]][:m["turn"] + 1], m["chunks"])
        out.append({**m, "vllm_ms": ms})
    return out


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
    control_plans = plans(conversations + 1, conversations + 1)  # (b) with each engine alone, a warm-up first
    with servers.qvpic_server(spec, corpus.store_uri) as ours:
        alone = qvpic_alone(ours, control_plans)
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
        alone = vllm_alone(Pair(spec, corpus, None, vllm), control_plans, alone)
        theirs_alone, theirs_alone_s = vllm_phase(Pair(spec, corpus, None, vllm), alone_plans, ours_alone)
    alone_run = {"qvpic": ours_alone, "vllm": theirs_alone,
                 "wall_s": {"qvpic": ours_alone_s, "vllm": theirs_alone_s}}
    return (report(spec, quick, conversations, rows, identical, build_s, time.perf_counter() - started)
            + "\n\n" + alone_report(alone) + "\n\n" + interleaved_report(mixed_run, PAIRED)
            + "\n\n" + interleaved_report(alone_run, ALONE))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.peer.conversation", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 conversations instead of 4, and 4 instead of 16 in (c)")
    p.add_argument("--model", default="bench-qwen")
    p.add_argument("--dtype", type=DType, default=DType.FLOAT32, choices=list(DType),
                   help="both engines' dtype (bfloat16 only where the CPU has native bf16: AMX or avx512_bf16)")
    p.add_argument("--no-write", action="store_true", help="do not update docs/BENCHMARKS.md")
    args = p.parse_args(argv)
    command = ("python -m benchmarks.peer.conversation " + " ".join(argv)).strip()
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
