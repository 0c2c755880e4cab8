#!/usr/bin/env bash
# Issue 10's open question on a GPU host, one device call (~3 min): where does the daemon's time go in a
# Store / Load of 256 KiB and 64 KiB blocks? On the H200 the daemon's own Store time ran at 0.51-0.56 x D2H
# at 256 KiB (0.19-0.25 at 64 KiB) where the copy path alone reaches 0.96-0.98 and bench/core_overhead.py's
# model of core + copy says ~0.85: the time goes somewhere the model leaves out (the copy thread's own
# Python, gRPC threads, the GIL between them and the event loop). Results under $OUT/profile:
#   1. bench/gpu_bandwidth.py as it is (the figures, no sampler attached): figures.md
#   2. the same with the daemon sampled by py-spy (--nonblocking, all threads): spy/*.txt, summary.md
#      (bench/daemon_sampling.py: per thread, the share of samples and the functions on top)
# Carry .whl with the py-spy wheel (pip download py-spy==0.4.3 ... manylinux1_x86_64) besides the usual ones.
#   bash scripts/device_profile_host.sh [SIZES_KIB] [BATCH_MIB]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvservice-device-out}/profile
SIZES=${1:-256,64}
BATCH=${2:-2048}
mkdir -p "$OUT/spy"
source scripts/device_env.sh
export PATH=/tmp/site/bin:$PATH  # the py-spy wheel's binary
B=(python3 bench/gpu_bandwidth.py --sizes "$SIZES" --batch-mib "$BATCH" --layouts layer-first --reps 3
   --skip datapath,disk)
timeout 200 "${B[@]}" --out "$OUT/figures.json" 2>&1 | grep -v "^{" | tee "$OUT/figures.md"
timeout 200 "${B[@]}" --pyspy "$OUT/spy" --out "$OUT/figures-sampled.json" 2>&1 | grep -v "^{" | tail -5
python3 bench/daemon_sampling.py "$OUT"/spy/*.txt --top 25 | tee "$OUT/summary.md" | head -150
