"""`qvpic bench`: every benchmark registered, suite listing and dispatch, and the TTFT benchmark's CPU path through
benchmarks/perf/gpu.sh."""

from __future__ import annotations

import ast
import importlib.machinery
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from PIL import Image

from jobs import bench
from tests.support.paths import REPO


@pytest.fixture
def fake_suites(monkeypatch):
    """Two fake suite modules: one taking options, one taking none; records what each was called with."""
    calls: list[tuple[str, list[str] | None]] = []
    with_options = types.ModuleType("fake_with_options")
    with_options.__spec__ = importlib.machinery.ModuleSpec("fake_with_options", None)
    with_options.main = lambda argv=None: calls.append(("with", argv)) or 0
    without_options = types.ModuleType("fake_without_options")
    without_options.__spec__ = importlib.machinery.ModuleSpec("fake_without_options", None)
    without_options.main = lambda: calls.append(("without", None)) or 3
    monkeypatch.setitem(sys.modules, "fake_with_options", with_options)
    monkeypatch.setitem(sys.modules, "fake_without_options", without_options)
    suites = (bench.Suite("with", "perf", "fake_with_options", "takes options", ("--quick",)),
              bench.Suite("without", "quality", "fake_without_options", "takes none", ()),
              bench.Suite("slow", "perf", "fake_with_options", "not in all", None),
              bench.Suite("absent", "scale", "benchmarks.scale.no_such_suite", "missing here", ()))
    monkeypatch.setattr(bench, "SUITES", suites)
    monkeypatch.setattr(bench, "BY_NAME", {s.name: s for s in suites})
    return calls


# Run by the peer venv's Python as scripts (benchmarks/peer/engine.py, setup_vllm.sh), never as suites here.
PEER_VENV_SCRIPTS = {"benchmarks.peer.vllm_side", "benchmarks.peer.check_vllm"}
# The device check: `python -m benchmarks.gpu_check` on a lent GPU box (no Ray, so not through `qvpic bench`), each of
# its steps a process of its own; tests/benchmarks/test_gpu_check.py runs it (--dry).
DEVICE_SCRIPTS = {"benchmarks.gpu_check.__main__", "benchmarks.gpu_check.step"}


def entry_point_modules(root: Path = REPO) -> set[str]:
    """Every module under benchmarks/ with a top-level `main` or an `if __name__ == "__main__":` block, read from
    the files (ast), nothing imported."""
    found = set()
    for path in sorted((root / "benchmarks").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any((isinstance(node, ast.FunctionDef) and node.name == "main")
               or (isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)) for node in tree.body):
            found.add(".".join(path.relative_to(root).with_suffix("").parts))
    return found


def unregistered(suites) -> set[str]:
    return entry_point_modules() - PEER_VENV_SCRIPTS - DEVICE_SCRIPTS - {s.module for s in suites}


def test_every_benchmark_with_an_entry_point_is_a_suite():
    assert all((REPO / (m.replace(".", "/") + ".py")).exists() for m in PEER_VENV_SCRIPTS)
    assert len(entry_point_modules()) > 30  # the walk reads the tree (else the check below proves nothing)
    assert unregistered(bench.SUITES) == set()
    assert len(bench.BY_NAME) == len(bench.SUITES)  # names are unique
    for suite in bench.SUITES:
        assert suite.available, suite
        assert suite.module.startswith(f"benchmarks.{suite.group}.") and suite.group in bench.GROUPS


def test_a_benchmark_left_out_of_the_table_is_caught():
    """Negative control: drop any one suite, or add a module with an entry point, and the check names it."""
    for left_out in bench.SUITES:
        assert unregistered([s for s in bench.SUITES if s is not left_out]) == {left_out.module}


def test_listing_names_every_real_suite_by_group(capsys):
    assert bench.main(["--list"]) == 0
    out = capsys.readouterr().out
    for suite in bench.SUITES:
        assert f"  {suite.name} " in out
    headers = [line.split(":")[0] for line in out.splitlines() if line.split(":")[0] in bench.GROUPS]
    assert headers == list(bench.GROUPS)  # every group once, in order
    groups = {}
    for line in out.splitlines():
        if line.split(":")[0] in bench.GROUPS:
            group = line.split(":")[0]
        elif line.startswith("  ") and line.split()[0] in bench.BY_NAME:
            groups[line.split()[0]] = group
    assert groups == {s.name: s.group for s in bench.SUITES}
    for suite in bench.SUITES:  # whether `all` runs it, and with what
        line = next(line for line in out.splitlines() if line.startswith(f"  {suite.name} "))
        assert ("[all" in line or "; all" in line) == (suite.quick_argv is not None), line
    assert bench.main(["--help"]) == 0 and capsys.readouterr().out == out


def test_dispatch_passes_options_and_rejects_bad_calls(fake_suites, capsys):
    assert bench.main(["with", "--repeats", "2"]) == 0
    assert fake_suites == [("with", ["--repeats", "2"])]
    assert bench.main(["without"]) == 3
    for argv, message in ((["without", "--x"], "takes no options"), (["nope"], "unknown suite 'nope'"),
                          (["absent"], "not in this checkout"), (["all", "--x"], "takes no options")):
        assert bench.main(argv) == 2
        assert message in capsys.readouterr().err


