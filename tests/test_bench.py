"""`qvpic bench`: suite listing and dispatch, and the TTFT benchmark's CPU path through benchmarks/gpu.sh."""

from __future__ import annotations

import importlib.machinery
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from PIL import Image

from jobs import bench

REPO = Path(__file__).resolve().parent.parent


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
    suites = (bench.Suite("with", "fake_with_options", "takes options", ("--quick",)),
              bench.Suite("without", "fake_without_options", "takes none", ()),
              bench.Suite("slow", "fake_with_options", "not in all", None),
              bench.Suite("absent", "benchmarks.no_such_suite", "missing here", ()))
    monkeypatch.setattr(bench, "SUITES", suites)
    monkeypatch.setattr(bench, "BY_NAME", {s.name: s for s in suites})
    return calls


def test_listing_names_every_real_suite(capsys):
    assert bench.main(["--help"]) == 0
    out = capsys.readouterr().out
    for suite in bench.SUITES:
        assert f"  {suite.name} " in out
    assert all(s.available for s in bench.SUITES if s.name in {"ttft", "runtime", "ingest", "legibility", "render"})


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
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu.sh"), str(out)], cwd=tmp_path, env=env,
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

    from benchmarks.real_size import GLM_4_1V_9B, QWEN2_5_VL_7B, materialise, random_weights
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
    from benchmarks.scale_serve import SEARCH_THREADS, run_size, section

    result = run_size(1_000, "random", tmp_path)
    assert result["num_chunks"] == 1_000 and result["search"]["kind"] == "flat"
    assert result["recall_at_8"] == 1.0  # exhaustive scan + float16 rerank is exact
    assert set(result["route_ms"]) == {f"p{q}_t{t}" for t in SEARCH_THREADS for q in (50, 99)}
    assert "| 1,000 | random | flat |" in section([result])
