"""The daemon core's own per-block cost: BlockCache + a shared-memory pool in one process (no gRPC),
beside the bare copy it wraps, measured in the same run.

    .venv/bin/python bench/core_overhead.py [--sizes 4096,65536] [--batches 1024,4096] [--rounds 7] [--blocks-per-key 1,4]

For each block size and batch: Store of new hashes (the host tier holds 3 batches, so from the
4th round on every Store also evicts a batch: dropped, no disk), Store of hashes already stored,
Load of host hits, Lookup, and Prefetch of host blocks (lease taken). The limits beside them are
the copies those calls make, run on the same pool, arena slots and block ids: gather_into (engine
-> host slots, with the CRC32C of every block, which a Store must compute) and scatter_from
(host slots -> engine). Then the same Store and Load again with the session's copies replaced by
no-ops (the same slots, ids and thread hop; checksums 0): what is left is the core's own
bookkeeping ("store core", "load core"), measured directly rather than as a difference of two
noisy timings, as wall time and as the event loop thread's CPU time ("cpu": what the core costs
the loop, robust against other processes on a busy box). Prints us/block, best of `--rounds`.
Last, the same Store and Load with each copy replaced by a modeled DMA: a sleep of bytes /
--dma-gbps in the copy thread (GIL released, as a device copy waits on its stream; one copy at a
time each way, as through one copy engine): "x dma" is
that modeled copy time over the call's wall time, a CPU-box proxy of the Store / D2H and Load /
H2D ratios of bench/gpu_bandwidth.py (what the core leaves un-overlapped with the copies).
"x dma+launch" adds the copy thread's own launch work, which holds the GIL against the event loop
on a GPU host: per 32 MiB chunk --launch-gather / --launch-scatter ("us a chunk,us a row") of Python
busy work before the modeled DMA (which starts once the first chunk is launched and the copy
engine is free). The defaults come from the H100 call timelines (BENCHMARKS.md, KVTUNE_TRACE):
gather.start -> gather.queued ~0.14 ms a chunk of 2 MiB rows, 0.3-0.45 ms a chunk of 512 x 64 KiB;
scatter ~0.13 and ~0.23.
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

from kvservice.core.cache import BlockCache  # noqa: E402
from kvservice.core.clock import FakeClock  # noqa: E402
from kvservice.ops.config import Config  # noqa: E402
from tests.corekit import CANARY, Pool, h, ns_spec  # noqa: E402


def ids_of(ids: list[int], per_key: int):
    """A call's engine block ids as the core passes them to the session's memory: KeyIds for k > 1."""
    if per_key == 1:
        return ids
    import numpy as np

    from kvservice.memory.key_groups import KeyIds
    return KeyIds(np.asarray(ids, dtype=np.int64).reshape(-1, per_key))


def best(fn, rounds: int) -> float:
    out = []
    for r in range(rounds):
        t0 = time.perf_counter()
        fn(r)
        out.append(time.perf_counter() - t0)
    return min(out)


async def measure(block_bytes: int, batch: int, rounds: int, tmp: str, dma_gbps: float,
                  copies: bool = True, launch_gather: tuple[float, float] = (130.0, 0.4),
                  launch_scatter: tuple[float, float] = (130.0, 0.2), per_key: int = 1) -> dict[str, float]:
    cfg = replace(Config(), socket_path=os.path.join(tmp, "kv.sock"), host_capacity_bytes=3 * batch * block_bytes,
                  disk_path="", disk_capacity_bytes=0, max_batch_blocks=max(8192, batch), io_backend="posix",
                  prefetch_share=1.0, prefetch_total_share=1.0, pin_lease_seconds=1.0, lease_seconds=1e9)
    clock = FakeClock()
    cache = BlockCache(cfg, clock)
    await cache.start()
    pool = Pool(num_blocks=batch, block_bytes=block_bytes, blocks_per_key=per_key)
    pool.shm.buf[:] = os.urandom(batch * block_bytes)
    sid = cache.open_session(ns_spec(f"bench-{block_bytes}"), pool.spec, CANARY, "bench").session_id
    outer = cache._sessions.get(sid).memory  # KeyGroupMemory when per_key > 1: its own work stays in the rows
    mem = getattr(outer, "inner", outer)  # the copies below are replaced (or timed) at the pool's own memory
    keys = batch // per_key  # hashes a call names
    call_ids = ids_of(list(range(batch)), per_key)
    ids = list(range(batch))
    loop_time = {}
    seq = [0]

    def fresh() -> bytes:
        seq[0] += 1
        return b"".join(h(i, f"{seq[0]}") for i in range(keys))

    async def timed(name: str, make, call, check=None) -> None:
        times, cpu = [], []
        for _ in range(rounds):
            arg = make()
            t0, c0 = time.perf_counter(), time.thread_time()
            res = await call(arg)
            times.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)  # the event loop thread's own CPU time
            if check is not None:
                check(res)
        loop_time[name] = min(times)
        loop_time[name + "_cpu"] = min(cpu)

    last: list[bytes] = [b""]

    def new_batch() -> bytes:
        last[0] = fresh()
        return last[0]

    def all_ok(code):
        def check(res):
            bad = [s for s in (res.status if hasattr(res, "status") else [r.status for r in res]) if s != code]
            assert not bad, f"{len(bad)} blocks not {code}: {bad[:3]}"
        return check

    real_gather, real_scatter = mem.gather_into, mem.scatter_from

    def stand_in(copy):  # a stand-in copy as the memory's own: it signals `enqueued` (SIGNALS_ENQUEUED)
        def call(block_ids, arena, offsets, enqueued=None):
            if enqueued is not None:
                enqueued()
            return copy(block_ids)
        return call

    noop_gather = stand_in(lambda ids: [0] * len(ids))
    noop_scatter = stand_in(lambda ids: None)
    if not copies:  # --no-copies: the real copies' rows are left out (nan)
        mem.gather_into, mem.scatter_from = noop_gather, noop_scatter
    for _ in range(3):  # warm up: the arena's segments, the copy threads
        await cache.store(sid, new_batch(), ids)
    if copies:
        await timed("store", new_batch, lambda hs: cache.store(sid, hs, ids), all_ok(1))
    await timed("store_hit", lambda: last[0], lambda hs: cache.store(sid, hs, ids), all_ok(2))
    if copies:
        await timed("load", lambda: last[0], lambda hs: cache.load(sid, hs, ids), all_ok(1))

    async def lookup(hs):
        out = cache.lookup(sid, hs)
        assert len(out) == keys
        return out

    await timed("lookup", lambda: last[0], lookup)

    def next_prefetch() -> bytes:
        clock.advance(2.0)  # the last round's leases ran out
        cache.reap_sessions()
        return last[0]

    await timed("prefetch", next_prefetch, lambda hs: cache.prefetch(sid, hs), all_ok(2))
    clock.advance(2.0)
    cache.reap_sessions()
    # the core alone: the same calls with no-op copies
    mem.gather_into, mem.scatter_from = noop_gather, noop_scatter
    await timed("store_core", new_batch, lambda hs: cache.store(sid, hs, ids), all_ok(1))
    await timed("load_core", lambda: last[0], lambda hs: cache.load(sid, hs, ids), all_ok(1))

    d2h, h2d = threading.Lock(), threading.Lock()  # one copy engine each way: copies in flight share it

    def dma(n: int, engine: threading.Lock) -> None:  # a device copy of n blocks: a wait, no GIL
        with engine:
            time.sleep(n * block_bytes / (dma_gbps * 1e9))

    mem.gather_into = stand_in(lambda ids: (dma(len(ids), d2h), [0] * len(ids))[1])
    mem.scatter_from = stand_in(lambda ids: dma(len(ids), h2d))
    await timed("store_dma", new_batch, lambda hs: cache.store(sid, hs, ids), all_ok(1))
    await timed("load_dma", lambda: last[0], lambda hs: cache.load(sid, hs, ids), all_ok(1))
    loop_time["dma"] = batch * block_bytes / (dma_gbps * 1e9)
    # the same with the copy thread's launch work modeled too: per 32 MiB chunk, launch[0] us + launch[1] us a
    # row of Python holding the GIL (as torch / CuPy launches do, switch interval and all), the DMA of the copy
    # starting once its first chunk is launched and the engine is free; enqueued() once every chunk is launched
    engines = {"d2h": [threading.Lock(), 0.0], "h2d": [threading.Lock(), 0.0]}  # lock, time the engine is free

    def launched_copy(n: int, kind: str, enqueued, cost: tuple[float, float]) -> None:
        per = max(1, (32 << 20) // block_bytes)
        chunks = [min(per, n - lo) for lo in range(0, n, per)]
        lock, free = engines[kind], None

        def busy(us: float) -> None:  # Python holding the GIL (given up at each switch interval)
            end = time.perf_counter() + us * 1e-6
            while time.perf_counter() < end:
                pass
        busy(cost[0] + cost[1] * chunks[0])
        with lock[0]:
            start = max(time.perf_counter(), lock[1])
            lock[1] = free = start + n * block_bytes / (dma_gbps * 1e9)
        for k in chunks[1:]:
            busy(cost[0] + cost[1] * k)
        if enqueued is not None:
            enqueued()
        time.sleep(max(0.0, free - time.perf_counter()))

    def modeled(kind: str, cost: tuple[float, float], result):
        def call(block_ids, arena, offsets, enqueued=None):
            launched_copy(len(block_ids), kind, enqueued, cost)
            return result(block_ids)
        return call

    mem.gather_into = modeled("d2h", launch_gather, lambda b: [0] * len(b))
    mem.scatter_from = modeled("h2d", launch_scatter, lambda b: None)
    await timed("store_launch", new_batch, lambda hs: cache.store(sid, hs, ids), all_ok(1))
    await timed("load_launch", lambda: last[0], lambda hs: cache.load(sid, hs, ids), all_ok(1))
    mem.gather_into, mem.scatter_from = real_gather, real_scatter
    if copies:
        await cache.store(sid, new_batch(), ids)  # real bytes in the slots the copies below use
        # the copies themselves, on the same slots and block ids
        t = cache.tiers
        d = t.index.namespace(cache._sessions.get(sid).namespace)
        offsets = [d[last[0][i * 32:(i + 1) * 32]].slot for i in range(keys)]
        arena = cache.arena
        loop_time["gather_into"] = best(lambda r: outer.gather_into(call_ids, arena, offsets), rounds)
        loop_time["scatter_from"] = best(lambda r: outer.scatter_from(call_ids, arena, offsets), rounds)
    else:
        for k in ("store", "load", "gather_into", "scatter_from"):
            loop_time[k] = float("nan")
    problems = cache.audit()
    assert not problems, problems
    await cache.close_session(sid)
    await cache.drain_and_stop()
    pool.close()
    return loop_time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4096,65536")
    p.add_argument("--batches", default="1024,4096")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--no-copies", action="store_true", help="leave out the rows of the real copies (faster)")
    p.add_argument("--dma-gbps", type=float, default=55.0, help="the modeled copy's GB/s (H200 pinned D2H/H2D: ~55)")
    p.add_argument("--launch-gather", default="130,0.4",
                   help="modeled launch work of a Store's copy, 'us a 32 MiB chunk,us a row' (H100 trace)")
    p.add_argument("--launch-scatter", default="130,0.2", help="the same for a Load's copy")
    p.add_argument("--blocks-per-key", default="1", help="comma list: each size also with k engine blocks a "
                   "daemon block (blocks_per_key; figures stay per engine block)")
    a = p.parse_args()
    lg = tuple(float(x) for x in a.launch_gather.split(","))
    ls = tuple(float(x) for x in a.launch_scatter.split(","))
    sizes = [int(x) for x in a.sizes.split(",")]
    batches = [int(x) for x in a.batches.split(",")]
    print("us per block, best of", a.rounds, "rounds; core: the call with no-op copies (same run)")
    print()
    print("| block | batch | gather_into | store | store core | store core cpu | scatter_from | load | load core "
          "| load core cpu | store_hit | store_hit cpu | lookup | lookup cpu | prefetch | prefetch cpu "
          "| store x dma | load x dma | store x dma+launch | load x dma+launch |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for bb, n, per_key in [(bb, n, k) for bb in sizes for n in batches
                               for k in (int(x) for x in a.blocks_per_key.split(","))]:
            r = asyncio.run(measure(bb, n, a.rounds, tmp, a.dma_gbps, not a.no_copies, lg, ls, per_key))
            us = {k: v / n * 1e6 for k, v in r.items()}
            label = f"{bb // 1024} KiB" + (f", {per_key} a key" if per_key > 1 else "")
            print(f"| {label} | {n} | {us['gather_into']:.2f} | {us['store']:.2f} "
                  f"| {us['store_core']:.2f} | {us['store_core_cpu']:.2f} | {us['scatter_from']:.2f} "
                  f"| {us['load']:.2f} | {us['load_core']:.2f} | {us['load_core_cpu']:.2f} "
                  f"| {us['store_hit']:.2f} | {us['store_hit_cpu']:.2f} | {us['lookup']:.2f} "
                  f"| {us['lookup_cpu']:.2f} | {us['prefetch']:.2f} "
                  f"| {us['prefetch_cpu']:.2f} | {r['dma'] / r['store_dma']:.2f} "
                  f"| {r['dma'] / r['load_dma']:.2f} | {r['dma'] / r['store_launch']:.2f} "
                  f"| {r['dma'] / r['load_launch']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
