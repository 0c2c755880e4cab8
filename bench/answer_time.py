#!/usr/bin/env python3
"""How long a Store of new blocks into a full host tier takes to be answered, in process: BlockCache on a
shared-memory pool, the copies replaced by no-ops (or by a modeled DMA: a sleep of bytes / --dma-gbps in
the copy thread, GIL released), each Store followed at once by a Load of its blocks (as an engine that
sends its next call as soon as the reply is in). What the engine waits for is the time to the answer
(pipeline.Answer, the frames channel's hook): the core's plan, evictions and copies, not the bookkeeping
after the answer.

    .venv/bin/python bench/answer_time.py [--blocks 32768] [--block-bytes 4096] [--rounds 12] [--dma-gbps 0]
    TREE=/path/to/other/checkout .venv/bin/python bench/answer_time.py ...     (another tree's kvservice)

The host tier holds two batches (as bench/gpu_bandwidth.py's): from the third round on every Store evicts
a batch. Rounds after the first three are reported (medians and minimum, ms). Two trees are compared by
running this once per tree, in turn, several times: the CPU box's speed moves 30-50% between runs, so
compare pairs of one sitting only (BENCHMARKS.md, "Lead, 2026-12-07 12:51-14:30 UTC"). With 4 KiB
blocks, KVTUNE_STORE_FIRST_MIB=16 gives the parts a 2 GiB Store of 64 KiB blocks has (a first part of 4096).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace

sys.path.insert(0, os.environ.get("TREE") or os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvservice.core import pipeline  # noqa: E402
from kvservice.core.cache import BlockCache  # noqa: E402
from kvservice.core.clock import FakeClock  # noqa: E402
from kvservice.ops.config import Config  # noqa: E402
from tests.corekit import CANARY, Pool, h, ns_spec  # noqa: E402

WARMUP = 3


async def run(blocks: int, block_bytes: int, rounds: int, dma_gbps: float) -> dict[str, list[float]]:
    tmp = tempfile.mkdtemp()
    cfg = replace(Config(), socket_path=os.path.join(tmp, "kv.sock"), host_capacity_bytes=2 * blocks * block_bytes,
                  disk_path="", disk_capacity_bytes=0, max_batch_blocks=max(8192, blocks), io_backend="posix")
    cache = BlockCache(cfg, FakeClock())
    await cache.start()
    pool = Pool(num_blocks=2 * blocks, block_bytes=block_bytes)
    sid = cache.open_session(ns_spec(f"answer-{block_bytes}"), pool.spec, CANARY, "bench").session_id
    mem = cache._sessions.get(sid).memory
    per_block = block_bytes / (dma_gbps * 1e9) if dma_gbps else 0.0

    def gather(block_ids, arena, offsets, enqueued=None):
        if enqueued is not None:
            enqueued()
        if per_block:
            time.sleep(len(block_ids) * per_block)
        return [0] * len(block_ids)

    def scatter(block_ids, arena, offsets, enqueued=None):
        if enqueued is not None:
            enqueued()
        if per_block:
            time.sleep(len(block_ids) * per_block)
    mem.gather_into, mem.scatter_from = gather, scatter
    ids, load_ids = list(range(blocks)), list(range(blocks, 2 * blocks))
    out: dict[str, list[float]] = {"store: to its answer": [], "store: loop CPU to its answer": [],
                                   "load sent at the answer: to its answer": []}
    try:
        for r in range(WARMUP + rounds):
            hs = b"".join(h(i, f"{r}") for i in range(blocks))
            stamps: list[float] = []
            loads: list[asyncio.Future] = []

            def store_answered(_res, hs=hs) -> None:
                stamps.append(time.perf_counter())
                stamps.append(time.thread_time())
                loads.append(asyncio.ensure_future(cache.load(sid, hs, load_ids, answer=pipeline.Answer(
                    lambda _r: stamps.append(time.perf_counter())))))
            t0, c0 = time.perf_counter(), time.thread_time()
            res = await cache.store(sid, hs, ids, answer=pipeline.Answer(store_answered))
            assert bytes(res.status) == bytes([1]) * blocks, "a block was not stored"
            loaded = await loads[0]
            assert bytes(loaded.status) == bytes([1]) * blocks, "a block was not loaded"
            if r >= WARMUP:
                out["store: to its answer"].append((stamps[0] - t0) * 1e3)
                out["store: loop CPU to its answer"].append((stamps[1] - c0) * 1e3)
                out["load sent at the answer: to its answer"].append((stamps[2] - stamps[0]) * 1e3)
        assert cache.audit() == []
    finally:
        await cache.drain_and_stop()
        pool.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=32768)
    ap.add_argument("--block-bytes", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--dma-gbps", type=float, default=0.0, help="model each copy as a sleep at this rate (0: no-op)")
    a = ap.parse_args()
    got = asyncio.run(run(a.blocks, a.block_bytes, a.rounds, a.dma_gbps))
    print(f"tree {os.environ.get('TREE') or 'this checkout'}: {a.blocks} blocks of {a.block_bytes} bytes a call, "
          f"{a.rounds} rounds into a full host tier, copies {'modeled at %g GB/s' % a.dma_gbps if a.dma_gbps else 'no-ops'}")
    print("| measure | median ms | min ms | us a block (median) |")
    print("| --- | ---: | ---: | ---: |")
    for k, v in got.items():
        med = statistics.median(v)
        print(f"| {k} | {med:.1f} | {min(v):.1f} | {med * 1e3 / a.blocks:.2f} |")


if __name__ == "__main__":
    main()
