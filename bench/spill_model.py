"""The daemon's spill pipeline against a modelled virtual disk, on any box (a CPU-box proxy of issue 13's
H200 spill line, where the DiskStore alone reaches the disk and the daemon does not).

    .venv/bin/python bench/spill_model.py [--writers 4,8] [--host-blocks 128,512] [--gbps 3.0] [--latency-ms 4]

The model sits at the segment I/O boundary (kvservice.disk.segment.os_pwritev, as the fault tests'
injections do): no byte is written; each request takes its turn on one shared transfer timeline of
--gbps, plus a fixed --latency-ms, so a disk's throughput grows with the requests in flight up to
--gbps, as the H200's virtual disk does (raw sweep: ~1.3 GB/s for one 4 MiB stream, ~3 GB/s with 8-32
requests in flight). Spills only: nothing is read back.

For each --writers x --host-blocks (2 MiB blocks): the same bytes spilled by DiskStore.write alone
(--writers threads, 64 MiB calls, as bench/disk_tier.py's store part), and by an in-process
BlockCache (writer_threads = --writers, a host tier of --host-blocks blocks) fed 64 MiB Stores one
after another from a shared-memory pool, twice: into an empty disk tier, then again (the tier's
slots reused). The engine copies are no-ops (no CRC, no memcpy: a 2-core box would time its own
copies, not the pipeline). Prints GB/s, the ratio daemon / store alone, requests and most requests
in flight at the modelled disk, and the write queue's high water (jobs that waited for a writer).
Model figures, not a disk's: they show where the pipeline waits, not what a disk does.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvservice.core.cache import BlockCache  # noqa: E402
from kvservice.core.clock import SystemClock  # noqa: E402
from kvservice.disk import segment  # noqa: E402
from kvservice.disk.batch_io import HostSlots  # noqa: E402
from kvservice.disk.store import BlockWrite, DiskStore  # noqa: E402
from kvservice.disk.tier_io import disk_capacity_for  # noqa: E402
from kvservice.ops.config import Config  # noqa: E402
from tests.corekit import CANARY, Pool, h, ns_spec  # noqa: E402

BLOCK = 2 << 20
PER_STORE = 32  # blocks per Store and per DiskStore.write call: 64 MiB


class ModelDisk:
    """One transfer timeline at `gbps` plus `latency_s` a request; counts requests and the most in flight."""

    def __init__(self, gbps: float, latency_s: float) -> None:
        self.bps, self.latency = gbps * 1e9, latency_s
        self._lock = threading.Lock()
        self._free_at = 0.0
        self._in_flight = 0
        self.requests = self.most_in_flight = 0

    def reset(self) -> None:
        with self._lock:
            self.requests = self.most_in_flight = 0

    def pwritev(self, fd: int, bufs, offset: int) -> int:
        n = sum(memoryview(b).nbytes for b in bufs)
        with self._lock:
            start = max(time.perf_counter(), self._free_at)
            self._free_at = start + n / self.bps
            done = self._free_at + self.latency
            self.requests += 1
            self._in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self._in_flight)
        wait = done - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        with self._lock:
            self._in_flight -= 1
        return n


def store_alone(root: str, blocks: int, writers: int) -> float:
    store = DiskStore(os.path.join(root, "store"), int(blocks * BLOCK * 1.2) + (64 << 20))
    arena = segment.aligned_buffer(PER_STORE * BLOCK)  # the model reads no byte: one batch's worth serves all
    locs = store.reserve([BLOCK] * blocks)
    assert all(loc is not None for loc in locs)
    writes = [BlockWrite("model", i.to_bytes(32, "little"), 0, stored_at=time.time()) for i in range(blocks)]
    offsets = np.arange(PER_STORE, dtype=np.int64) * BLOCK
    lengths = np.full(PER_STORE, BLOCK, dtype=np.int64)

    def spill(lo: int) -> None:
        k = min(PER_STORE, blocks - lo)
        faults = store.write(locs[lo:lo + k], writes[lo:lo + k], HostSlots(arena, offsets[:k], lengths[:k]))
        assert not any(faults), faults

    t0 = time.perf_counter()
    with ThreadPoolExecutor(writers) as pool:
        list(pool.map(spill, range(0, blocks, PER_STORE)))
    seconds = time.perf_counter() - t0
    store.close()
    return blocks * BLOCK / seconds / 1e9


async def daemon(root: str, blocks: int, writers: int, host_blocks: int) -> tuple[float, float, int]:
    disk = os.path.join(root, "disk")
    os.makedirs(disk)
    cfg = replace(Config(), socket_path=os.path.join(root, "kv.sock"), host_capacity_bytes=host_blocks * BLOCK,
                  disk_path=disk, disk_capacity_bytes=disk_capacity_for(int(blocks * 2.5), BLOCK),
                  max_batch_blocks=8192, io_backend="posix", writer_threads=writers, reader_threads=writers,
                  write_queue_depth=1024)
    cache = BlockCache(cfg, SystemClock())
    await cache.start()
    pool = Pool(num_blocks=PER_STORE, block_bytes=BLOCK)
    sid = cache.open_session(ns_spec("model"), pool.spec, CANARY, "bench/spill_model.py").session_id
    cache._sessions.get(sid).memory.gather_into = lambda block_ids, arena, offsets: [0] * len(block_ids)
    ids = list(range(PER_STORE))

    async def one_pass(tag: str) -> float:
        spills0 = cache.stats.total.spills
        t0 = time.perf_counter()
        for lo in range(0, blocks, PER_STORE):
            res = await cache.store(sid, b"".join(h(i, tag) for i in range(lo, lo + PER_STORE)), ids)
            assert all(r.status == 1 for r in res), res[0]
        await cache.tiers.drain()
        return (cache.stats.total.spills - spills0) * BLOCK / (time.perf_counter() - t0) / 1e9

    try:
        first = await one_pass("a")
        again = await one_pass("b")
        return first, again, cache.tiers.writes.high_water
    finally:
        await cache.close_session(sid)
        await cache.drain_and_stop()
        pool.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--writers", default="4,8")
    p.add_argument("--host-blocks", default="128,512", help="the daemon's host tier, in 2 MiB blocks")
    p.add_argument("--blocks", type=int, default=1024, help="blocks spilled per pass (2 MiB each)")
    p.add_argument("--gbps", type=float, default=3.0)
    p.add_argument("--latency-ms", type=float, default=4.0)
    p.add_argument("--dir", default="", help="scratch directory [a temporary one; the model writes no data]")
    a = p.parse_args()
    model = ModelDisk(a.gbps, a.latency_ms / 1e3)
    segment.os_pwritev = model.pwritev
    print(f"modelled disk: {a.gbps:g} GB/s transfer timeline + {a.latency_ms:g} ms a request; "
          f"{a.blocks} blocks of 2 MiB a pass, 64 MiB Stores / write calls, engine copies no-ops\n")
    print("| writers | host tier | store alone GB/s | daemon: empty tier GB/s | again GB/s | daemon / store "
          "(again) | requests (most in flight) | write queue high water |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for w in (int(x) for x in a.writers.split(",")):
        for hb in (int(x) for x in a.host_blocks.split(",")):
            root = tempfile.mkdtemp(dir=a.dir or None)
            try:
                model.reset()
                alone = store_alone(root, a.blocks, w)
                model.reset()
                first, again, high = asyncio.run(daemon(os.path.join(root, "d"), a.blocks, w, hb))
                print(f"| {w} | {hb * 2} MiB | {alone:.2f} | {first:.2f} | {again:.2f} | {again / alone:.2f} | "
                      f"{model.requests} ({model.most_in_flight}) | {high} |", flush=True)
            finally:
                shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
