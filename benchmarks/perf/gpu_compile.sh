#!/usr/bin/env bash
# Compile chunks/s by batch size on one CUDA GPU (bench-qwen, bfloat16, every variant), in under 2 minutes.
# Called by benchmarks/perf/gpu.sh; runnable alone. Writes one Markdown table file.
#
#   benchmarks/perf/gpu_compile.sh [OUTPUT.md]      default: $OUT/compile_batch_gpu.md, else ./compile_batch_gpu.md
#
# Without a CUDA device it runs a short CPU smoke test of the same path (tiny model) instead.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="${1:-${OUT:-.}/compile_batch_gpu.md}"
mkdir -p "$(dirname "$out")"
cd "$repo"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
PY="${PY:-python3}"

if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  exec timeout 110 "$PY" -m benchmarks.perf.compile_batch --device cuda --model bench-qwen --dtype bfloat16 \
    --chunks 64 --batch-sizes 1 4 8 16 32 --repeats 3 --out "$out"
fi
echo "gpu_compile.sh: no CUDA device; CPU smoke run of the same path with the tiny model" >&2
exec "$PY" -m benchmarks.perf.compile_batch --quick --out "$out"
