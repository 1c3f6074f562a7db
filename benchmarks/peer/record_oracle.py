"""Record vLLM's answers for tests/pipeline/eval/test_vllm_oracle.py (issue 38): the oracle CI compares qvpic against.

    python -m benchmarks.peer.record_oracle            # needs the peer venv (`make peer-vllm`); ~1 min
    python -m benchmarks.peer.record_oracle --check    # only say whether the recording's stamp is current

It runs pipeline/eval/oracle.py's requests on the `oracle-qwen` checkpoint through vLLM (benchmarks/peer/vllm_side.py
`oracle_top`: the checkpoint's chat template, images as base64 PNG, greedy, the top log-probabilities of every
step) and writes tests/data/vllm_oracle.json, stamped with vLLM's version, the weights' and template's hashes and
the pages' pixels. Refresh it when the test says the stamp changed (a new factory, template, renderer or font),
then read the agreement it prints against the bounds in tests/pipeline/eval/test_vllm_oracle.py before committing it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.peer import engine
from jobs.help import HelpFormatter
from pipeline.eval import markdown_table, oracle, write_section
from pipeline.runtime import VLM
from schemas.modes import Mode

RECORDING = Path(__file__).resolve().parents[2] / "tests" / "data" / "vllm_oracle.json"


def record() -> dict:
    reqs, pages = oracle.requests(), oracle.pages()
    with tempfile.TemporaryDirectory(prefix="qvpic-oracle-") as folder:
        paths = oracle.save_pages(pages, Path(folder))
        images = max(sum(len(pages[c]) for c in r.chunks) for r in reqs)
        job = engine.job(oracle.spec(), images, [{"kind": "oracle_top", "max_tokens": oracle.NEW_TOKENS,
                                                  "top": oracle.TOP,
                                                  "requests": [oracle.parts(r, paths) for r in reqs]}])
        (out,) = engine.run_job(job)
    return {"stamp": {"vllm": out["vllm"], **oracle.stamp(pages)},
            "requests": [{"mode": r.mode.value, "chunks": list(r.chunks), "query": r.query} for r in reqs],
            "results": out["results"]}


def summary(recording: dict) -> str:
    """What the test checks, as a table: agreement and margin gaps per path and control, per mode."""
    reqs, pages = oracle.requests(), oracle.pages()
    vlm = VLM(oracle.spec())
    theirs = recording["results"]
    with oracle.transposed_grids(vlm):
        moved = oracle.run_full(vlm, reqs, pages)
    runs = (("full prefill", oracle.run_full(vlm, reqs, pages), {1, 2, 3}),
            ("linked, one chunk", oracle.run_linked(vlm, reqs, pages), {1}),
            ("linked, 2–3 chunks", oracle.run_linked(vlm, reqs, pages), {2, 3}),
            ("control: full, chunks reversed", oracle.run_full(vlm, [r.reversed() for r in reqs], pages), {2, 3}),
            ("control: full, grid transposed", moved, {1, 2, 3}))
    rows = []
    for name, ours, sizes in runs:
        for mode in (Mode.FULL_TEXT, Mode.FULL_IMAGE):
            idx = [i for i, r in enumerate(reqs) if r.mode is mode and len(r.chunks) in sizes]
            if "transposed" in name and mode is Mode.FULL_TEXT:
                continue  # no image: nothing to transpose
            gaps = oracle.margin_gaps(ours, theirs, idx)
            first = sum(ours[i]["output_ids"][:1] == theirs[i]["output_ids"][:1] for i in idx)
            same = sum(ours[i]["output_ids"] == theirs[i]["output_ids"][:oracle.NEW_TOKENS] for i in idx)
            rows.append([name, mode.value, len(idx), f"{first}/{len(idx)}", f"{same}/{len(idx)}",
                         f"{statistics.median(gaps):.2g} / {gaps[-1]:.2g}"])
    stamp = recording["stamp"]
    return (f"`{oracle.MODEL}` (pipeline/runtime/tiny.py; weights sha256 `{stamp['weights_sha256'][:12]}…`) float32, "
            f"vLLM {stamp['vllm']} (CPU build, peer venv) vs qvpic, greedy, {oracle.NEW_TOKENS} new tokens; "
            f"{oracle.REQUESTS_PER_MODE} requests per mode of 1–3 chunks (pages at the lowest tier). vLLM's side is "
            f"recorded in tests/data/vllm_oracle.json; tests/pipeline/eval/test_vllm_oracle.py recomputes qvpic's on "
            f"every CI run "
            f"and holds it to the bounds it states. Margin gap = |qvpic's first-step top-1 − top-2 log-probability "
            f"− vLLM's|.\n\n" + markdown_table(["path", "mode", "requests", "same first token",
                                                  f"same {oracle.NEW_TOKENS} tokens", "margin gap median / max"],
                                                 rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peer.record_oracle", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--check", action="store_true", help="compare the stamp only; record nothing")
    p.add_argument("--no-write", action="store_true", help="do not update docs/BENCHMARKS.md")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.check:
        current = json.loads(RECORDING.read_text())["stamp"]
        fresh = oracle.stamp(oracle.pages())
        stale = {k: (current.get(k), v) for k, v in fresh.items() if current.get(k) != v}
        print("the recording is current" if not stale else f"stale: {stale}")
        return 1 if stale else 0
    recording = record()
    RECORDING.parent.mkdir(parents=True, exist_ok=True)
    RECORDING.write_text(json.dumps(recording, indent=1) + "\n")
    body = summary(recording)
    print(f"wrote {RECORDING} (vLLM {recording['stamp']['vllm']})\n{body}", flush=True)
    if not args.no_write:
        write_section("vllm-oracle-ci", "vLLM's recorded oracle in CI (issue 38)",
                      "python -m benchmarks.peer.record_oracle", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
