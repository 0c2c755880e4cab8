#!/usr/bin/env python3
"""GPU data-path bandwidth on a CUDA host, as ratios against limits measured in the same run (DESIGN §7).

    python bench/gpu_bandwidth.py [--sizes 64,256,1024,4096] [--batch-mib 256] [--reps 5]
                                  [--disk-dir DIR] [--io-threads 8] [--out results.json] [--profile DIR]

This process is the engine: it owns a CudaKVPool (random bytes) and talks to real daemons
(`python -m kvservice serve --io-backend auto`) through engine_client over their Unix sockets.
For each block size (KiB) and both layouts (block-contiguous; layer-first with 32 layers = 64
regions), one batch of --batch-mib MiB per call:

  limits      pinned cudaMemcpy H2D and D2H of one batch (torch copy_ between a pinned and a device
              tensor, CUDA events), and raw O_DIRECT parallel reads and writes of the disk directory
              (--io-threads threads, 4 MiB requests, and requests of the block size).
  host tier   Store and Load of a batch through the daemon (engine view: gRPC + cache + copies),
              host tier big enough that nothing leaves it; median of --reps after a warm-up.
  breakdown   a helper process (the daemon's role, no gRPC) times the same batches through
              CudaEngineMemory alone (gather+checksums, gather, scatter) and through an in-process
              BlockCache, so the gap to the limit splits into copies, checksums and bookkeeping.
              --profile writes a torch.profiler table of one store and one load there.
  disk tier   block-contiguous, host tier of one batch: Store A, then Store B pushes A to disk; spill
              GB/s runs from Store B until every spill is written and sync() returned. Then every
              block file is evicted from the page cache (posix_fadvise DONTNEED, and drop_caches when
              allowed) and Load A comes from disk: read, CRC32C-verified, copied to the GPU.
Prints Markdown tables; --out writes every figure as JSON.
"""

from __future__ import annotations

import argparse
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


def client_for(daemon: Daemon, view: PoolView, tag: str):
    from engine_client import KVClient, Namespace

    ns = Namespace(f"bench-{tag}-{view.block_bytes}-{view.layout}", "bfloat16", 16, view.layout)
    c = KVClient(daemon.target, ns, view, client_name="bench/gpu_bandwidth.py", timeout=600.0)
    c.connect(required=True)
    return c


def _env() -> dict[str, str]:
    return child_env()


