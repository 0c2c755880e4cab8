#!/usr/bin/env bash
# Issue 14's end-to-end measurements on a GPU host, one device call, results under $OUT/e2e:
#   bash scripts/device_e2e.sh host          recompute vs the host tier (the 5x line) and the disk pair
#   bash scripts/device_e2e.sh hostonly      recompute vs the host tier only (the 5x line, ~150 s)
#   bash scripts/device_e2e.sh disk          the disk pair only (prefetch 4 vs 0), DISK_ORDER=p4|p0 first
#   bash scripts/device_e2e.sh diskboth      the disk pair in both orders ($OUT/e2e-p4first, $OUT/e2e-p0first,
#                                            ~290 s) and the two pooled: the disk line's verdict (v7: the order
#                                            alone moves one run's figure by 20-50 points)
#   bash scripts/device_e2e.sh noreuse       no reuse (ABBA cycles) and round-0 misses one at a time
#   bash scripts/device_e2e.sh decode        bench/decode.py: eager vs CUDA-graph decode step
# 8B shape, 8 users x 6 rounds (LMBenchmark multi-round QA, 16k-token histories), engines pinned to their own
# cores (--pin-cpus); DISK_RATE (default 1.2) is the disk setting's arrival rate factor. The commands are those of
# BENCHMARKS.md "End to end on the H200, v6". Pool the disk target over runs in both orders with
# `python3 bench/e2e_pool.py A/results.json B/results.json`. Wheels the device lacks: .whl/*.whl -> /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvservice-device-out}
mkdir -p "$OUT"
source scripts/device_env.sh
RATE=${DISK_RATE:-1.2}
if [[ ${DISK_ORDER:-p4} == p4 ]]; then PAIR=disk_p4,disk_p0; else PAIR=disk_p0,disk_p4; fi
COMMON=(--model 8b --device cuda --out "$OUT/e2e" --users 8 --rounds 6 --disk-rate-factor "$RATE"
        --disk-round0-rate-factor 0.3 --disk-host-prompts 3 --prefetch-share 0.6 --disk-format segments --pin-cpus)
case ${1:-disk} in
  host) timeout 560 python3 bench/e2e_multiround.py "${COMMON[@]}" --configs "recompute,host,$PAIR" --config-timeout 90 ;;
  hostonly) timeout 330 python3 bench/e2e_multiround.py "${COMMON[@]}" --configs recompute,host --config-timeout 90 ;;
  disk) timeout 400 python3 bench/e2e_multiround.py "${COMMON[@]}" --configs "$PAIR" --config-timeout 100 ;;
  noreuse) timeout 300 python3 bench/e2e_multiround.py "${COMMON[@]}" --configs no_reuse --no-reuse-half-seconds 5 \
             --no-reuse-cycles 3 --miss-probe 10 --config-timeout 100 ;;
  decode) timeout 120 python3 bench/decode.py --model 8b --contexts 512 2048 8192 16384 --out "$OUT/decode" ;;
  diskboth)
    rc=0
    for order in p4 p0; do
      if [[ $order == p4 ]]; then pair=disk_p4,disk_p0; else pair=disk_p0,disk_p4; fi
      timeout 280 python3 bench/e2e_multiround.py "${COMMON[@]}" --out "$OUT/e2e-${order}first" --configs "$pair" \
        --config-timeout 100 || rc=$?  # the last --out is argparse's
    done
    python3 bench/e2e_pool.py "$OUT"/e2e-p4first/results.json "$OUT"/e2e-p0first/results.json | tee "$OUT/pool.md"
    exit $rc ;;
  *) echo "usage: $0 host|hostonly|disk|diskboth|noreuse|decode" >&2; exit 2 ;;
esac
rc=$?
[[ -f $OUT/e2e/results.md ]] && grep -A9 "## Targets" "$OUT/e2e/results.md"
exit $rc
