#!/usr/bin/env bash
# One device call for the engine-level GPU checks and the end-to-end benchmark (BENCHMARKS.md):
# install the carried wheels, run the model_runner GPU tests, then bench/e2e_multiround.py with
# LMBenchmark's multi-round-qa.py when a copy of it is carried in .lmbenchmark/.
#   OUT=/tmp/out bash scripts/device_e2e.sh [extra bench/e2e_multiround.py args...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvservice-device-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then  # the image lacks kvikio, grpc reflection/health, fastapi, openai...
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
date -u; nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, fastapi, uvicorn, openai; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
echo "== model_runner GPU tests"
timeout 150 python3 -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_gpu_model.py -k "host" 2>&1 | tail -25
echo "== end-to-end benchmark"
lmb=()
[[ -f .lmbenchmark/multi-round-qa.py ]] && lmb=(--lmbenchmark .lmbenchmark)
timeout -k 15 480 python3 bench/e2e_multiround.py --model 8b --device cuda --out "$OUT/e2e" "${lmb[@]}" "$@"
echo "== done rc=$?"
