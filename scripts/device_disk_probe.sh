#!/usr/bin/env bash
# Issue 13's open question on a GPU host, one device call (~3 min), results under $OUT/probe:
# why does the daemon spill at ~0.6 of the raw write limit and read at ~0.5 per Load when the DiskStore alone
# reaches 0.87 / 1.07 / 0.83 on the same disk (BENCHMARKS.md "Issue 13 on the H200: the DiskStore meets the
# disk, the daemon does not")? Each row changes one thing (2 MiB blocks, 64 MiB Stores and Loads, cuda pool):
#   1. raw sweep + the DiskStore alone (the limits of this run)
#   2. the daemon as before, its disk threads 4, 8, 16 (--readers sets the daemon's reader and writer threads)
#   3. the daemon restarted before its Loads (empty host tier: every Load lands in free host slots, no scratch
#      buffers, no onboarding spills competing with the reads), with 64 MiB and 256 MiB Loads (the 256 MiB Loads
#      read at 0.92 GB/s into a full host tier, below the 64 MiB ones' 1.18: scratch, or too few reads in flight?)
#   4. the daemon with --onboard-disk-hits clean (KVSERVICE_ONBOARD_DISK_HITS): a Load's disk blocks that find
#      no free or clean host slot are served, not onboarded, so no read causes a spill (bench/disk_model.py's
#      modelled disk: 1.34 / 1.66 -> 1.84 / 2.25 GB/s at depth 1 / 4 with a 256 MiB host tier)
#   bash scripts/device_disk_probe.sh [DISK_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvservice-device-out}/probe
DISK_DIR=${1:-/tmp/bdisk}
mkdir -p "$OUT" "$DISK_DIR"
source scripts/device_env.sh
B=(python3 bench/disk_tier.py --dir "$DISK_DIR" --pool cuda --total 2GiB --raw-bytes 1GiB --repeats 1 --formats segments
   --block-sizes 2MiB --load-bytes 64MiB --load-depth 1,4 --steady)
timeout 150 "${B[@]}" --parts raw,store --out "$OUT/limits.json" 2>&1 | grep -v "^\[" | tee "$OUT/limits.md"
for t in 4 8 16; do
  timeout 60 "${B[@]}" --parts daemon --readers "$t" --out "$OUT/daemon-t$t.json" 2>&1 | grep "^(daemon" | sed "s/^/threads $t: /"
done | tee "$OUT/daemon.md"
timeout 100 "${B[@]}" --parts daemon --restart-before-loads --load-bytes 64MiB,256MiB --out "$OUT/daemon-restart.json" 2>&1 | grep "^(daemon" \
  | sed "s/^/threads 4: /" | tee -a "$OUT/daemon.md"
KVSERVICE_ONBOARD_DISK_HITS=clean timeout 100 "${B[@]}" --parts daemon --load-bytes 64MiB,256MiB \
  --out "$OUT/daemon-clean.json" 2>&1 | grep "^(daemon" | sed "s/^/threads 4, onboard clean: /" | tee -a "$OUT/daemon.md"
