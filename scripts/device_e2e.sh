#!/usr/bin/env bash
# One device call for the engine-level GPU checks and the end-to-end benchmark (BENCHMARKS.md):
# install the carried wheels, run the model_runner GPU tests, then bench/e2e_multiround.py.
#   OUT=/tmp/out bash scripts/device_e2e.sh [bench budget seconds]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvservice-device-out}
mkdir -p "$OUT"
budget=${1:-270}
exec > >(tee -a "$OUT/run.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl || exit 1
fi
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader
echo "== model_runner GPU tests"
timeout 150 python3 -m pytest -m gpu -v -rA -p no:cacheprovider tests/test_gpu_model.py 2>&1 | tail -30
echo "== end-to-end benchmark"
timeout -k 15 $((budget + 40)) python3 bench/e2e_multiround.py --model 8b --device cuda --dtype bfloat16 \
  --budget-seconds "$budget" --out "$OUT/e2e"
echo "== done rc=$?"
