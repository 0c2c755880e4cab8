#!/bin/bash
# lead: issue 10 and 13 H200 figures on main, one call
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
git_rev=$(cat .lead/REV); echo "tree $git_rev"; date -u; nproc
( timeout 250 python3 bench/gpu_bandwidth.py --batch-mib 2048,4096 --sizes 2048,256,64 --layouts layer-first --reps 3 \
    --skip datapath,disk --out $OUT/gpu_bandwidth.json > $OUT/gpu_bandwidth.txt 2>&1; echo "rc $?" >> $OUT/gpu_bandwidth.txt )
date -u
mkdir -p /tmp/bdisk
OUT=$OUT/disk BENCH_S=250 REPEATS=1 PARTS=raw,daemon SKIP_GPU_BANDWIDTH=1 SKIP_WHEELS=1 bash scripts/device_disk_tier.sh /tmp/bdisk > /dev/null 2>&1
echo "disk rc $?"; date -u
tail -45 $OUT/gpu_bandwidth.txt; tail -60 $OUT/disk/disk_tier.log
