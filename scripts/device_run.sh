#!/usr/bin/env bash
# The command run on a GPU machine of the device tool (see BENCHMARKS.md, "GPU data path (H200)"):
# install the carried wheels, print the environment, run the GPU tests, run the GPU benchmark.
# Everything lands under $OUT (default /tmp/kvservice-device-out): run.log, bench.json, daemon logs, profile.
#   bash scripts/device_run.sh [tests|bench|all] [extra bench args...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvservice-device-out}
mkdir -p "$OUT"
what=${1:-all}; shift || true
exec > >(tee -a "$OUT/run.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0
if [[ -z ${SKIP_WHEELS:-} ]] && ls .whl/*.whl >/dev/null 2>&1; then  # the image lacks kvikio, grpc reflection/health, google-crc32c
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl || exit 1
fi
echo "== environment"
nvidia-smi --query-gpu=name,uuid,memory.used,memory.total,driver_version --format=csv,noheader
nproc; free -g | head -2; df -h . /tmp | tail -n +2
python3 - <<'PY'
import torch, sys
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
print("device", torch.cuda.get_device_name(0), "uuid", torch.cuda.get_device_properties(0).uuid)
for mod in ("cuda.bindings", "cupy", "kvikio", "google_crc32c", "grpc", "google.protobuf"):
    try:
        m = __import__(mod, fromlist=["x"]); print(mod, getattr(m, "__version__", "?"))
    except Exception as e:
        print(mod, "MISSING", e)
from kvservice import checksum; print("crc32c GIL-free path:", checksum._extend_gil_free is not None)
from kvservice.disk.io_backend import open_backend; print("io backend auto ->", open_backend("auto").name)
PY
rc=0
if [[ $what == all || $what == bench ]]; then
  echo "== benchmark"
  timeout 240 python3 bench/gpu_bandwidth.py --out "$OUT/bench.json" --profile "$OUT/prof" "$@" || rc=$?
fi
if [[ $what == all || $what == tests ]]; then
  echo "== GPU tests"
  # every GPU-marked test of the suite; modules whose imports the GPU image lacks (openai, jsonschema: the
  # HTTP API and deployment tests, CPU-only anyway) fail to collect and are reported, not fatal
  timeout 300 python3 -m pytest -m gpu -v -rA -s -p no:cacheprovider --continue-on-collection-errors tests/ || rc=$?
fi
echo "== done rc=$rc"
exit $rc