def test_all_runs_the_quick_suites_that_exist(fake_suites):
    assert bench.main(["all"]) == 3  # the worst exit code of the suites run
    assert fake_suites == [("with", ["--quick"]), ("without", None)]


def test_no_suite_runs_all(fake_suites):
    assert bench.main([]) == 3
    assert fake_suites == [("with", ["--quick"]), ("without", None)]


def test_gpu_script_cpu_fallback_runs_the_gpu_benchmark(tmp_path):
    """No CUDA here (and hidden if there is one): the script runs the same benchmark on the tiny models."""
    out = tmp_path / "gpu.md"
    # PY: this interpreter, whose environment has the requirements; a bare `python3` may be another Python,
    # which the script would install the whole project into
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PY": sys.executable}
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "perf" / "gpu.sh"), str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no CUDA device" in done.stderr
    text = out.read_text()
    for model in ("tiny-qwen", "tiny-glm"):
        section = text.split(f"### {model} ")[1].split("### ")[0]
        ttft = {row.split("|")[1].strip(): float(row.split("|")[2]) for row in section.splitlines()
                if row.startswith("| ") and row.split("|")[1].strip() in {"qvpic", "full_image", "text_pic"}}
        assert set(ttft) == {"qvpic", "full_image", "text_pic"} and all(v > 0 for v in ttft.values())
        clients = [row.split("|")[1].strip() for row in section.split("Tokens/s")[1].splitlines()
                   if row.startswith("| ") and row.split("|")[1].strip().isdigit()]
        assert clients == ["1", "4"]
        assert "Device hot tier: TTFT" in section
    compile_rows = [line.split("|")[1].strip() for line in (tmp_path / "compile_batch_gpu.md").read_text().splitlines()
                    if line.startswith("|")]
    assert [cell for cell in compile_rows if cell.isdigit()] == ["1", "4"]  # chunks/s by compile batch size
    limits = (tmp_path / "limits_gpu.md").read_text()  # the limits and the forwards against them, same path
    assert "### tiny-qwen" in limits and "GB/s" in limits
    forwards = [row for row in limits.splitlines() if row.startswith(("| one token", "| decode step", "| 56-token"))]
    # five paths, each against its bound: transformers, fused fp32 with torch ops, fused fp32 with its attention as
    # products, fused fp32 (native ops), fused bf16; and the model loaded in bf16 where this CPU runs bf16 natively
    import torch

    paths = 6 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else 5
    assert len(forwards) == 3 and all(row.count("×)") == paths for row in forwards)


def test_real_size_checkpoints_keep_the_public_shapes_and_build_on_the_device(tmp_path):
    """The GPU benchmark's weightless checkpoints, shrunk to toy widths so a CPU can build them: the public
    architecture's fields survive, and the model is built once, with random weights, where it runs."""
    from transformers import AutoConfig

    from benchmarks.tools.real_size import GLM_4_1V_9B, QWEN2_5_VL_7B, materialise, random_weights
    from pipeline.runtime import VLM
    from schemas.config import ModelSpec

    full = AutoConfig.from_pretrained(materialise("glm-4.1v-9b", tmp_path))
    assert (full.text_config.hidden_size, full.text_config.num_hidden_layers, full.vision_config.depth) == (
        GLM_4_1V_9B["text_config"]["hidden_size"], 40, 24)
    assert full.text_config.rope_parameters["partial_rotary_factor"] == 0.5
    full = AutoConfig.from_pretrained(materialise("qwen2.5-vl-7b", tmp_path))
    assert (full.text_config.hidden_size, full.text_config.vocab_size, full.vision_config.fullatt_block_indexes) == (
        QWEN2_5_VL_7B["hidden_size"], 152064, [7, 15, 23, 31])
    toy = {"text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=4200,
                        rope_scaling={"type": "default", "rope_type": "default", "mrope_section": [2, 3, 3]}),
           "vision": dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                          fullatt_block_indexes=[1])}
    path = materialise("qwen2.5-vl-7b", tmp_path, shrink=toy)
    assert not list(path.glob("*.safetensors"))  # no weights on disk
    with random_weights("cpu"):
        first, second = (VLM(ModelSpec(path=str(path), device="cpu")) for _ in range(2))
    assert first.model is second.model and next(first.model.parameters()).device.type == "cpu"
    page = Image.new("RGB", (120, 60), "white")
    assert first.prefill_query(first.assemble([first.compile_images([page])]), "hi").logits.isfinite().all()


def test_scale_serve_runs_end_to_end_on_a_small_store(tmp_path):
    """The serving-scale benchmark writes a store through the Store API, publishes it and measures a router
    on it: a store-schema change that breaks its synthetic rows fails here, not an hour into a 1M run."""
    from benchmarks.scale.scale_serve import SEARCH_THREADS, run_size, section

    result = run_size(1_000, "random", tmp_path)
    assert result["num_chunks"] == 1_000 and result["search"]["kind"] == "flat"
    assert result["recall_at_8"] == 1.0  # exhaustive scan + float16 rerank is exact
    assert set(result["route_ms"]) == {f"p{q}_t{t}" for t in SEARCH_THREADS for q in (50, 99)}
    assert "| 1,000 | random | flat |" in section([result])
