"""The daemon's disk pipelines against a modelled virtual disk, on any box: a CPU-box proxy of issue 13's H200
lines, where the DiskStore alone reaches the disk and the daemon does not.

    .venv/bin/python bench/disk_model.py [--parts spill,load] [--writers 4,8] [--host-blocks 128,512]
                                         [--gbps 3.0] [--latency-ms 4]

The model sits at the segment I/O boundary (kvservice.disk.segment.os_pwritev / os_preadv, where the
fault tests inject): no byte moves; each request, read or write, takes its turn on one shared transfer
timeline of --gbps, plus a fixed --latency-ms, so throughput grows with the requests in flight up to
--gbps, and reads and writes share it, as on the H200's virtual disk (raw sweep: ~1.3-1.7 GB/s for one
stream of 4 MiB requests, ~3 GB/s written and ~2.3 read with 8-32 requests in flight). The engine copies
are no-ops and read-back checksums are not computed (a 2-core box would time its own copies and CRCs,
not the pipeline). Model figures, not a disk's: they show where a pipeline waits.

spill  For each --writers x --host-blocks (2 MiB blocks): --blocks spilled by DiskStore.write alone
       (--writers threads, 64 MiB calls, as bench/disk_tier.py's store part), and by an in-process
       BlockCache (writer_threads = --writers, a host tier of --host-blocks, a disk tier with room for
       both passes) fed 64 MiB Stores one after another, twice (into an empty disk tier, then new
       hashes again). GB/s, daemon / store alone, requests (most
       in flight), the write queue's high water.
load   --blocks stored (all but the host tier's worth spill), then the spilled ones loaded back in 64 MiB
       Loads, half one after another (depth 1), half four in flight (depth 4), three ways: into the host
       tier full of the last Stores' blocks, none on disk yet, with onboard_disk_hits "always" (the
       default: a Load's disk blocks land in scratch and are onboarded after the reply, spilling the
       blocks they replace: a write per read) and "clean" (served only); and after a restart of the
       daemon on the same disk (empty host tier: every block lands in a free slot). Beside them the
       same blocks read by DiskStore.read alone, 64 MiB calls, 1 and 4 threads.
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
from kvservice.disk import store as disk_store  # noqa: E402
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

    def request(self, fd: int, bufs, offset: int) -> int:
        """os.pwritev / os.preadv's signature: the bytes of `bufs` moved (none really are)."""
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


def _config(root: str, blocks: int, writers: int, host_blocks: int, onboard: str = "always",
            disk_factor: float = 1.3) -> Config:
    """The model's daemon: a disk tier of disk_factor x `blocks` 2 MiB blocks under root/disk."""
    return replace(Config(), socket_path=os.path.join(root, "kv.sock"), host_capacity_bytes=host_blocks * BLOCK,
                   disk_path=os.path.join(root, "disk"),
                   disk_capacity_bytes=disk_capacity_for(int(blocks * disk_factor), BLOCK),
                   max_batch_blocks=8192, io_backend="posix", writer_threads=writers, reader_threads=writers,
                   write_queue_depth=1024, onboard_disk_hits=onboard)


async def _engine(cache: BlockCache) -> tuple[Pool, str]:
    pool = Pool(num_blocks=PER_STORE * 5, block_bytes=BLOCK)
    sid = cache.open_session(ns_spec("model"), pool.spec, CANARY, "bench/disk_model.py").session_id
    mem = cache._sessions.get(sid).memory
    mem.gather_into = lambda block_ids, arena, offsets: [0] * len(block_ids)  # checksum 0: see _no_verify
    mem.scatter_from = lambda block_ids, arena, offsets: None
    mem.scatter = lambda block_ids, srcs: None
    return pool, sid


async def daemon(root: str, blocks: int, writers: int, host_blocks: int) -> tuple[float, float, int]:
    """The spill part's daemon: two passes of `blocks` 64 MiB Stores; (GB/s first, GB/s again, write queue high water)."""
    os.makedirs(os.path.join(root, "disk"))
    cache = BlockCache(_config(root, blocks, writers, host_blocks, disk_factor=2.5), SystemClock())
    await cache.start()
    pool, sid = await _engine(cache)
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


async def _loads(cache: BlockCache, sid: str, hashes: list[bytes], depth: int) -> float:
    ids = list(range(PER_STORE * 4, PER_STORE * 5))
    pending: list[asyncio.Future] = []
    t0 = time.perf_counter()
    for lo in range(0, len(hashes), PER_STORE):
        pending.append(asyncio.ensure_future(cache.load(sid, b"".join(hashes[lo:lo + PER_STORE]), ids)))
        while len(pending) >= depth or (pending and lo + PER_STORE >= len(hashes)):
            res = await pending.pop(0)
            assert all(r.status == 1 and r.tier == 3 for r in res), [r.message for r in res][:2]
    return len(hashes) * BLOCK / (time.perf_counter() - t0) / 1e9


