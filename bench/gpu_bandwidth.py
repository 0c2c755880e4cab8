#!/usr/bin/env python3
"""GPU data-path bandwidth on a CUDA host, as ratios against limits measured in the same run (DESIGN §7).

    python bench/gpu_bandwidth.py [--sizes 2048,256,64] [--batch-mib 2048,4096] [--layouts layer-first,block-contiguous]
                                  [--reps 5] [--disk-dir DIR] [--io-threads 8] [--out results.json] [--profile DIR]
                                  [--skip datapath,host,disk] [--blocks-per-key 1,4,16]

This process is the engine: it owns a CudaKVPool (random bytes) and talks to real daemons
(`python -m kvservice serve --io-backend auto`) through engine_client over their Unix sockets.
For each batch size (MiB), each layout (block-contiguous; layer-first with 32 layers = 64
regions: vLLM's paged layout of an 8B model) and block size (KiB), one batch per call, blocks in
random order:

  limits      pinned cudaMemcpy H2D and D2H of one batch (torch copy_ between a pinned and a device
              tensor, CUDA events; best of a sweep over piece sizes), and raw O_DIRECT parallel reads
              and writes of the disk directory (--io-threads threads, 4 MiB requests and requests of
              the block size).
  datapath    a helper process (the daemon's role, no gRPC) times the same batches through the copy
              path alone (CudaEngineMemory.gather_into / scatter_from on a pinned HostArena), then
              through an in-process BlockCache (copy path + bookkeeping): the gap to the limit splits
              into copy path, cache and gRPC + client. --profile writes a torch.profiler table there.
  host tier   Store and Load through a fresh daemon per batch size (engine view: KVClient, gRPC,
              cache, copies), host tier of two batches; the first case's first Store is the fresh
              daemon's first (reported on its own), then the median of --reps after 2 warm-ups.
              Every Load is byte-checked against its source blocks. --blocks-per-key: each block size also
              with the engine's blocks k to a daemon block (KVClient(blocks_per_key=k)): rows "<layout>, k a key".
  disk tier   (first batch size) block-contiguous, host tier of one batch: Store A, then Store B pushes
              A to disk; spill GB/s runs from Store B until every spill is written and sync() returned.
              Then every block file is evicted from the page cache (posix_fadvise DONTNEED, and
              drop_caches when allowed) and Load A comes from disk: read, CRC32C-verified, copied to the GPU.
Prints Markdown tables; --out writes every figure as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import asyncio
import json
import mmap
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.daemon import Daemon as HarnessDaemon, child_env  # noqa: E402
import torch  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
LAYERS = 32  # layer-first: 2 x 32 regions, the shape of an 8B model's KV
RAW_REQ = 4 * MiB
WARMUP = 2  # rounds before the median; the first Store is reported on its own (store_first_gbps)


# ----------------------------------------------------------------------------------------------
# Limits measured in the same run


def pinned_copy_gbps(nbytes: int, reps: int) -> dict:
    """Best of a sweep over copy sizes (a quarter batch up to the whole batch, and 32 MiB pieces
    issued back to back): the limit a data path is held to must not be understated."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.random_(0, 256)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out: dict[str, float] = {}
    sweep: dict[str, dict[str, float]] = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        best = 0.0
        for piece in sorted({nbytes, max(1 << 20, nbytes // 4), min(nbytes, 32 << 20)}):
            times = []
            for i in range(reps + 2):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for lo in range(0, nbytes - piece + 1, piece):
                    dst[lo:lo + piece].copy_(src[lo:lo + piece], non_blocking=True)
                b.record()
                b.synchronize()
                if i >= 2:
                    times.append(a.elapsed_time(b) / 1e3)
            gbps = (nbytes // piece * piece) / statistics.median(times) / 1e9
            sweep.setdefault(name, {})[f"{piece >> 20}MiB"] = gbps
            best = max(best, gbps)
        out[name] = best
    out["sweep"] = sweep  # type: ignore[assignment]
    del host, dev
    return out


def _aligned(nbytes: int) -> mmap.mmap:
    buf = mmap.mmap(-1, nbytes)  # page-aligned, as O_DIRECT wants
    buf.write(os.urandom(min(nbytes, 1 << 20)) * (nbytes // min(nbytes, 1 << 20)))
    return buf


def raw_direct_io(directory: Path, total: int, req: int, threads: int) -> dict:
    """Parallel O_DIRECT writes (then fsync) and reads: one file per thread, `req`-byte requests."""
    per = total // threads // req * req
    paths = [directory / f"raw-{i}.bin" for i in range(threads)]
    bufs = [_aligned(req) for _ in range(threads)]

    def run(fn) -> float:
        start = threading.Barrier(threads + 1)
        errors: list[BaseException] = []

        def worker(i: int) -> None:
            try:
                start.wait()
                fn(i)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
        ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
        for t in ts:
            t.start()
        start.wait()
        t0 = time.perf_counter()
        for t in ts:
            t.join()
        if errors:
            raise errors[0]
        return time.perf_counter() - t0

    def write(i: int) -> None:
        fd = os.open(paths[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            for off in range(0, per, req):
                if os.pwritev(fd, [bufs[i]], off) != req:
                    raise OSError("short O_DIRECT write")
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(i: int) -> None:
        fd = os.open(paths[i], os.O_RDONLY | os.O_DIRECT)
        try:
            for off in range(0, per, req):
                if os.preadv(fd, [bufs[i]], off) != req:
                    raise OSError("short O_DIRECT read")
        finally:
            os.close(fd)

    tw = run(write)
    evict_page_cache(paths)
    tr = run(read)
    for p in paths:
        p.unlink()
    return {"req": req, "threads": threads, "bytes": per * threads,
            "write_gbps": per * threads / tw / 1e9, "read_gbps": per * threads / tr / 1e9}


def evict_page_cache(paths) -> str:
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")  # the page cache; dentries and inodes stay (a warm daemon has them)
        return "fadvise+drop_caches=1"
    except OSError:
        return "fadvise"


# ----------------------------------------------------------------------------------------------
# The engine's pool, seen with another block size / layout per session


class PoolView:
    """The bench's one CUDA allocation, described as num_blocks blocks of block_bytes in `layout`."""

    def __init__(self, pool, block_bytes: int, layout: str) -> None:
        from engine_client.shm_pool import _regions

        self.pool, self.block_bytes, self.layout = pool, block_bytes, layout
        self.num_blocks = pool.size // block_bytes
        self.regions = _regions(self.num_blocks, block_bytes, layout, LAYERS if layout == "layer-first" else 1)

    def description(self):
        d = self.pool.description()
        del d.regions[:]
        d.num_blocks = self.num_blocks
        for r in self.regions:
            d.regions.add(offset=r.offset, block_stride=r.block_stride, block_bytes=r.block_bytes)
        return d

    def registration_fds(self) -> list[int]:
        return self.pool.registration_fds()

    def _region_views(self):
        buf = self.pool.buffer
        return [buf.as_strided((self.num_blocks, r.block_bytes), (r.block_stride, 1), r.offset) for r in self.regions]

    def poison(self, ids: list[int]) -> None:
        """Overwrite blocks (before a Load into them), so a block the Load did not write fails blocks_equal."""
        idx = torch.tensor(ids, device=self.pool.device)
        for v in self._region_views():
            v[idx] = 0xAB
        torch.cuda.synchronize()  # the engine's writes end before the daemon's copy into those blocks starts

    def blocks_equal(self, a: list[int], b: list[int]) -> bool:
        ia, ib = (torch.tensor(x, device=self.pool.device) for x in (a, b))
        buf = self.pool.buffer
        return all(torch.equal(v[ia], v[ib]) for v in (
            buf.as_strided((self.num_blocks, r.block_bytes), (r.block_stride, 1), r.offset) for r in self.regions))


def Daemon(workdir: Path, tag: str, host: int, disk_dir: str = "", disk: int = 0, threads: int = 4) -> HarnessDaemon:
    """The shared daemon harness, sized for this benchmark (started on `with`)."""
    return HarnessDaemon(workdir, tag=tag, host_capacity=host, disk_capacity=disk, disk_path=disk_dir,
                         io_backend="auto", lease_seconds=None,
                         extra=["--max-batch-blocks", "65536", "--reader-threads", str(threads),
                                "--writer-threads", str(threads)])


def client_for(daemon: Daemon, view: PoolView, tag: str, per_key: int = 1):
    """An engine's KVClient on the view; per_key > 1: the daemon keeps per_key blocks as one (blocks_per_key)."""
    from engine_client import KVClient, Namespace

    ns = Namespace(f"bench-{tag}-{view.block_bytes}-{view.layout}", "bfloat16", 16 * per_key, view.layout)
    # KVBENCH_GRPC_ONLY=1: Store and Load over gRPC instead of the frames channel (an A/B of the transport)
    c = KVClient(daemon.target, ns, view, client_name="bench/gpu_bandwidth.py", timeout=600.0,
                 lookup_channel=os.environ.get("KVBENCH_GRPC_ONLY", "0") != "1", blocks_per_key=per_key)
    c.connect(required=True)
    return c


def _env() -> dict[str, str]:
    return child_env()


def new_hashes(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


def _check(results, status: int, what: str, tier: int | None = None) -> None:
    """Every block answered `status` (and `tier`); reads the client's packed arrays, no per-block object."""
    statuses = getattr(results, "statuses", None)
    if statuses is None:  # in-process BlockCache results: kvservice.core.types arrays
        statuses, tiers = results.status, getattr(results, "tier", None)
    else:
        tiers = getattr(results, "tiers", None)
    ok = statuses.count(status) == len(statuses) and (tier is None or tiers.count(tier) == len(tiers))
    if not ok:
        bad = [r for r in results if r.status != status or (tier is not None and r.tier != tier)]
        raise RuntimeError(f"{what}: {len(bad)} of {len(results)} blocks not as expected: {bad[0]}")


# ----------------------------------------------------------------------------------------------
# Host tier through a daemon (the engine's view)


def host_tier(pool, workdir: Path, sizes: list[int], batch: int, reps: int,
              layouts: list[str], pyspy_dir: str = "", keys: list[int] = (1,)) -> tuple[list[dict], str]:
    """A fresh daemon per batch size: the first (layout, size) case's first Store is the daemon's first.
    pyspy_dir: sample the daemon with py-spy during each case's rounds (bench/daemon_sampling.py; one raw file a case).
    keys: blocks_per_key values run for each size (k > 1: the engine's blocks k to a daemon block; the
    same engine blocks and bytes per call, a k-th of the hashes)."""
    from daemon_sampling import recording
    out = []
    # two batches: from the third Store on, each evicts one (steady state)
    with Daemon(workdir, f"host{batch >> 20}", host=2 * batch) as d:
        for layout, kib, per_key in [(lo, kib, k) for lo in layouts for kib in sizes for k in keys]:
            bb = kib * KiB
            view = PoolView(pool, bb, layout)
            n = batch // bb
            rng = random.Random(kib)
            ids = list(range(view.num_blocks))
            c = client_for(d, view, "host", per_key)

            def daemon_seconds(name: str) -> float:
                """The daemon's own time in Store / Load so far (Admin.Stats latency sums): cache + copies, no gRPC."""
                return next((x.sum for x in d.admin("Stats").latencies if x.name == name), 0.0)
            spy = contextlib.ExitStack()
            try:
                if pyspy_dir:  # the rounds only: not the client's connect, not the Evict below
                    spy.enter_context(recording(  # KVBENCH_PYSPY_GIL=1: only the thread holding the GIL
                        d.proc.pid, os.path.join(pyspy_dir, f"host-{batch >> 20}MiB-{layout}-{kib}KiB.txt"),
                        gil=os.environ.get("KVBENCH_PYSPY_GIL") == "1"))
                st, lt, dst_t, dlt, exact, first = [], [], [], [], True, 0.0
                rounds: list[list[float]] = []  # per round: store, daemon's store, load, daemon's load (ms)
                for rep in range(reps + WARMUP):
                    rng.shuffle(ids)
                    src, dst = ids[:n], ids[n:2 * n]
                    hs = new_hashes(n // per_key)
                    ds0 = daemon_seconds("store")
                    t0 = time.perf_counter()
                    rs = c.store(hs, src)
                    t_store = time.perf_counter() - t0
                    ds1 = daemon_seconds("store")
                    _check(rs, 1, "Store")
                    if rep == 0:
                        first = t_store  # the first Store of this namespace (of the daemon, for the first row)
                    view.poison(dst)
                    dl0 = daemon_seconds("load")
                    t1 = time.perf_counter()
                    rs = c.load(hs, dst)
                    t_load = time.perf_counter() - t1
                    dl1 = daemon_seconds("load")
                    _check(rs, 1, "Load", tier=2)
                    if rep >= WARMUP:
                        st.append(t_store)
                        lt.append(t_load)
                        dst_t.append(ds1 - ds0)
                        dlt.append(dl1 - dl0)
                    exact = exact and view.blocks_equal(src, dst)  # every load, byte for byte
                    rounds.append([round(1e3 * x, 2) for x in (t_store, ds1 - ds0, t_load, dl1 - dl0)])
                spy.close()
                row = {"block_kib": kib, "layout": layout if per_key == 1 else f"{layout}, {per_key} a key",
                       "blocks_per_key": per_key, "blocks": n, "batch_bytes": n * bb,
                       "store_gbps": n * bb / statistics.median(st) / 1e9,
                       "store_first_gbps": n * bb / first / 1e9,
                       "load_gbps": n * bb / statistics.median(lt) / 1e9, "exact": exact,
                       "daemon_store_gbps": n * bb / max(1e-9, statistics.median(dst_t)) / 1e9,
                       "daemon_load_gbps": n * bb / max(1e-9, statistics.median(dlt)) / 1e9,
                       "rounds_ms": rounds}
                print(f"  host {row['layout']:16s} {kib:5d} KiB: store {row['store_gbps']:.1f} GB/s "
                      f"(first {row['store_first_gbps']:.1f}), "
                      f"load {row['load_gbps']:.1f} GB/s, exact={exact}; rounds (store, daemon, load, daemon ms): "
                      f"{rounds}", flush=True)
                out.append(row)
            finally:
                spy.close()
                c.close()
            d.admin("Evict", all=True)
        backend = d.admin("Stats").io_backend
    return out, backend


# ----------------------------------------------------------------------------------------------
# Disk tier through a daemon


def disk_tier(pool, workdir: Path, disk_dir: Path, sizes: list[int], batch: int, threads: int) -> list[dict]:
    out = []
    with Daemon(workdir, "disk", host=batch, disk_dir=str(disk_dir), disk=4 * batch, threads=threads) as d:
        for kib in sizes:
            bb = kib * KiB
            view = PoolView(pool, bb, "block-contiguous")
            n = batch // bb
            ids = list(range(view.num_blocks))
            random.Random(kib + 1).shuffle(ids)
            src, dst = ids[:n], ids[n:2 * n]
            c = client_for(d, view, "disk")
            try:
                a, b = new_hashes(n), new_hashes(n)
                spills0 = d.admin("Stats").counters.spills
                _check(c.store(a, src), 1, "Store A")
                t0 = time.perf_counter()
                _check(c.store(b, src), 1, "Store B")
                while True:
                    s = d.admin("Stats")
                    if s.counters.spills - spills0 >= n and s.write_queue_depth == 0:
                        break
                    time.sleep(0.002)
                os.sync()
                t_spill = time.perf_counter() - t0
                files = [Path(r) / f for r, _, fs in os.walk(disk_dir) for f in fs if f.endswith((".kvb", ".kvseg"))]
                method = evict_page_cache(files)
                t0 = time.perf_counter()
                rs = c.load(a, dst)
                t_load = time.perf_counter() - t0
                _check(rs, 1, "Load A", tier=3)
                exact = view.blocks_equal(src, dst)
                while d.admin("Stats").write_queue_depth:  # onboarding A pushes B out: let it finish
                    time.sleep(0.01)
                row = {"block_kib": kib, "blocks": n, "spill_gbps": n * bb / t_spill / 1e9,
                       "disk_load_gbps": n * bb / t_load / 1e9, "exact": exact, "cold_cache": method}
                print(f"  disk {kib:5d} KiB: spill {row['spill_gbps']:.2f} GB/s, load {row['disk_load_gbps']:.2f} GB/s, "
                      f"exact={exact} ({method})", flush=True)
                out.append(row)
            finally:
                c.close()
            d.admin("Evict", all=True)
    return out


# ----------------------------------------------------------------------------------------------
# Breakdown: the daemon's role without gRPC (a separate process: a pool cannot be IPC-opened by
# the process that allocated it)


def datapath_role(args) -> None:
    """The daemon's copy path alone (CudaEngineMemory.gather_into / scatter_from on a pinned
    HostArena, no gRPC, no cache), then the same batches through an in-process BlockCache (the copy
    path plus the cache's bookkeeping, no gRPC). Prints one JSON list of rows."""
    from kvservice.core.cache import BlockCache
    from kvservice.checksum import checksum
    from kvservice.core.clock import SystemClock
    from kvservice.ops.config import Config
    from kvservice.memory.cuda_memory import CudaEngineMemory
    from kvservice.memory.host_arena import HostArena
    from kvservice.core.sessions_api import NamespaceSpec, PoolRegion, PoolSpec
    from kvwire.v1 import kvcache_pb2
    from engine_client.shm_pool import _regions

    desc = kvcache_pb2.PoolDescription.FromString(bytes.fromhex(sys.stdin.readline().strip()))
    batch, reps = args.batch_mib[0] * MiB, args.reps

    def med(fn, n_reps=reps) -> float:
        fn()
        ts = []
        for _ in range(n_reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    def case(layout: str, kib: int):
        bb = kib * KiB
        nb = desc.cuda.size // bb
        regs = _regions(nb, bb, layout, LAYERS if layout == "layer-first" else 1)
        spec = PoolSpec("cuda", nb, tuple(PoolRegion(r.offset, r.block_stride, r.block_bytes) for r in regs),
                        desc.cuda.size, cuda_handle=desc.cuda.handle, cuda_device_index=desc.cuda.device_index,
                        cuda_device_uuid=desc.cuda.device_uuid)
        n = batch // bb
        ids = list(range(nb))
        random.Random(kib + 2).shuffle(ids)
        return bb, spec, n, ids[:n], ids[n:2 * n]

    cases = [(layout, kib) for layout in args.layouts for kib in args.sizes]
    rows = {c: {"block_kib": c[1], "layout": c[0]} for c in cases}
    arena = HostArena(batch, pin=True)
    try:
        for layout, kib in cases:
            bb, spec, n, src, dst = case(layout, kib)
            m = CudaEngineMemory(spec)
            offs = arena.alloc(bb, n)
            try:
                t_store = med(lambda: m.gather_into(src, arena, offs))
                sums = m.gather_into(src, arena, offs)
                crc_ok = sums[:8] == [checksum(arena.row(o, bb)) for o in offs[:8]] and len(sums) == n
                t_load = med(lambda: m.scatter_from(dst, arena, offs))
                dev = m._dev.device
                with torch.cuda.device(m._dev.index):
                    exact = torch.equal(m._gather_dev(torch.tensor(dst, device=dev)),
                                        m._gather_dev(torch.tensor(src, device=dev)))
                if args.profile and layout == "layer-first" and kib == args.sizes[-1]:
                    from torch.profiler import ProfilerActivity, profile

                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        m.gather_into(src, arena, offs)
                        m.scatter_from(dst, arena, offs)
                    Path(args.profile).mkdir(parents=True, exist_ok=True)
                    Path(args.profile, f"profile_{kib}KiB_layer_first.txt").write_text(
                        prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
            finally:
                arena.free(offs, bb)
                m.close()
            rows[(layout, kib)].update(blocks=n, exact=exact and crc_ok, gpu_crc=m._dev.crc_state == "on",
                                       dp_store_gbps=n * bb / t_store / 1e9, dp_load_gbps=n * bb / t_load / 1e9)
            print(json.dumps(rows[(layout, kib)]), file=sys.stderr, flush=True)
    finally:
        arena.close()

    # the same batches through BlockCache (bookkeeping + the copies), no gRPC
    loop = asyncio.new_event_loop()
    cache = BlockCache(Config(socket_path="/tmp/unused.sock", host_capacity_bytes=2 * batch, io_backend="posix",
                              max_batch_blocks=1 << 20), SystemClock())
    loop.run_until_complete(cache.start())
    for layout, kib in cases:
        bb, spec, n, src, dst = case(layout, kib)
        opened = cache.open_session(NamespaceSpec(f"dp-{kib}-{layout}", "bfloat16", 16, layout, 0, 1), spec,
                                    os.urandom(32), "datapath")
        sid = opened.session_id

        def cache_round() -> tuple[float, float]:
            hs = b"".join(new_hashes(n))
            t0 = time.perf_counter()
            _check(loop.run_until_complete(cache.store(sid, hs, src, 0.0)), 1, "BlockCache store")
            t1 = time.perf_counter()
            _check(loop.run_until_complete(cache.load(sid, hs, dst)), 1, "BlockCache load")
            return t1 - t0, time.perf_counter() - t1
        for _ in range(WARMUP):
            cache_round()
        rounds = [cache_round() for _ in range(reps)]
        loop.run_until_complete(cache.close_session(sid))
        loop.run_until_complete(cache.evict(all=True))
        rows[(layout, kib)].update(cache_store_gbps=n * bb / statistics.median(r[0] for r in rounds) / 1e9,
                                   cache_load_gbps=n * bb / statistics.median(r[1] for r in rounds) / 1e9)
        print(json.dumps(rows[(layout, kib)]), file=sys.stderr, flush=True)
    loop.run_until_complete(cache.drain_and_stop())
    print(json.dumps(list(rows.values())))


def datapath(pool, args, batch: int) -> list[dict]:
    cmd = [sys.executable, __file__, "--role", "datapath", "--batch-mib", str(batch >> 20), "--reps", str(args.reps),
           "--sizes", ",".join(str(s) for s in args.sizes), "--layouts", ",".join(args.layouts)] + \
          (["--profile", args.profile] if args.profile else [])
    p = subprocess.run(cmd, input=pool.description().SerializeToString().hex() + "\n", capture_output=True, text=True,
                       env=_env(), timeout=600)
    if p.returncode:
        raise RuntimeError(f"datapath helper failed ({p.returncode}):\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser()
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument("--sizes", default="2048,256,64", type=ints, help="block sizes in KiB, in the order run")
    ap.add_argument("--batch-mib", default="256", type=ints,
                    help="batch sizes in MiB; each gets its own limits, data-path helper and fresh daemon")
    ap.add_argument("--layouts", default="layer-first,block-contiguous", type=lambda s: s.split(","),
                    help="in the order run: the first case's first Store is a fresh daemon's first")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--disk-dir", default="")
    ap.add_argument("--io-threads", type=int, default=8)
    ap.add_argument("--out", default="")
    ap.add_argument("--profile", default="")
    ap.add_argument("--pyspy", default="", help="a folder: sample the daemon with py-spy in each host-tier case "
                    "(bench/daemon_sampling.py summarizes; needs the py-spy binary)")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: datapath,host,disk")
    ap.add_argument("--blocks-per-key", default="1", type=ints,
                    help="host tier: for each block size, these blocks_per_key values (k > 1: k engine blocks a key)")
    ap.add_argument("--role", default="engine")
    args = ap.parse_args()
    if args.role == "datapath":
        return datapath_role(args)
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_bandwidth.py needs a CUDA GPU")
    from engine_client import CudaKVPool

    skip = set(filter(None, args.skip.split(",")))
    batches = [b * MiB for b in args.batch_mib]
    pool = CudaKVPool(2 * max(batches) // (4 * KiB), 4 * KiB)  # 2 batches: sources and destinations
    pool.buffer.random_(0, 256)
    torch.cuda.synchronize()
    result: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "layers": LAYERS,
                    "io_threads": args.io_threads, "runs": []}
    work = Path(tempfile.mkdtemp(prefix="kvgpu", dir="/tmp"))
    disk_dir = Path(args.disk_dir or ROOT / ".bench-disk")

    def section(name: str, fn) -> None:
        """One failing section must not cost the others their figures (device time is scarce)."""
        if name in skip:
            return
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            result.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
        print(f"[{name}: {time.perf_counter() - t0:.1f} s]", flush=True)

    try:
        for batch in batches:
            run: dict = {"batch_bytes": batch, "pinned": pinned_copy_gbps(batch, 10)}
            result["runs"].append(run)
            print(f"pinned cudaMemcpy, {batch >> 20} MiB: H2D {run['pinned']['h2d']:.1f} GB/s, "
                  f"D2H {run['pinned']['d2h']:.1f} GB/s", flush=True)
            section("datapath", lambda: run.__setitem__("datapath", datapath(pool, args, batch)))

            def host() -> None:
                run["host"], result["io_backend"] = host_tier(pool, work, args.sizes, batch, args.reps, args.layouts,
                                                               args.pyspy, args.blocks_per_key)
            section("host", host)
        result["pinned"] = result["runs"][0]["pinned"]
        result["batch_bytes"] = batches[0]

        def disk() -> None:
            batch = batches[0]
            shutil.rmtree(disk_dir, ignore_errors=True)
            raw_dir = disk_dir / "raw"
            raw_dir.mkdir(parents=True)
            result["raw"] = [raw_direct_io(raw_dir, 2 * batch, RAW_REQ, args.io_threads)]
            result["raw"] += [raw_direct_io(raw_dir, batch, k * KiB, args.io_threads) for k in args.sizes
                              if k * KiB != RAW_REQ]
            result["disk"] = disk_tier(pool, work, disk_dir / "tier", args.sizes, batch, args.io_threads)
        section("disk", disk)
    finally:
        for log in work.glob("*.log"):
            if args.out:
                shutil.copy(log, Path(args.out).parent / log.name)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(disk_dir, ignore_errors=True)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
    print(report(result))


TARGETS = {64: (0.70, 0.70)}  # block KiB -> (store / D2H, load / H2D); DESIGN §7 and issue 10
DEFAULT_TARGET = (0.90, 0.92)


def report(r: dict) -> str:
    lines = [f"\nGPU data path on {r['device']} (torch {r['torch']}), layer-first = {2 * r['layers']} regions, "
             f"disk I/O backend {r.get('io_backend', '?')}; through the daemon = KVClient over the Unix socket, "
             "random block order, every Load byte-checked", "",
             "| batch | block | layout | Store GB/s | / D2H | first Store / D2H | Load GB/s | / H2D | target store / load "
             "| copy path alone store / load (x limit) | + BlockCache, no gRPC: store / load (x limit) "
             "| the daemon's own time (Stats): store / load (x limit) | exact |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for run in r.get("runs", []):
        p = run["pinned"]
        d2h, h2d = p["d2h"], p["h2d"]
        dp = {(x["block_kib"], x["layout"]): x for x in run.get("datapath", [])}
        host = {(x["block_kib"], x["layout"]): x for x in run.get("host", [])}
        for k in list(host) + [k for k in dp if k not in host]:
            h, d = host.get(k, {}), dp.get(k, {})
            ts, tl = TARGETS.get(k[0], DEFAULT_TARGET)
            sx, lx = h.get("store_gbps", 0) / d2h, h.get("load_gbps", 0) / h2d
            lines.append(
                f"| {run['batch_bytes'] >> 20} MiB | {k[0]} KiB | {k[1]} | {h.get('store_gbps', 0):.1f} | "
                f"**{sx:.2f}** {'ok' if sx >= ts else 'miss'} | {h.get('store_first_gbps', 0) / d2h:.2f} | "
                f"{h.get('load_gbps', 0):.1f} | **{lx:.2f}** {'ok' if lx >= tl else 'miss'} | {ts:.2f} / {tl:.2f} | "
                f"{d.get('dp_store_gbps', 0):.1f} ({d.get('dp_store_gbps', 0) / d2h:.2f}) / "
                f"{d.get('dp_load_gbps', 0):.1f} ({d.get('dp_load_gbps', 0) / h2d:.2f}) | "
                f"{d.get('cache_store_gbps', 0):.1f} ({d.get('cache_store_gbps', 0) / d2h:.2f}) / "
                f"{d.get('cache_load_gbps', 0):.1f} ({d.get('cache_load_gbps', 0) / h2d:.2f}) | "
                f"{h.get('daemon_store_gbps', 0):.1f} ({h.get('daemon_store_gbps', 0) / d2h:.2f}) / "
                f"{h.get('daemon_load_gbps', 0):.1f} ({h.get('daemon_load_gbps', 0) / h2d:.2f}) | "
                f"{h.get('exact', '-')}/{d.get('exact', '-')} |")
    lines += ["", "Limits (pinned cudaMemcpy, best of a sweep over piece sizes, same run): " + "; ".join(
        f"{run['batch_bytes'] >> 20} MiB: D2H {run['pinned']['d2h']:.1f}, H2D {run['pinned']['h2d']:.1f} GB/s"
        for run in r.get("runs", []))]
    if r.get("raw"):
        big = r["raw"][0]
        by_req = {x["req"]: x for x in r["raw"]}
        lines += ["", f"raw O_DIRECT, {big['threads']} threads, {big['req'] >> 20} MiB requests: read {big['read_gbps']:.2f} GB/s, "
                  f"write {big['write_gbps']:.2f} GB/s (same disk, same run)", "",
                  "| block | spill GB/s | / raw write | disk load GB/s | / raw read | raw read / write at block-size requests | exact |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for x in r.get("disk", []):
            at = by_req.get(x["block_kib"] * KiB, big)
            lines.append(f"| {x['block_kib']} KiB | {x['spill_gbps']:.2f} | {x['spill_gbps'] / big['write_gbps']:.2f} | "
                         f"{x['disk_load_gbps']:.2f} | {x['disk_load_gbps'] / big['read_gbps']:.2f} | "
                         f"{at['read_gbps']:.2f} / {at['write_gbps']:.2f} | {x['exact']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
