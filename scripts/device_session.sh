#!/usr/bin/env bash
# One device call that measures what the open issues need, in phases, each under its own time limit, so
# that one failing phase costs the others nothing. Few files come back from a device call (about 8):
# every phase appends its table to $OUT/summary.md and its raw output to $OUT/details/, which is packed
# into $OUT/details.tgz at the end (the loose files are removed).
#   bash scripts/device_session.sh [PHASES]       (carry .whl; PHASES comma-separated, default below)
# Phases (seconds of wall time each, at most):
#   tests      every GPU-marked test of the suite (modules the GPU image cannot import are reported, not fatal)  300
#   bw         bench/gpu_bandwidth.py host part, 2 and 4 GiB batches, 2 MiB / 256 KiB / 64 KiB blocks        150
#   loadab     the same at 2 GiB with KVTUNE_LOAD_ENQUEUE_FIRST=1 (no gain on the H100, 2026-12-07)          75
#   bwgrpc     the same at 2 GiB with KVBENCH_GRPC_ONLY=1 (Store and Load over gRPC, not the frames channel) 75
#   trace      the 2 GiB rows with the daemon's call timelines (KVTUNE_TRACE; bench/trace_timeline.py)     110
#   firstab    the 2 GiB rows with a Store's first part of 1024 blocks (KVTUNE_STORE_FIRST_BLOCKS; 256)    75
#   profile    the copy path alone at 2 MiB under torch.profiler (the 2 MiB Store's GPU timeline)          120
#   lookup     bench/lookup_latency.py (the 1024-hash Lookup line)                                          60
#   disk       scripts/device_disk_probe.sh (raw sweep, DiskStore alone, daemon always / clean / restarted)  300
#   disk64     the same with 64 KiB blocks, 1 GiB spilled (issue 13's 64 KiB line)                         300
#   disk64k    disk64 with the engine's 64 KiB blocks 4 to a daemon block (KEYS=4: blocks_per_key)      300
#   e2e        scripts/device_e2e.sh diskboth (issue 14's disk line on this tree)                            300
#   ab:V=X[+W=Y]  the 2 GiB rows of 256 KiB and 64 KiB blocks with KVTUNE_* knobs set (an A/B beside bw)      75
#   tok        16k- and 32k-token batches at the smaller block sizes: 256 KiB blocks (an 8B model at TP 8: one  120
#              engine's share) in 256 / 512 MiB batches, 64 KiB in 64 / 128 MiB (bw keeps 2 / 4 GiB for all)
#   gputest:A+B   the GPU tests of tests/test_gpu.py whose names match A or B (pytest -k "A or B")                 120
#   keys       the 2 GiB rows of 64 and 256 KiB blocks with blocks_per_key 1, 4 and 16 (k engine blocks a   120
#              daemon block: bench/gpu_bandwidth.py --blocks-per-key)
#   tokk       tok with keys: 256 KiB blocks 1, 8 and 16 a key, 64 KiB blocks 1, 4 and 16 a key (issue 10's    200
#              16k/32k-token lines as an engine that keys its small blocks gets them; k = 1 is the baseline)
#   tracetok   the call timelines (as trace) of 256 MiB Stores and Loads of 256 KiB blocks, 1 and 8 a key     100
#   abtok:V=X[+W=Y] 256 / 512 MiB batches of 256 KiB blocks, 1 and 8 a key, with KVTUNE_* knobs set        60
#   abx:V=X[+W=Y] the same with the 2 MiB row too ("abx:" alone: the defaults, the A/B's baseline in the call)  90
# Run the phases that fit one call's 600 s (default: tests,bw,disk64 ~ 8 min at most; on the H200 host
# the tests phase alone took 210 s).
# Run it from a snapshot of a commit so the live working tree's edits do not travel:
#   rm -rf .lead/tree && mkdir -p .lead/tree && git archive HEAD | tar -x -C .lead/tree
#   git rev-parse --short HEAD > .lead/tree/.commit
#   then: cd .lead/tree && WHL_DIR=$OLDPWD/.whl bash scripts/device_session.sh   (carry .whl and .lead)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvservice-device-out}
D=$OUT/details
mkdir -p "$D"
PHASES=${1:-tests,bw,disk64}
source scripts/device_env.sh
export PATH=/tmp/site/bin:$PATH NCCL_NVLS_ENABLE=0
S=$OUT/summary.md
T0=$(date +%s)
say() { echo "$*" | tee -a "$S"; }
# the snapshot's commit: .commit, written beside the archive (git rev-parse inside it names the device copy's HEAD)
say "# device session $(date -u +%FT%TZ), tree $(cat .commit 2>/dev/null || echo 'archive (no .commit)'), phases $PHASES"
say "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo 'no nvidia-smi')"
BW=(python3 bench/gpu_bandwidth.py --layouts layer-first --reps 3 --skip datapath,disk --sizes 2048,256,64)
phase() {  # phase NAME LIMIT CMD...: run, keep its output, append its table lines to the summary
  local name=$1 limit=$2; shift 2
  N=$(( ${N:-0} + 1 ))  # the log's name starts with the phase's place: a phase given twice keeps both logs
  local log="$D/$N-${name//[:=+]/_}.log"
  say ""; say "## $name (+$(( $(date +%s) - T0 )) s)"
  timeout "$limit" "$@" > "$log" 2>&1
  local rc=$?
  grep -E '^\||^pinned|^  host|passed|failed|skipped|error|MISSED|held|^raw limits' "$log" | grep -v '^{' >> "$S"
  [[ $rc != 0 ]] && tail -n 3 "$log" >> "$S"
  say "(rc $rc, +$(( $(date +%s) - T0 )) s)"
}
for p in ${PHASES//,/ }; do
  case $p in
    tests) phase tests 300 python3 -m pytest -m gpu -q -rA -p no:cacheprovider --continue-on-collection-errors tests/ ;;
    bw) phase bw 150 "${BW[@]}" --batch-mib 2048,4096 --out "$D/bw.json" ;;
    loadab) phase loadab 75 env KVTUNE_LOAD_ENQUEUE_FIRST=1 "${BW[@]}" --batch-mib 2048 ;;
    bwgrpc) phase bwgrpc 75 env KVBENCH_GRPC_ONLY=1 "${BW[@]}" --batch-mib 2048 ;;
    firstab) phase firstab 75 env KVTUNE_STORE_FIRST_BLOCKS=1024 "${BW[@]}" --batch-mib 2048 ;;
    trace) phase trace 110 env KVTUNE_TRACE="$D/trace.jsonl" "${BW[@]}" --batch-mib 2048
           python3 bench/trace_timeline.py "$D/trace.jsonl" > "$D/timeline.md" 2>&1 && cp "$D/timeline.md" "$OUT/" ;;
    profile) phase profile 120 python3 bench/gpu_bandwidth.py --layouts layer-first --reps 3 --skip host,disk \
               --sizes 2048 --batch-mib 2048 --profile "$D/prof" ;;
    lookup) phase lookup 60 python3 bench/lookup_latency.py --iters 2000 ;;
    disk) phase disk 300 env OUT="$D" bash scripts/device_disk_probe.sh
          [[ -f $D/probe/ratios.md ]] && cat "$D/probe/ratios.md" >> "$S" ;;
    disk64) phase disk64 300 env OUT="$D/d64" BLOCK=64KiB TOTAL=1GiB bash scripts/device_disk_probe.sh
          [[ -f $D/d64/probe/ratios.md ]] && cat "$D/d64/probe/ratios.md" >> "$S" ;;
    disk64k) phase disk64k 300 env OUT="$D/d64k" BLOCK=64KiB TOTAL=1GiB KEYS=4 bash scripts/device_disk_probe.sh
          [[ -f $D/d64k/probe/ratios.md ]] && cat "$D/d64k/probe/ratios.md" >> "$S" ;;
    e2e) phase e2e 300 env OUT="$D" bash scripts/device_e2e.sh diskboth
         [[ -f $D/pool.md ]] && cat "$D/pool.md" >> "$S" ;;
    tok) phase tok256 60 "${BW[@]/2048,256,64/256}" --batch-mib 256,512
         phase tok64 60 "${BW[@]/2048,256,64/64}" --batch-mib 64,128 ;;
    gputest:*) e=${p#gputest:}; phase "$p" 120 python3 -m pytest -m gpu -q -rA -p no:cacheprovider -k "${e//+/ or }" tests/test_gpu.py ;;
    tokk) phase tokk256 100 "${BW[@]/2048,256,64/256}" --batch-mib 256,512 --blocks-per-key 1,8,16
          phase tokk64 100 "${BW[@]/2048,256,64/64}" --batch-mib 64,128 --blocks-per-key 1,4,16 ;;
    tracetok) phase tracetok 100 env KVTUNE_TRACE="$D/tracetok.jsonl" "${BW[@]/2048,256,64/256}" --batch-mib 256 \
                --blocks-per-key 1,8
              python3 bench/trace_timeline.py "$D/tracetok.jsonl" > "$D/timeline_tok.md" 2>&1 && cp "$D/timeline_tok.md" "$OUT/" ;;
    keys) phase keys 120 "${BW[@]/2048,256,64/64,256}" --batch-mib 2048 --blocks-per-key 1,4,16 ;;
    abx:*) kv=${p#abx:}; phase "$p" 90 env ${kv//+/ } "${BW[@]}" --batch-mib 2048 ;;
    abtok:*) kv=${p#abtok:}; phase "$p" 60 env ${kv//+/ } "${BW[@]/2048,256,64/256}" --batch-mib 256,512 --blocks-per-key 1,8 ;;
    ab:*) kv=${p#ab:}; phase "$p" 75 env ${kv//+/ } "${BW[@]/2048,256,64/256,64}" --batch-mib 2048 ;;
    *) say "unknown phase $p" ;;
  esac
done
tar czf "$OUT/details.tgz" -C "$OUT" details && rm -rf "$D"
say ""; say "done at +$(( $(date +%s) - T0 )) s"