def new_hashes(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


def _check(results, status: int, what: str, tier: int | None = None) -> None:
    """Every block answered `status` (and `tier`); reads the client's packed arrays, no per-block object."""
    statuses = getattr(results, "statuses", None)
    if statuses is None:  # in-process BlockCache results
        statuses, tiers = [r.status for r in results], [getattr(r, "tier", 0) for r in results]
    else:
        tiers = getattr(results, "tiers", None)
    ok = statuses.count(status) == len(statuses) and (tier is None or tiers.count(tier) == len(tiers))
    if not ok:
        bad = [r for r in results if r.status != status or (tier is not None and r.tier != tier)]
        raise RuntimeError(f"{what}: {len(bad)} of {len(results)} blocks not as expected: {bad[0]}")


# ----------------------------------------------------------------------------------------------
# Host tier through a daemon (the engine's view)


def host_tier(pool, workdir: Path, sizes: list[int], batch: int, reps: int) -> tuple[list[dict], str]:
    out = []
    # two batches: from the third Store on, each evicts one, so pinned chunks are reused (steady state)
    with Daemon(workdir, "host", host=2 * batch) as d:
        for layout in ("block-contiguous", "layer-first"):
            for kib in sizes:
                bb = kib * KiB
                view = PoolView(pool, bb, layout)
                n = batch // bb
                rng = random.Random(kib)
                ids = list(range(view.num_blocks))
                c = client_for(d, view, "host")
                try:
                    st, lt, exact, first = [], [], True, 0.0
                    for rep in range(reps + WARMUP):
                        rng.shuffle(ids)
                        src, dst = ids[:n], ids[n:2 * n]
                        hs = new_hashes(n)
                        t0 = time.perf_counter()
                        rs = c.store(hs, src)
                        t1 = time.perf_counter()
                        _check(rs, 1, "Store")
                        if rep == 0:
                            first = t1 - t0  # the first Store of this namespace (of the daemon, for the first row)
                        rs = c.load(hs, dst)
                        t2 = time.perf_counter()
                        _check(rs, 1, "Load", tier=2)
                        if rep >= WARMUP:
                            st.append(t1 - t0)
                            lt.append(t2 - t1)
                        if rep in (0, reps + WARMUP - 1):
                            exact = exact and view.blocks_equal(src, dst)
                    row = {"block_kib": kib, "layout": layout, "blocks": n,
                           "store_gbps": n * bb / statistics.median(st) / 1e9,
                           "store_first_gbps": n * bb / first / 1e9,
                           "load_gbps": n * bb / statistics.median(lt) / 1e9, "exact": exact}
                    print(f"  host {layout:16s} {kib:5d} KiB: store {row['store_gbps']:.1f} GB/s "
                          f"(first {row['store_first_gbps']:.1f}), "
                          f"load {row['load_gbps']:.1f} GB/s, exact={exact}", flush=True)
                    out.append(row)
                finally:
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
    from kvservice.core.cache import BlockCache
    from kvservice.checksum import checksum
    from kvservice.core.clock import SystemClock
    from kvservice.ops.config import Config
    from kvservice.memory.cuda_memory import CudaEngineMemory
    from kvservice.core.sessions_api import NamespaceSpec, PoolRegion, PoolSpec
    from kvwire.v1 import kvcache_pb2

    desc = kvcache_pb2.PoolDescription.FromString(bytes.fromhex(sys.stdin.readline().strip()))
    batch, reps = args.batch_mib * MiB, args.reps
    loop = asyncio.new_event_loop()
    cache = BlockCache(Config(socket_path="/tmp/unused.sock", host_capacity_bytes=2 * batch, io_backend="posix",
                              max_batch_blocks=1 << 20), SystemClock())
    loop.run_until_complete(cache.start())
    rows = []

    def med(fn, n_reps=reps) -> float:
        fn()
        ts = []
        for _ in range(n_reps):
            t0 = time.perf_counter()
            kept = fn()  # freeing the rows is not part of the copy (the host tier keeps them)
            ts.append(time.perf_counter() - t0)
            del kept
        return statistics.median(ts)

    for layout in ("block-contiguous", "layer-first"):
        for kib in args.sizes:
            bb = kib * KiB
            from engine_client.shm_pool import _regions
            nb = desc.cuda.size // bb
            regs = _regions(nb, bb, layout, LAYERS if layout == "layer-first" else 1)
            spec = PoolSpec("cuda", nb, tuple(PoolRegion(r.offset, r.block_stride, r.block_bytes) for r in regs),
                            desc.cuda.size, cuda_handle=desc.cuda.handle, cuda_device_index=desc.cuda.device_index,
                            cuda_device_uuid=desc.cuda.device_uuid)
            n = batch // bb
            ids = list(range(nb))
            random.Random(kib + 2).shuffle(ids)
            src, dst = ids[:n], ids[n:2 * n]
            m = CudaEngineMemory(spec)
            try:
                t_crc = med(lambda: m.gather_with_checksums(src))
                gpu_crc = m._dev.crc_state == "on"
                crc_ok = m.gather_with_checksums(src[:8])[1] == [checksum(r) for r in m.gather(src[:8])]
                m._dev.crc_state, saved = "off", m._dev.crc  # the same batch with CPU checksums, for the record
                m._dev.crc = None
                t_cpucrc = med(lambda: m.gather_with_checksums(src), 2)
                m._dev.crc_state, m._dev.crc = ("on" if saved else "off"), saved
                t_nocrc = med(lambda: m.gather(src))
                held = m.gather(src)
                t_load = med(lambda: m.scatter(dst, held))
                dev = m._dev.device
                with torch.cuda.device(m._dev.index):
                    exact = torch.equal(m._gather_dev(torch.tensor(dst, device=dev)), m._gather_dev(torch.tensor(src, device=dev)))
                order = list(range(n))
                random.Random(3).shuffle(order)
                shuffled = [held[i] for i in order]
                t_scattered = med(lambda: m.scatter(dst, shuffled), 2)
                with torch.cuda.device(m._dev.index):
                    exact = exact and torch.equal(m._gather_dev(torch.tensor(dst, device=dev)),
                                                  m._gather_dev(torch.tensor([src[i] for i in order], device=dev)))
                exact = exact and crc_ok
                if args.profile and kib == 1024 and layout == "layer-first":
                    from torch.profiler import ProfilerActivity, profile

                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        m.gather_with_checksums(src)
                        m.scatter(dst, held)
                    Path(args.profile).mkdir(parents=True, exist_ok=True)
                    Path(args.profile, "profile_1MiB_layer_first.txt").write_text(
                        prof.key_averages().table(sort_by="cuda_time_total", row_limit=20))
                held = shuffled = []  # let the pinned chunks go before the next size
            finally:
                m.close()
            # the same batch through BlockCache (bookkeeping + the copies), no gRPC
            ns = NamespaceSpec(f"dp-{kib}-{layout}", "bfloat16", 16, layout, 0, 1)
            opened = cache.open_session(ns, spec, os.urandom(32), "datapath")
            sid = opened.session_id

            def cache_round() -> tuple[float, float]:
                hs = new_hashes(n)
                t0 = time.perf_counter()
                loop.run_until_complete(cache.store(sid, hs, src, 0.0))
                t1 = time.perf_counter()
                loop.run_until_complete(cache.load(sid, hs, dst))
                return t1 - t0, time.perf_counter() - t1
            for _ in range(WARMUP):
                cache_round()
            rounds = [cache_round() for _ in range(reps)]
            cache.close_session(sid)
            loop.run_until_complete(cache.evict(all=True))
            row = {"block_kib": kib, "layout": layout, "blocks": n, "exact": exact, "gpu_crc": gpu_crc,
                   "dp_store_gbps": n * bb / t_crc / 1e9, "dp_store_nocrc_gbps": n * bb / t_nocrc / 1e9,
                   "dp_store_cpucrc_gbps": n * bb / t_cpucrc / 1e9,
                   "dp_load_gbps": n * bb / t_load / 1e9, "dp_load_scattered_gbps": n * bb / t_scattered / 1e9,
                   "cache_store_gbps": n * bb / statistics.median(r[0] for r in rounds) / 1e9,
                   "cache_load_gbps": n * bb / statistics.median(r[1] for r in rounds) / 1e9}
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
    loop.run_until_complete(cache.drain_and_stop())
    print(json.dumps(rows))


def datapath(pool, args) -> list[dict]:
    cmd = [sys.executable, __file__, "--role", "datapath", "--batch-mib", str(args.batch_mib), "--reps", str(args.reps),
           "--sizes", ",".join(str(s) for s in args.sizes)] + (["--profile", args.profile] if args.profile else [])
    p = subprocess.run(cmd, input=pool.description().SerializeToString().hex() + "\n", capture_output=True, text=True,
                       env=_env(), timeout=600)
    if p.returncode:
        raise RuntimeError(f"datapath helper failed ({p.returncode}):\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="64,256,1024,4096", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--batch-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--disk-dir", default="")
    ap.add_argument("--io-threads", type=int, default=8)
    ap.add_argument("--out", default="")
    ap.add_argument("--profile", default="")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: datapath,host,disk")
    ap.add_argument("--role", default="engine")
    args = ap.parse_args()
    if args.role == "datapath":
        return datapath_role(args)
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_bandwidth.py needs a CUDA GPU")
    from engine_client import CudaKVPool

    skip = set(filter(None, args.skip.split(",")))
    batch = args.batch_mib * MiB
    pool = CudaKVPool(2 * batch // (4 * KiB), 4 * KiB)  # 2 batches: sources and destinations
    pool.buffer.random_(0, 256)
    torch.cuda.synchronize()
    result: dict = {"device": torch.cuda.get_device_name(0), "batch_bytes": batch, "torch": torch.__version__,
                    "pinned": pinned_copy_gbps(batch, 10), "layers": LAYERS, "io_threads": args.io_threads}
    print(f"pinned cudaMemcpy, {args.batch_mib} MiB: H2D {result['pinned']['h2d']:.1f} GB/s, "
          f"D2H {result['pinned']['d2h']:.1f} GB/s", flush=True)
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

    def host() -> None:
        result["host"], result["io_backend"] = host_tier(pool, work, args.sizes, batch, args.reps)

    def disk() -> None:
        shutil.rmtree(disk_dir, ignore_errors=True)
        raw_dir = disk_dir / "raw"
        raw_dir.mkdir(parents=True)
        result["raw"] = [raw_direct_io(raw_dir, 2 * batch, RAW_REQ, args.io_threads)]
        result["raw"] += [raw_direct_io(raw_dir, batch, k * KiB, args.io_threads) for k in args.sizes if k * KiB != RAW_REQ]
        result["disk"] = disk_tier(pool, work, disk_dir / "tier", args.sizes, batch, args.io_threads)

    try:
        section("datapath", lambda: result.__setitem__("datapath", datapath(pool, args)))
        section("host", host)
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


def report(r: dict) -> str:
    p = r["pinned"]
    lines = [f"\nGPU data path on {r['device']} (torch {r['torch']}), batches of {r['batch_bytes'] >> 20} MiB, "
             f"layer-first = {2 * r['layers']} regions, disk I/O backend {r.get('io_backend', '?')}",
             f"pinned cudaMemcpy in this run: H2D {p['h2d']:.1f} GB/s, D2H {p['d2h']:.1f} GB/s", "",
             "| block | layout | store GB/s | / D2H | first Store / D2H | load GB/s | / H2D | data path store / load (no gRPC, no cache) "
             "| store: CRC on CPU / no CRC | load, shuffled rows | BlockCache store / load | exact |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    dp = {(x["block_kib"], x["layout"]): x for x in r.get("datapath", [])}
    keys = [(x["block_kib"], x["layout"]) for x in r.get("host", [])] or list(dp)
    host = {(x["block_kib"], x["layout"]): x for x in r.get("host", [])}
    for k in keys:
        h, d = host.get(k, {}), dp.get(k, {})
        lines.append(
            f"| {k[0]} KiB | {k[1]} | {h.get('store_gbps', 0):.1f} | {h.get('store_gbps', 0) / p['d2h']:.2f} | "
            f"{h.get('store_first_gbps', 0) / p['d2h']:.2f} | "
            f"{h.get('load_gbps', 0):.1f} | {h.get('load_gbps', 0) / p['h2d']:.2f} | "
            f"{d.get('dp_store_gbps', 0):.1f} ({d.get('dp_store_gbps', 0) / p['d2h']:.2f}) / "
            f"{d.get('dp_load_gbps', 0):.1f} ({d.get('dp_load_gbps', 0) / p['h2d']:.2f}) | "
            f"{d.get('dp_store_cpucrc_gbps', 0):.1f} / {d.get('dp_store_nocrc_gbps', 0):.1f} | "
            f"{d.get('dp_load_scattered_gbps', 0):.1f} | "
            f"{d.get('cache_store_gbps', 0):.1f} / {d.get('cache_load_gbps', 0):.1f} | "
            f"{h.get('exact', '-')}/{d.get('exact', '-')} |")
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
