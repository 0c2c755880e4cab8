#!/usr/bin/env bash
# Disk tier v2 on a GPU host (issue 13's H200 targets), one device call, results under $OUT:
#   bash scripts/device_disk_tier.sh [DISK_DIR]        (DISK_DIR: a directory on the disk under test)
# 1. bench/disk_tier.py --pool cuda: the raw O_DIRECT limit (best of threads 4-32 x requests 1-32 MiB, before
#    and after; the best cells run again and a write into fresh extents, to show how optimistic the best cell
#    is), DiskStore spill / cold read, and through the daemon (--disk-format segments, the default) Store spill
#    into an empty tier and (--steady) into the full tier (each spill rewrites the slot of an evicted block), and
#    cold disk -> GPU Load at 2 MiB and 64 KiB blocks, Loads of LOAD_BYTES each (default 64MiB: a 512-token
#    prefix of an 8B model), LOAD_DEPTH Loads in flight (default 1,4: one after another, and four parked
#    requests' Loads at once), bytes compared (restart: a CPU-box figure). PARTS (default raw,store,daemon).
# 2. bench/gpu_bandwidth.py's disk section (8B paged layout figures), unless SKIP_GPU_BANDWIDTH is set.
# Targets: cold disk -> GPU >= 0.85 x raw read, sustained spill >= 0.85 x raw write, 64 KiB >= 0.5 x both.
# Wheels the device lacks: .whl/*.whl (carried) go to /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvservice-device-out}
DISK_DIR=${1:-$PWD/.bench-disk}
mkdir -p "$OUT" "$DISK_DIR"
exec > >(tee -a "$OUT/disk_tier.log") 2>&1
export NCCL_NVLS_ENABLE=0
source scripts/device_env.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader; nproc; df -hT "$DISK_DIR"
timeout ${BENCH_S:-300} python3 bench/disk_tier.py --dir "$DISK_DIR" --pool cuda --total 2GiB --raw-bytes 1GiB \
  --repeats ${REPEATS:-2} --parts ${PARTS:-raw,store,daemon} --formats segments --load-bytes ${LOAD_BYTES:-64MiB} \
  --load-depth ${LOAD_DEPTH:-1,4} --steady --out "$OUT/disk_tier.json"
[[ -n ${SKIP_GPU_BANDWIDTH:-} ]] || timeout ${GPU_BW_S:-90} python3 bench/gpu_bandwidth.py --disk-dir "$DISK_DIR" \
  --skip datapath,host --out "$OUT/gpu_bandwidth_segments.json"
