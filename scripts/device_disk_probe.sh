#!/usr/bin/env bash
# Issue 13 on a GPU host, one device call (<= 5 min), results under $OUT/probe: the daemon's disk pipelines
# against the raw O_DIRECT limits and the DiskStore alone of the SAME run, 2 MiB blocks, 64 MiB Stores and
# Loads (depth 1 and 4), cuda pool. Rows (each changes one thing):
#   limits   raw sweep (threads 4-32 x requests 1-32 MiB, before and after) + the DiskStore alone
#   always   the daemon as it ships (onboard_disk_hits always): Loads into a host tier full of dirty blocks
#   clean    --onboard-disk-hits clean (KVSERVICE_ONBOARD_DISK_HITS): those Loads' blocks are served, not
#            onboarded, so no read waits for or competes with the spill of the blocks it would replace
#   restart  the daemon restarted before its Loads (empty host tier: every block lands in a free slot)
# bench/disk_model.py (the H200 sweep's calibrated model) predicts, as fractions of the model's own limits:
# spill and steady spill = the store alone; Loads clean / restart = the store alone (depth 1 ~0.75, depth 4
# ~0.97 of the read limit); Loads always 0.5-0.6 / 0.4 (BENCHMARKS.md "Issue 13, disk model calibrated to
# the H200 sweep, 2026-12-06"). The last lines print every figure as a ratio of this run's raw limits.
#   [BLOCK=64KiB TOTAL=1GiB] [KEYS=4] bash scripts/device_disk_probe.sh [DISK_DIR]       (carry .whl; ~4 min)
# KEYS: the daemon rows with the engine's blocks KEYS to a daemon block (KVClient(blocks_per_key))
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvservice-device-out}/probe
DISK_DIR=${1:-/tmp/bdisk}
mkdir -p "$OUT" "$DISK_DIR"
source scripts/device_env.sh
# BLOCK / TOTAL: the block size and bytes spilled (issue 13's 64 KiB line: BLOCK=64KiB TOTAL=1GiB)
B=(python3 bench/disk_tier.py --dir "$DISK_DIR" --pool cuda --total "${TOTAL:-2GiB}" --raw-bytes 1GiB --repeats 1
   --formats segments --block-sizes "${BLOCK:-2MiB}" --load-bytes 64MiB --load-depth 1,4 --steady
   --blocks-per-key "${KEYS:-1}")
date -u
timeout 110 "${B[@]}" --parts raw,store --out "$OUT/limits.json" 2>&1 | grep -v "^\[" > "$OUT/limits.md"
date -u
KVTUNE_TRACE="$OUT/always-trace.jsonl" timeout 55 "${B[@]}" --parts daemon --out "$OUT/always.json" > "$OUT/always.log" 2>&1
python3 bench/trace_timeline.py "$OUT/always-trace.jsonl" 2>&1 | tail -n 2 > "$OUT/always-spills.md"; rm -f "$OUT/always-trace.jsonl"
KVSERVICE_ONBOARD_DISK_HITS=clean timeout 55 "${B[@]}" --parts daemon --out "$OUT/clean.json" > "$OUT/clean.log" 2>&1
timeout 60 "${B[@]}" --parts daemon --restart-before-loads --out "$OUT/restart.json" > "$OUT/restart.log" 2>&1
# one cold Load at a time, of 512 MiB (a 4k-token prompt at 2 MiB blocks): a Load alone with hundreds of MiB in
# flight, as the raw limit's best cells have (the 64 MiB Load alone has 64 MiB)
timeout 60 "${B[@]}" --parts daemon --restart-before-loads --load-bytes 512MiB --load-depth 1 --out "$OUT/big.json" > "$OUT/big.log" 2>&1
date -u
python3 - "$OUT" <<'PY' | tee "$OUT/ratios.md"
import json, os, sys
out = sys.argv[1]
lim = json.load(open(os.path.join(out, "limits.json")))
L = lim["limit"]
st = lim["store"][0]
print(f"raw limits (best of both sweeps): write {L['write']:.2f}, read {L['read']:.2f} GB/s; best cells again: "
      + "; ".join(f"{op} {', '.join(f'{v:.2f}' for v in r['again'][op])}" for r in lim["raw"] for op in ("write", "read")))
print("\n| row | spill | steady spill | Load depth 1 | Load depth 4 | exact |\n| --- | --- | --- | --- | --- | --- |")
f = lambda v, op: f"{v:.2f} ({v / L[op]:.2f})"
print(f"| DiskStore alone | {f(st['spill_gbps'], 'write')} | {f(st['rewrite_gbps'], 'write')} | - | "
      f"{f(st['read_gbps'], 'read')} (4 threads) | {st['byte_exact']} |")
for row in ("always", "clean", "restart"):
    p = os.path.join(out, row + ".json")
    if not os.path.exists(p):
        print(f"| {row} | (no result: see {row}.log) | | | | |"); continue
    r = json.load(open(p))["daemon"][0]
    d = {int(k): v for k, v in r["loads_by_depth"].items()}
    print(f"| daemon, {row} | {f(r['spill_gbps'], 'write')} | {f(r['steady_spill_gbps'], 'write')} | "
          f"{f(d[1], 'read')} | {f(d[4], 'read')} | {r['exact']} |")
p = os.path.join(out, "big.json")
if os.path.exists(p):
    r = json.load(open(p))["daemon"][0]
    print(f"| daemon, restart, Loads of {r['load_bytes'] >> 20} MiB | {f(r['spill_gbps'], 'write')} | - | "
          f"{f(r['loads_by_depth']['1'], 'read')} | - | {r['exact']} |")
print("\nGB/s (x this run's raw limit). Targets: spill and cold load >= 0.85 x raw.")
if os.path.exists(os.path.join(out, "always-spills.md")):
    print("\nthe `always` row's spill batches (KVTUNE_TRACE):" + open(os.path.join(out, "always-spills.md")).read().rstrip())
PY
