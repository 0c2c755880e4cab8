"""The daemon's disk pipelines against a modelled virtual disk calibrated to the H200's raw sweeps, on any
box: a CPU-box proxy of issue 13's H200 lines, where the DiskStore alone reaches the disk and the daemon does not.

    .venv/bin/python bench/disk_model.py [--parts fit,sweep,spill,load] [--writers 4,8] [--host-blocks 128,512]

The model sits at the segment I/O boundary (kvservice.disk.segment.os_pwritev / os_preadv, where the fault
tests inject): no byte moves (so a read leaves a fresh scratch buffer's pages unfaulted; see BENCHMARKS).
A request of n bytes takes n / gbps + per_request_s of one transfer timeline that reads and writes share
(first come, first served), then completes latency_s + n / stream_gbps later (Curve). So throughput grows with
the requests in flight up to gbps, a lone stream moves at most ~stream_gbps, and small requests pay
per_request_s each. The engine copies are no-ops (the host arena is faulted in once, as the engine's D2H
copies would) and read-back checksums are not computed (a 2-core box would time its own copies and CRCs).

Calibration (--parts fit): the median of each (threads, request size) cell of the four H200 raw sweeps in
bench/results/h200-2026-12-02-disk/ and h200-2026-12-02-issue10-13/disk/ (bench/disk_tier.py's raw part: 1 GiB
a cell, each thread its share in sequential requests), fitted by least squares on log GB/s (Nelder-Mead over
the log parameters, three starts) with a virtual-time simulation of exactly these rules (simulate()):
    read:  1.91 GB/s shared + 0.163 ms a request, then n / 0.447 GB/s     (rms log error 0.12)
    write: 2.57 GB/s shared, then 1.62 ms                                  (rms log error 0.06)
The sweeps themselves scatter by a median 0.09 (read) / 0.05 (write) in log around their own cell medians, so
the fit is about as close as the data allow. What the grid says, and the model keeps: writes are flat (~2.4-2.9
GB/s from 4 x 1 MiB up: request size and depth hardly matter); reads are ~1.3-1.5 GB/s with 4 in flight and
~1.5-2.1 with 8 or more, 1 MiB requests ~15% below 4-32 MiB ones. The model misses the top read cells (16-32 x
16-32 MiB: 1.9-2.1 measured, 1.67-1.76 modelled) and so its own read limit (best cell, 1.78 GB/s) is lower than
the H200's (2.13 median-grid best, 2.30 the best single cell of one sweep); every ratio it prints is against its
own sweep, as bench/disk_tier.py's are against the same run's. --parts sweep prints the measured medians, the
simulated sweep and the sweep run by real threads on the modelled disk side by side.

spill  For each --writers x --host-blocks (2 MiB blocks): --blocks spilled by DiskStore.write alone
       (--writers threads, 64 MiB calls, as bench/disk_tier.py's store part), and by an in-process
       BlockCache (writer_threads = --writers, a host tier of --host-blocks, a disk tier with room for
       both passes) fed 64 MiB Stores one after another, twice (into an empty disk tier, then new
       hashes again). GB/s, daemon / store alone, and each one's writes at the modelled disk: requests x
       median size, mean requests in flight while any is (most); the write queue's high water.
load   --blocks stored (all but the host tier's worth spill), then the spilled ones loaded back in 64 MiB
       Loads, half one after another (depth 1), half four in flight (depth 4), three ways: into the host
       tier full of the last Stores' blocks, none on disk yet, with onboard_disk_hits "always" (the
       default: a Load's disk blocks land in scratch and are onboarded after the reply, spilling the
       blocks they replace: a write per read) and "clean" (served only); and after a restart of the
       daemon on the same disk (empty host tier: every block lands in a free slot). Beside them the
       same blocks read by DiskStore.read alone, 64 MiB calls, 1 and 4 threads. Under each, the reads
       at the modelled disk (depth 1 / depth 4) and the writes during the depth-4 half.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections import Counter
from dataclasses import replace
from typing import NamedTuple

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

MiB = 1 << 20
BLOCK = 2 << 20
SWEEP_THREADS = (4, 8, 16, 32)
SWEEP_MIB = (1, 4, 8, 16, 32)
PER_STORE = 32  # blocks per Store and per DiskStore.write call: 64 MiB


class Curve(NamedTuple):
    """One direction of the modelled disk. A request of n bytes takes n / gbps + per_request_s of the
    disk's one transfer timeline (shared by reads and writes, first come first served), then completes
    latency_s + n / stream_gbps later (its own latency: a stream of one request at a time moves at most
    about stream_gbps, however idle the disk)."""

    gbps: float
    per_request_s: float
    stream_gbps: float
    latency_s: float

    def __str__(self) -> str:
        return (f"{self.gbps:.2f} GB/s shared + {self.per_request_s * 1e3:.3f} ms a request, then "
                f"{self.latency_s * 1e3:.3f} ms + n / {self.stream_gbps:.3f} GB/s")


# Fitted (--fit) to the median of each cell of the four H200 raw sweeps (bench/results/h200-2026-12-02-disk/
# and h200-2026-12-02-issue10-13/disk/, O_DIRECT, threads 4-32 x requests 1-32 MiB, 1 GiB a cell)
H200_READ = Curve(1.91, 0.163e-3, 0.447, 0.0)
H200_WRITE = Curve(2.57, 0.0, 1e6, 1.62e-3)
H200_SWEEPS = ("bench/results/h200-2026-12-02-disk/disk_tier.json",
               "bench/results/h200-2026-12-02-issue10-13/disk/disk_tier.json")


class ModelDisk:
    """The modelled disk (see Curve). Counts, per direction, requests, bytes, request sizes, the most
    in flight and the time-weighted requests in flight while any is (what a pipeline keeps busy)."""

    def __init__(self, read: Curve = H200_READ, write: Curve = H200_WRITE) -> None:
        self.curves = {"read": read, "write": write}
        self._lock = threading.Lock()
        self._free_at = 0.0
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.stats = {op: {"requests": 0, "bytes": 0, "sizes": Counter(), "in_flight": 0, "most": 0,
                               "area": 0.0, "busy": 0.0, "since": 0.0} for op in ("read", "write")}

    @property
    def requests(self) -> int:
        return sum(st["requests"] for st in self.stats.values())

    @property
    def most_in_flight(self) -> int:
        return max(st["most"] for st in self.stats.values())

    def _account(self, st: dict, now: float, delta: int) -> None:
        if st["in_flight"]:
            st["area"] += st["in_flight"] * (now - st["since"])
            st["busy"] += now - st["since"]
        st["since"] = now
        st["in_flight"] += delta
        st["most"] = max(st["most"], st["in_flight"])

    def request(self, op: str, bufs) -> int:
        n = sum(memoryview(b).nbytes for b in bufs)
        c = self.curves[op]
        with self._lock:
            now = time.perf_counter()
            start = max(now, self._free_at)
            self._free_at = start + n / (c.gbps * 1e9) + c.per_request_s
            done = self._free_at + c.latency_s + n / (c.stream_gbps * 1e9)
            st = self.stats[op]
            st["requests"] += 1
            st["bytes"] += n
            st["sizes"][n] += 1
            self._account(st, now, +1)
        wait = done - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        with self._lock:
            self._account(self.stats[op], time.perf_counter(), -1)
        return n

    def pwritev(self, fd: int, bufs, offset: int) -> int:
        """os.pwritev's signature: the bytes of `bufs` written (none really are)."""
        return self.request("write", bufs)

    def preadv(self, fd: int, bufs, offset: int) -> int:
        return self.request("read", bufs)

    def summary(self, op: str) -> str:
        """'requests x median size MiB, mean in flight while busy (most)' for op, or '-'."""
        st = self.stats[op]
        if not st["requests"]:
            return "-"
        sizes = sorted(st["sizes"].elements())
        med = sizes[len(sizes) // 2] / MiB
        mean = st["area"] / st["busy"] if st["busy"] else 0.0
        return f"{st['requests']} x {med:g} MiB, {mean:.1f} ({st['most']})"


def simulate(curve: Curve, threads: int, request: int, nbytes: int = 1 << 30) -> float:
    """GB/s of a raw-sweep cell (bench/disk_tier.py _raw_run: `threads` threads, each its share of
    nbytes in `request`-byte requests one after another) on the modelled disk, in virtual time."""
    per = nbytes // threads // request
    if per == 0:
        return 0.0
    ready = [0.0] * threads  # a thread issues its next request when its last completes
    heap = [(0.0, t) for t in range(threads)]
    left = [per] * threads
    free_at = end = 0.0
    while heap:
        now, t = heapq.heappop(heap)
        if not left[t]:
            end = max(end, now)
            continue
        left[t] -= 1
        free_at = max(now, free_at) + request / (curve.gbps * 1e9) + curve.per_request_s
        ready[t] = free_at + curve.latency_s + request / (curve.stream_gbps * 1e9)
        heapq.heappush(heap, (ready[t], t))
    return per * request * threads / end / 1e9


def measured_grid(paths: list[str]) -> tuple[dict, int]:
    """{(op, threads, MiB): median GB/s over the sweeps in the bench/disk_tier.py JSON files}, sweeps."""
    cells: dict[tuple[str, int, int], list[float]] = {}
    sweeps = 0
    for path in paths:
        with open(path) as f:
            for raw in json.load(f)["raw"]:
                sweeps += 1
                for r in raw["rows"]:
                    cells.setdefault((r["op"], r["threads"], r["request"] // MiB), []).append(r["gbps"])
    return {k: float(np.median(v)) for k, v in cells.items()}, sweeps


def _nelder_mead(f, x0: np.ndarray, iters: int = 400) -> tuple[np.ndarray, float]:
    pts = [np.array(x0, float)] + [np.array(x0, float) + 0.7 * np.eye(len(x0))[i] for i in range(len(x0))]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = np.argsort(vals)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        c = np.mean(pts[:-1], axis=0)
        xr = c + (c - pts[-1])
        fr = f(xr)
        if fr < vals[0]:
            xe = c + 2 * (c - pts[-1])
            fe = f(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = c + 0.5 * (pts[-1] - c)
            fc = f(xc)
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:
                pts = [pts[0] + 0.5 * (q - pts[0]) for q in pts]
                vals = [f(q) for q in pts]
    i = int(np.argmin(vals))
    return pts[i], vals[i]


def fit(grid: dict, op: str) -> tuple[Curve, float]:
    """The Curve whose simulated sweep is nearest the measured medians (least squares of log GB/s,
    Nelder-Mead over log parameters, a few starts); and its rms log error."""
    cells = [(t, m) for (o, t, m) in grid if o == op]
    want = np.log([grid[(op, t, m)] for t, m in cells])

    def curve(x) -> Curve:
        g, c1, r, c2 = np.exp(x)
        return Curve(g, c1, r, c2)

    def loss(x) -> float:
        cv = curve(x)
        got = np.array([simulate(cv, t, m * MiB) for t, m in cells])
        return float(np.mean((np.log(np.maximum(got, 1e-9)) - want) ** 2))

    best = None
    for x0 in ([2.5, 1e-4, 0.5, 1e-3], [2.0, 1e-5, 2.0, 1e-4], [2.0, 5e-4, 0.3, 1e-5]):
        x, v = _nelder_mead(loss, np.log(x0))
        if best is None or v < best[1]:
            best = (x, v)
    return curve(best[0]), float(np.sqrt(best[1]))


def sweep_lines(grid_of, title: str) -> list[str]:
    """A Markdown sweep table; grid_of(op, threads, MiB) -> GB/s."""
    out = [f"| {title} | threads | " + " | ".join(f"{m} MiB" for m in SWEEP_MIB) + " | best |",
           "| --- | ---: |" + " ---: |" * (len(SWEEP_MIB) + 1)]
    for op in ("write", "read"):
        best = max(grid_of(op, t, m) for t in SWEEP_THREADS for m in SWEEP_MIB)
        for t in SWEEP_THREADS:
            out.append(f"| {op} | {t} | " + " | ".join(f"{grid_of(op, t, m):.2f}" for m in SWEEP_MIB)
                       + f" | {best:.2f} |")
    return out


def threaded_sweep(model: ModelDisk, nbytes: int = 1 << 30) -> dict:
    """The raw sweep run on the modelled disk by real threads through segment.write_all / read_all
    (what the daemon's requests go through), as bench/disk_tier.py's _raw_run issues it."""
    buf = segment.aligned_buffer(32 * MiB)  # the model moves no byte: one buffer serves every thread
    out = {}
    for op in ("write", "read"):
        for t in SWEEP_THREADS:
            for m in SWEEP_MIB:
                req = m * MiB
                share = nbytes // t // req * req
                view = buf[:req]

                def work(k: int) -> None:
                    for off in range(0, share, req):
                        (segment.write_all if op == "write" else segment.read_all)(-1, [view], k * share + off, "m")

                t0 = time.perf_counter()
                with ThreadPoolExecutor(t) as ex:
                    list(ex.map(work, range(t)))
                out[(op, t, m)] = share * t / (time.perf_counter() - t0) / 1e9
    return out


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
    cache.tiers.host.arena.base.numpy()[::4096] = 0  # an engine's D2H copies would have faulted the arena in
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
        one = await _loads(cache, sid, spilled[:half], 1)
        reads1 = model.summary("read")
        model.reset()
        four = await _loads(cache, sid, spilled[half:], 4)
        out[mode] = (one, four)
        out[mode + "_io"] = (reads1, model.summary("read"), model.stats["write"]["requests"])
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

            alone, io = [], []
            for threads, part in ((1, locs[:half]), (4, locs[half:])):
                base = 0 if threads == 1 else half
                model.reset()
                t0 = time.perf_counter()
                with ThreadPoolExecutor(threads) as ex:
                    list(ex.map(lambda lo: read(((lo - base) // PER_STORE) % threads, lo),
                                range(base, base + len(part), PER_STORE)))
                alone.append(len(part) * BLOCK / (time.perf_counter() - t0) / 1e9)
                io.append(model.summary("read"))
            out["store_alone"] = tuple(alone)
            out["store_alone_io"] = (*io, 0)
        await cache.close_session(sid)
        await cache.drain_and_stop()
        pool.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="sweep,spill,load", help="fit, sweep, spill, load")
    p.add_argument("--writers", default="4,8", help="the daemon's writer (and reader) threads")
    p.add_argument("--host-blocks", default="128,512", help="the daemon's host tier, in 2 MiB blocks")
    p.add_argument("--blocks", type=int, default=1024, help="blocks stored per pass (2 MiB each)")
    p.add_argument("--sweeps", default=",".join(H200_SWEEPS), help="fit: bench/disk_tier.py JSON files with raw sweeps")
    p.add_argument("--dir", default="", help="scratch directory [a temporary one; the model moves no data]")
    a = p.parse_args()
    parts = set(a.parts.split(","))
    read, write = H200_READ, H200_WRITE
    grid, sweeps = measured_grid([os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), x)
                                  if not os.path.isabs(x) else x for x in a.sweeps.split(",")])
    if "fit" in parts:
        read, e_read = fit(grid, "read")
        write, e_write = fit(grid, "write")
        print(f"fitted to the median cells of {sweeps} sweeps: read {read} (rms log error {e_read:.3f}); write "
              f"{write} ({e_write:.3f})\n")
    model = ModelDisk(read, write)
    segment.os_pwritev, segment.os_preadv = model.pwritev, model.preadv
    disk_store._crc_reader = lambda slots, views: (lambda i: 0)  # _no_verify: stored with checksum 0, bytes unread
    print(f"modelled disk: read {read}; write {write}; one transfer timeline for both; {a.blocks} blocks of 2 MiB, "
          "64 MiB Stores / Loads / calls, engine copies no-ops\n")
    if "sweep" in parts or "fit" in parts:
        sim = {(op, t, m): simulate(read if op == "read" else write, t, m * MiB)
               for op in ("write", "read") for t in SWEEP_THREADS for m in SWEEP_MIB}
        threaded = threaded_sweep(model)
        for title, g in ((f"H200, median of {sweeps} sweeps", grid), ("model, virtual time", sim),
                         ("model, threads on this box", threaded)):
            print("\n".join(sweep_lines(lambda op, t, m: g[(op, t, m)], title)) + "\n")
        for op in ("write", "read"):
            err = [np.log(threaded[k] / grid[k]) for k in grid if k[0] == op]
            print(f"{op}: model (threads) / H200 median per cell: rms log error {np.sqrt(np.mean(np.square(err))):.3f}, "
                  f"worst {np.exp(max(err, key=abs)):.2f}x")
        print()
        limit = {op: max(v for k, v in threaded.items() if k[0] == op) for op in ("write", "read")}
        print(f"the model's own raw limit (best cell, threads): write {limit['write']:.2f}, read {limit['read']:.2f} GB/s\n")
    if "spill" in parts:
        print("| writers | host tier | store alone GB/s | its writes: requests x size, mean in flight (most) | daemon: "
              "empty tier GB/s | again GB/s | daemon / store (again) | daemon's writes | write queue high water |")
        print("| ---: | ---: | ---: | --- | ---: | ---: | ---: | --- | ---: |")
        for w in (int(x) for x in a.writers.split(",")):
            for hb in (int(x) for x in a.host_blocks.split(",")):
                root = tempfile.mkdtemp(dir=a.dir or None)
                try:
                    model.reset()
                    alone = store_alone(root, a.blocks, w)
                    io_alone = model.summary("write")
                    model.reset()
                    first, again, high = asyncio.run(daemon(os.path.join(root, "d"), a.blocks, w, hb))
                    print(f"| {w} | {hb * 2} MiB | {alone:.2f} | {io_alone} | {first:.2f} | {again:.2f} | "
                          f"{again / alone:.2f} | {model.summary('write')} | {high} |", flush=True)
                finally:
                    shutil.rmtree(root, ignore_errors=True)
        print()
    if "load" in parts:
        print("Cold Loads of the spilled blocks, GB/s at depth 1 / depth 4; under each, the reads at the modelled "
              "disk at depth 1 / depth 4 (requests x median size, mean in flight while busy (most)) and the "
              "writes at depth 4:\n")
        print("| threads | host tier | DiskStore.read alone, 1 / 4 threads | dirty host tier, always | "
              "dirty, clean | restarted (empty host tier) |")
        print("| ---: | ---: | --- | --- | --- | --- |")
        for w in (int(x) for x in a.writers.split(",")):
            for hb in (int(x) for x in a.host_blocks.split(",")):
                root = tempfile.mkdtemp(dir=a.dir or None)
                try:
                    r = asyncio.run(load_case(os.path.join(root, "d"), a.blocks, w, hb, model))
                    keys = ("store_alone", "always", "clean", "restarted")
                    print(f"| {w} | {hb * 2} MiB | " + " | ".join(f"{r[k][0]:.2f} / {r[k][1]:.2f}" for k in keys) + " |")
                    print("| | | " + " | ".join(f"{r[k + '_io'][0]} / {r[k + '_io'][1]}; writes {r[k + '_io'][2]}"
                                                  for k in keys) + " |", flush=True)
                finally:
                    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
