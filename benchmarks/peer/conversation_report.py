"""The tables of `python -m benchmarks.peer.conversation` (issue 35): (a) and (b) side by side, the control with each
engine alone, and (c)'s TTFT and throughput. Numbers in, Markdown out: no servers here."""

from __future__ import annotations

import statistics

import torch

from benchmarks.perf.batching import percentile
from benchmarks.tools.machine import cpu_flags
from pipeline.eval import markdown_table

TURNS, CHUNKS_PER_TURN, REPEATS = 4, 8, 5
INTERLEAVED, IN_FLIGHT, DECODE_TOKENS = 16, 4, 32  # (c)
TARGET_THROUGHPUT = 1.0  # (c): qvpic's decode tokens/s over vLLM's
PHASES = ("route", "load", "queue", "reanchor", "prefill")  # qvpic's report (`qvpic.timings`), per request
TARGET_IDENTICAL, TARGET_FOLLOW_UP = 1.0, 0.3  # qvpic / vLLM TTFT: (a), and turns 2-4 of (b)


def follow_up_verdict(ratios: list[float]) -> str:
    """(b)'s target judged on turns 2-`TURNS` (the first turn has no earlier turn to reuse): its verdict line's end."""
    worst = max(ratios[1:])
    met = "met" if worst <= TARGET_FOLLOW_UP else "missed"
    return f"turns 2–{TURNS} ≤ {TARGET_FOLLOW_UP}× vLLM's — **{met}** (worst turn {worst:.2f}×)."


def phases_cell(ttft_ms: float, phase_ms: list[float]) -> str:
    """The "qvpic ms" column: each of `PHASES`' medians, then the rest of the TTFT median outside them."""
    return " / ".join(f"{x:.0f}" for x in phase_ms) + f" / {ttft_ms - sum(phase_ms):.0f}"


def alone_report(measured: list[dict]) -> str:
    """The control's table: both engines alone, per turn (the warm-up conversation left out), and (b)'s verdict."""
    timed = [m for m in measured if m["conversation"]]
    table, ratios = [], []
    for t in range(TURNS):
        cells = [m for m in timed if m["turn"] == t]
        q, v = statistics.median(m["ms"] for m in cells), statistics.median(m["vllm_ms"] for m in cells)
        phases = [statistics.median(m[p] for m in cells) for p in PHASES]
        ratios.append(q / v)
        table.append([f"turn {t + 1}", f"{q:.0f} / {max(m['ms'] for m in cells):.0f}",
                      f"{v:.0f} / {max(m['vllm_ms'] for m in cells):.0f}", f"{q / v:.2f}×", phases_cell(q, phases)])
    header = ["turn", "qvpic TTFT p50 / max ms", "vLLM TTFT p50 / max ms", "qvpic / vLLM",
              "qvpic ms: " + " / ".join(PHASES) + " / the rest"]
    return (f"The control, (b) with each engine alone on the machine: {len(timed) // TURNS} other conversations of "
            f"the same kind (questions of their own, after a warm-up one) sent to qvpic before vLLM's server was "
            f"started, so no second engine's process was resident; then, once qvpic's server had stopped, the same "
            f"turns to a fresh vLLM server with the pages qvpic placed in each:\n\n{markdown_table(header, table)}"
            f"\n\n(b) alone: {follow_up_verdict(ratios)}")


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
        (q50, q99), (v50, v99) = ((percentile(x, 0.5), percentile(x, 0.99)) for x in (q, v))
        table.append([f"(c) turn {t + 1}", f"{q50:.0f} / {q99:.0f}", f"{v50:.0f} / {v99:.0f}", f"{q50 / v50:.2f}×",
                      f"{statistics.median(m['cached'] for m in cells['qvpic']):.0f} of "
                      f"{statistics.median(m['prompt'] for m in cells['qvpic']):.0f}",
                      f"{statistics.median(m['cached'] for m in cells['vllm']):.0f} of "
                      f"{statistics.median(m['prompt'] for m in cells['vllm']):.0f}"])
    tokens = {name: sum(m["tokens"] for c in run[name] for m in c) for name in ("qvpic", "vllm")}
    rates = {name: tokens[name] / run["wall_s"][name] for name in tokens}
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
            f"{_median(cells, 'chunks'):.0f}", phases_cell(q, [_median(cells, "qvpic_" + p) for p in PHASES])], q / v


def report(spec, quick, conversations, rows, identical, build_s, wall_s) -> str:
    first, identical_ratio = row("(a) first turn again", identical)
    table, ratios = [first], []
    for t in range(TURNS):
        line, ratio = row(f"(b) turn {t + 1}", [m for _, turn, m in rows if turn == t])
        table.append(line)
        ratios.append(ratio)
    met_a = "met" if identical_ratio <= TARGET_IDENTICAL else "missed"
    verdict = (f"Targets: (a) ≤ {TARGET_IDENTICAL}× vLLM's TTFT — **{met_a}** ({identical_ratio:.2f}×); (b) "
               f"{follow_up_verdict(ratios)}")
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
