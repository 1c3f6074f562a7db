"""Record vLLM's answers for tests/test_vllm_oracle.py (issue 38): the oracle CI compares qvpic against.

    python -m benchmarks.peer.record_oracle            # needs the peer venv (`make peer-vllm`); ~1 min
    python -m benchmarks.peer.record_oracle --check    # only say whether the recording's stamp is current

It runs pipeline/eval/oracle.py's requests on the `oracle-qwen` checkpoint through vLLM (benchmarks/peer/vllm_side.py
`oracle_top`: the checkpoint's chat template, images as base64 PNG, greedy, the top log-probabilities of every
step) and writes tests/data/vllm_oracle.json, stamped with vLLM's version, the weights' and template's hashes and
the pages' pixels. Refresh it when the test says the stamp changed (a new factory, template, renderer or font),
then read the agreement it prints against the bounds in tests/test_vllm_oracle.py before committing it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from benchmarks.peer import engine
from jobs.help import HelpFormatter
from pipeline.eval import oracle
from pipeline.runtime import VLM

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
    """What the test checks, as numbers: agreement and gaps per path and control."""
    reqs, pages = oracle.requests(), oracle.pages()
    vlm = VLM(oracle.spec())
    theirs = recording["results"]
    lines = []
    for name, ours in (("full", oracle.run_full(vlm, reqs, pages)), ("linked", oracle.run_linked(vlm, reqs, pages)),
                       ("full, chunks reversed", oracle.run_full(vlm, [r.reversed() for r in reqs], pages))):
        for mode in ("full_text", "full_image"):
            idx = [i for i, r in enumerate(reqs) if r.mode.value == mode]
            gaps = oracle.margin_gaps(ours, theirs, idx)
            lines.append(f"{name:24} {mode:10} agreement {oracle.agreement(ours, theirs, idx):.2f}  margin gap median "
                         f"{gaps[len(gaps) // 2]:.2e} max {gaps[-1]:.2e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peer.record_oracle", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--check", action="store_true", help="compare the stamp only; record nothing")
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
    print(f"wrote {RECORDING} (vLLM {recording['stamp']['vllm']})\n{summary(recording)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
