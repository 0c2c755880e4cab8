"""In-process A/B of the core's Store/Load pipeline (issue 10): one BlockCache, each copy a modeled DMA
(a sleep of bytes / --dma-gbps in the copy thread, GIL released, one copy at a time each way),
rounds interleaved between the configurations, best of --rounds each:

    .venv/bin/python bench/core_pipeline_ab.py [--block-kib 64] [--blocks 16384] [--rounds 8]

  parts      Stores and Loads in parts (pipeline.PIPELINE_BLOCKS = 2048, the default) or in one part
  switch     the GIL switch interval: CPython's default 5 ms, or the daemon's 0.2 ms
Prints Store and Load "x dma": the modeled copy time over the call's wall time (bench/core_overhead.py's
proxy of the Store / D2H and Load / H2D ratios). Same process, same box noise for every configuration:
on a shared box this separates the pipeline's effect from the noise that a tree-against-tree A/B sees.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kvservice.core.pipeline as pipeline_mod  # noqa: E402
from kvservice.core.cache import BlockCache  # noqa: E402
from kvservice.core.clock import FakeClock  # noqa: E402
from kvservice.ops.config import Config  # noqa: E402
from tests.corekit import CANARY, Pool, h, ns_spec  # noqa: E402


async def run(block_bytes: int, n: int, rounds: int, dma_gbps: float) -> None:
    tmp = tempfile.mkdtemp()
    cfg = replace(Config(), socket_path=os.path.join(tmp, "kv.sock"), host_capacity_bytes=3 * n * block_bytes,
                  disk_path="", disk_capacity_bytes=0, max_batch_blocks=max(8192, n), io_backend="posix",
                  lease_seconds=1e9)
    cache = BlockCache(cfg, FakeClock())
    await cache.start()
    pool = Pool(num_blocks=n, block_bytes=block_bytes)
    sid = cache.open_session(ns_spec("ab"), pool.spec, CANARY, "bench").session_id
    mem = cache._sessions.get(sid).memory
    d2h, h2d = threading.Lock(), threading.Lock()

    def dma(k: int, engine: threading.Lock) -> None:
        with engine:
            time.sleep(k * block_bytes / (dma_gbps * 1e9))

    mem.gather_into = lambda ids, arena, offsets: (dma(len(ids), d2h), [0] * len(ids))[1]
    mem.scatter_from = lambda ids, arena, offsets: dma(len(ids), h2d)
    ids = list(range(n))
    seq = [0]

    def fresh() -> bytes:
        seq[0] += 1
        return b"".join(h(i, f"{seq[0]}") for i in range(n))

    for _ in range(3):  # the host tier full: every Store from now on evicts a batch
        await cache.store(sid, fresh(), ids)
    configs = [(si, part) for si in (0.005, 0.0002) for part in (10**9, pipeline_mod.PIPELINE_BLOCKS)]
    best: dict[tuple, float] = {}
    was = sys.getswitchinterval()
    try:
        for _ in range(rounds):
            for si, part in configs:
                sys.setswitchinterval(si)
                pipeline_mod.PIPELINE_BLOCKS = part
                hs = fresh()
                for op in ("store", "load"):
                    t0 = time.perf_counter()
                    res = await (cache.store(sid, hs, ids) if op == "store" else cache.load(sid, hs, ids))
                    wall = time.perf_counter() - t0
                    assert set(res.status) == {1}, f"{op}: not every block went through"
                    best[si, part, op] = min(best.get((si, part, op), 1e9), wall)
    finally:
        sys.setswitchinterval(was)
    copy = n * block_bytes / (dma_gbps * 1e9)
    print(f"{block_bytes >> 10} KiB x {n} blocks, modeled copy {copy * 1e3:.1f} ms each way, best of {rounds}")
    print("| switch interval | parts | Store x dma | Load x dma |\n|---|---|---|---|")
    for si, part in configs:
        print(f"| {si * 1e3:g} ms | {'in parts' if part < n else 'one part'} | {copy / best[si, part, 'store']:.2f} "
              f"| {copy / best[si, part, 'load']:.2f} |")
    assert not cache.audit(), cache.audit()
    await cache.close_session(sid)
    await cache.drain_and_stop()
    pool.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-kib", type=int, default=64)
    p.add_argument("--blocks", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--dma-gbps", type=float, default=55.0)
    a = p.parse_args()
    asyncio.run(run(a.block_kib << 10, a.blocks, a.rounds, a.dma_gbps))


if __name__ == "__main__":
    main()