async def load_case(root: str, blocks: int, writers: int, host_blocks: int, model: "ModelDisk") -> dict:
    """GB/s at depth 1 and 4 for: dirty host tier + always, dirty + clean, restarted; and DiskStore.read alone."""
    out: dict[str, tuple[float, float]] = {}
    hashes = [h(i, "model") for i in range(blocks)]
    spilled = hashes[: blocks - host_blocks]
    half = len(spilled) // 2
    for mode in ("always", "clean", "restarted"):
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(os.path.join(root, "disk"))
        cfg = _config(root, blocks, writers, host_blocks, "always" if mode == "restarted" else mode)
        cache = BlockCache(cfg, SystemClock())
        await cache.start()
        pool, sid = await _engine(cache)
        for lo in range(0, blocks, PER_STORE):
            res = await cache.store(sid, b"".join(hashes[lo:lo + PER_STORE]), list(range(PER_STORE)))
            assert all(r.status == 1 for r in res), res[0]
        await cache.tiers.drain()
        if mode == "restarted":
            await cache.close_session(sid)
            await cache.drain_and_stop()
            pool.close()
            cache = BlockCache(cfg, SystemClock())
            await cache.start()
            pool, sid = await _engine(cache)
        model.reset()
        out[mode] = (await _loads(cache, sid, spilled[:half], 1), await _loads(cache, sid, spilled[half:], 4))
        out[mode + "_requests"] = (model.requests, model.most_in_flight)
        if mode == "restarted":
            st = cache.tiers.segments.store
            index = cache.tiers.index.namespace(cache._sessions.get(sid).namespace)
            locs = [index[x].disk_loc for x in spilled]
            bufs = [segment.aligned_buffer(PER_STORE * BLOCK) for _ in range(4)]
            lengths = np.full(PER_STORE, BLOCK, dtype=np.int64)
            offsets = np.arange(PER_STORE, dtype=np.int64) * BLOCK

            def read(k: int, lo: int) -> None:
                got = st.read(locs[lo:lo + PER_STORE], HostSlots(bufs[k], offsets, lengths))
                assert not any(got), got

            alone = []
            for threads, part in ((1, locs[:half]), (4, locs[half:])):
                base = 0 if threads == 1 else half
                t0 = time.perf_counter()
                with ThreadPoolExecutor(threads) as ex:
                    list(ex.map(lambda lo: read(((lo - base) // PER_STORE) % threads, lo),
                                range(base, base + len(part), PER_STORE)))
                alone.append(len(part) * BLOCK / (time.perf_counter() - t0) / 1e9)
            out["store_alone"] = tuple(alone)
        await cache.close_session(sid)
        await cache.drain_and_stop()
        pool.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="spill,load")
    p.add_argument("--writers", default="4,8", help="the daemon's writer (and reader) threads")
    p.add_argument("--host-blocks", default="128,512", help="the daemon's host tier, in 2 MiB blocks")
    p.add_argument("--blocks", type=int, default=1024, help="blocks stored per pass (2 MiB each)")
    p.add_argument("--gbps", type=float, default=3.0)
    p.add_argument("--latency-ms", type=float, default=4.0)
    p.add_argument("--dir", default="", help="scratch directory [a temporary one; the model moves no data]")
    a = p.parse_args()
    parts = set(a.parts.split(","))
    model = ModelDisk(a.gbps, a.latency_ms / 1e3)
    segment.os_pwritev = segment.os_preadv = model.request
    disk_store._crc_reader = lambda slots, views: (lambda i: 0)  # _no_verify: stored with checksum 0, bytes unread
    print(f"modelled disk: {a.gbps:g} GB/s transfer timeline shared by reads and writes + {a.latency_ms:g} ms a "
          f"request; {a.blocks} blocks of 2 MiB, 64 MiB Stores / Loads / calls, engine copies no-ops\n")
    if "spill" in parts:
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
        print()
    if "load" in parts:
        print("Cold Loads of the spilled blocks, GB/s at depth 1 / depth 4 (requests at the modelled disk, most in "
              "flight):\n")
        print("| threads | host tier | DiskStore.read alone, 1 / 4 threads | dirty host tier, always | "
              "dirty, clean | restarted (empty host tier) |")
        print("| ---: | ---: | --- | --- | --- | --- |")
        for w in (int(x) for x in a.writers.split(",")):
            for hb in (int(x) for x in a.host_blocks.split(",")):
                root = tempfile.mkdtemp(dir=a.dir or None)
                try:
                    r = asyncio.run(load_case(os.path.join(root, "d"), a.blocks, w, hb, model))
                    cell = {k: f"{r[k][0]:.2f} / {r[k][1]:.2f} ({r[k + '_requests'][0]}, {r[k + '_requests'][1]})"
                            for k in ("always", "clean", "restarted")}
                    print(f"| {w} | {hb * 2} MiB | {r['store_alone'][0]:.2f} / {r['store_alone'][1]:.2f} | "
                          f"{cell['always']} | {cell['clean']} | {cell['restarted']} |", flush=True)
                finally:
                    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
