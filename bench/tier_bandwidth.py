#!/usr/bin/env python3
"""Tier bandwidth through a real kvservice daemon, as ratios against limits measured in the same run.

    make bench
    .venv/bin/python bench/tier_bandwidth.py [--sizes 64,256,1024] [--total-mib 256] [--out results.json]

For each block size, against a fresh `python -m kvservice serve` subprocess over its Unix socket,
driven by engine_client (KVClient + a ShmKVPool as large as the run, the CPU-host registration path;
an untimed warm-up first makes the daemon fault in its mapping of the pool):

  host tier   Store and Load of --total-mib MiB in batches of --batch blocks (host tier big enough
              that nothing leaves it; median of --repeats runs), beside the best of 5 plain memcpys
              of the same bytes between two preallocated, pre-faulted CPU tensors (torch copy_).
  disk tier   a small host tier (--disk-host-mib), so stores stream out to disk: spill GB/s from the
              first Store until Stats shows the write queue empty and every expected spill done
              (the daemon writes without fsync, so this lands in the page cache), and again including
              a sync() to the device. Then every block is pushed to disk, the page cache is made cold
              (posix_fadvise(DONTNEED) on every block file, or drop_caches with --evict drop_caches;
              util-linux fincore confirms it when installed) and all blocks are loaded back.
              Limits: a raw sequential write of the same size in the same directory (page cache; and
              with fsync), a raw cold sequential read, and a cold read of the daemon's own block
              files by plain preadv with the daemon's reader thread count. Raw figures are taken
              before and after the daemon's run; the better one is the limit.

This is the CPU benchmark. DESIGN §7's targets are GPU-host figures (engine GPU <-> pinned host,
kvikio/GDS disk reads) measured by bench/gpu_bandwidth.py on a GPU host, not by this script.
Prints a Markdown table; --out also writes every figure as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.daemon import Daemon as HarnessDaemon  # noqa: E402
import torch  # noqa: E402

from engine_client import KVClient, Namespace, ShmKVPool  # noqa: E402
from kvwire.v1 import admin_pb2, kvcache_pb2 as pb  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
RAW_CHUNK = 4 * MiB  # raw sequential I/O chunk
READER_THREADS = 4  # the daemon's default reader_threads


# ----------------------------------------------------------------------------------------------
# The daemon under test


def Daemon(workdir: Path, tag: str, host_capacity: int, disk_path: str = "", disk_capacity: int = 0) -> HarnessDaemon:
    """The shared daemon harness, sized for this benchmark (started on `with`)."""
    return HarnessDaemon(workdir, tag=tag, host_capacity=host_capacity, disk_capacity=disk_capacity,
                         disk_path=disk_path, io_backend="auto", lease_seconds=None, log_level="warning")


def engine(daemon: Daemon, block_bytes: int, pool_blocks: int, model: str = "bench") -> tuple[KVClient, ShmKVPool]:
    pool = ShmKVPool(pool_blocks, block_bytes)
    pool.buffer.copy_(torch.randint(0, 256, (pool.size,), dtype=torch.uint8))
    ns = Namespace(model, "uint8", 16, "block-contiguous")
    client = KVClient(daemon.target, ns, pool, client_name="bench/tier_bandwidth.py", timeout=120.0)
    client.connect(required=True)
    return client, pool


def new_hashes(n: int) -> list[bytes]:
    # The daemon treats hashes as opaque keys; fresh random ones make every block new.
    return [os.urandom(32) for _ in range(n)]


def batches(n: int, size: int) -> list[tuple[int, int]]:
    return [(lo, min(n, lo + size)) for lo in range(0, n, size)]


def pool_ids(lo: int, hi: int, pool_blocks: int) -> list[int]:
    # Block i of the run lives in pool block i (mod the pool): with a pool as large as the run, no
    # batch re-reads bytes an earlier batch left in the CPU caches, as in an engine's big pool.
    return [i % pool_blocks for i in range(lo, hi)]


def timed_store(client: KVClient, hashes: list[bytes], batch: int, pool_blocks: int) -> float:
    t0 = time.perf_counter()
    for lo, hi in batches(len(hashes), batch):
        results = client.store(hashes[lo:hi], pool_ids(lo, hi, pool_blocks))
        bad = [r for r in results if r.status != pb.STORED]
        if bad:
            raise RuntimeError(f"Store: {len(bad)} of {hi - lo} blocks not STORED: {bad[0]}")
    return time.perf_counter() - t0


def timed_load(client: KVClient, hashes: list[bytes], batch: int, pool_blocks: int, tier: int) -> float:
    t0 = time.perf_counter()
    for lo, hi in batches(len(hashes), batch):
        results = client.load(hashes[lo:hi], pool_ids(lo, hi, pool_blocks))
        bad = [r for r in results if r.status != pb.LOADED or r.tier != tier]
        if bad:
            raise RuntimeError(f"Load: {len(bad)} of {hi - lo} blocks not LOADED from {pb.Tier.Name(tier)}: {bad[0]}")
    return time.perf_counter() - t0


def warm_pool_mapping(daemon: Daemon, client: KVClient, pool_blocks: int, batch: int) -> None:
    """Untimed: make the daemon fault in its mapping of the whole pool (Loads write every block),
    then evict the warm-up blocks. Measured runs then see what a long-running engine sees."""
    warm = new_hashes(min(batch, pool_blocks))
    timed_store(client, warm, batch, pool_blocks)
    for lo, hi in batches(pool_blocks, len(warm)):
        client.load(warm[: hi - lo], list(range(lo, hi)))
    daemon.evict_namespace(client.namespace_id)


def verify_one_batch(client: KVClient, pool: ShmKVPool, hashes: list[bytes]) -> bool:
    """Untimed: zero the pool, load `hashes` again, compare with what was stored (the pool's content)."""
    n = len(hashes)
    expected = pool.buffer[: n * pool.block_bytes].clone()
    pool.buffer[: n * pool.block_bytes].zero_()
    results = client.load(hashes, list(range(n)))
    ok = all(r.status == pb.LOADED for r in results) and torch.equal(pool.buffer[: n * pool.block_bytes], expected)
    pool.buffer[: n * pool.block_bytes].copy_(expected)
    return ok


# ----------------------------------------------------------------------------------------------
# Limits measured in the same run


def memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
    """Best of `repeats` copies: a limit is what the machine can do, not what a busy moment allowed."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault in the destination pages: the limit is the copy itself
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / min(times) / 1e9


def raw_file_io(directory: Path, nbytes: int, evict: str) -> dict:
    """Sequential write (page cache, then + fsync) and cold sequential read of one file."""
    path = directory / "raw-sequential.bin"
    buf = bytearray(os.urandom(RAW_CHUNK))
    view = memoryview(buf)
    # Untimed: write and delete the file once. In a VM, page-cache pages the guest has never
    # touched cost far more the first time; the daemon's writes reuse pages earlier phases freed.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for lo in range(0, nbytes, RAW_CHUNK):
            os.write(fd, view[: min(nbytes - lo, RAW_CHUNK)])
        os.fsync(fd)
    finally:
        os.close(fd)
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        t0 = time.perf_counter()
        left = nbytes
        while left:
            left -= os.write(fd, view[: min(left, RAW_CHUNK)])
        t_written = time.perf_counter()
        os.fsync(fd)
        t_synced = time.perf_counter()
    finally:
        os.close(fd)
    method = evict_page_cache([path], evict)
    resident = resident_fraction([path])
    fd = os.open(path, os.O_RDONLY)
    try:
        t0r = time.perf_counter()
        got = 0
        while True:
            n = os.readv(fd, [view])
            if n == 0:
                break
            got += n
        t_read = time.perf_counter() - t0r
    finally:
        os.close(fd)
        path.unlink()
    assert got == nbytes, (got, nbytes)
    return dict(write_page_cache_gbps=nbytes / (t_written - t0) / 1e9, write_fsync_gbps=nbytes / (t_synced - t0) / 1e9,
                read_cold_gbps=nbytes / t_read / 1e9, evict_method=method, resident_before_read=resident)


def read_files_parallel(files: list[Path], threads: int) -> float:
    """GB/s of reading every file whole (header and payload) with `threads` threads of preadv."""
    from concurrent.futures import ThreadPoolExecutor

    import threading

    size = max(f.stat().st_size for f in files)
    local = threading.local()

    def read(i: int) -> int:
        if not hasattr(local, "view"):
            local.view = memoryview(bytearray(size))  # one buffer per reader thread, as the daemon's
        view = local.view
        fd = os.open(files[i], os.O_RDONLY)
        try:
            return os.preadv(fd, [view], 0)
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(read, range(len(files))))
    return total / (time.perf_counter() - t0) / 1e9


def evict_page_cache(paths: list[Path], method: str) -> str:
    """Drop the files' pages from the page cache; returns the method that was used."""
    os.sync()  # DONTNEED only drops clean pages
    if method == "drop_caches":
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            return "drop_caches"
        except OSError:
            pass  # not permitted here: fall back to per-file fadvise
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise" if method == "fadvise" else "fadvise (drop_caches not permitted)"


def resident_fraction(paths: list[Path]) -> float | None:
    """Fraction of the files' bytes in the page cache, from util-linux fincore; None without it."""
    fincore = shutil.which("fincore")
    if fincore is None or not paths:
        return None
    resident = total = 0
    for i in range(0, len(paths), 500):
        out = subprocess.run([fincore, "--bytes", "--noheadings", "--raw", "--output", "RES,SIZE",
                              *map(str, paths[i:i + 500])], capture_output=True, text=True)
        if out.returncode != 0:
            return None
        for line in out.stdout.split("\n"):
            if line.strip():
                res, size = line.split()
                resident += int(res)
                total += int(size)
    return resident / total if total else None


# ----------------------------------------------------------------------------------------------
# Cases


@dataclass
class Row:
    tier: str
    op: str
    block_bytes: int
    blocks: int
    batch: int
    nbytes: int
    seconds: float
    gbps: float
    rpc_ms: float  # mean time per batch RPC
    limit: str
    limit_gbps: float
    notes: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.gbps / self.limit_gbps if self.limit_gbps else float("nan")


def host_case(workdir: Path, block_bytes: int, total: int, batch: int, repeats: int) -> list[Row]:
    n = total // block_bytes
    batch = min(batch, n)
    store_s, load_s, verified = [], [], True
    with Daemon(workdir, f"host{block_bytes >> 10}k", host_capacity=n * block_bytes + MiB) as d:
        client, pool = engine(d, block_bytes, n)
        try:
            warm_pool_mapping(d, client, n, batch)
            for _ in range(repeats):
                hashes = new_hashes(n)
                store_s.append(timed_store(client, hashes, batch, n))
                load_s.append(timed_load(client, hashes, batch, n, pb.TIER_HOST))
                verified &= verify_one_batch(client, pool, hashes[:batch])
                d.evict_all()
        finally:
            client.close()
            pool.close()
            pool.unlink()
    limit = memcpy_gbps(n * block_bytes)
    n_rpc = len(batches(n, batch))
    note = [] if verified else ["VERIFY FAILED"]
    common = dict(tier="host", block_bytes=block_bytes, blocks=n, batch=batch, nbytes=n * block_bytes,
                  limit="memcpy (torch copy_)", limit_gbps=limit)
    return [
        Row(op="store", seconds=statistics.median(store_s), gbps=n * block_bytes / statistics.median(store_s) / 1e9,
            rpc_ms=statistics.median(store_s) / n_rpc * 1e3, notes=note, **common),
        Row(op="load", seconds=statistics.median(load_s), gbps=n * block_bytes / statistics.median(load_s) / 1e9,
            rpc_ms=statistics.median(load_s) / n_rpc * 1e3, notes=note, **common),
    ]


def disk_case(workdir: Path, disk_dir: Path, block_bytes: int, total: int, batch: int, host_bytes: int,
              evict: str) -> list[Row]:
    n = total // block_bytes
    host_bytes = max(2 * block_bytes, min(host_bytes, total // 4))  # most of the bytes must spill
    batch = max(1, min(batch, host_bytes // (2 * block_bytes), n))  # a Store batch must fit the host tier
    host_blocks = host_bytes // block_bytes
    expect_spills = n - host_blocks
    disk_path = disk_dir / f"disk{block_bytes >> 10}k"
    # The raw limits are taken before and after the daemon's run, and the better of the two is
    # the limit: a virtual disk's throughput drifts (neighbours, host-side rate limiting).
    raw_before = raw_file_io(disk_dir, total, evict)
    with Daemon(workdir, f"disk{block_bytes >> 10}k", host_capacity=host_blocks * block_bytes,
                disk_path=str(disk_path), disk_capacity=total + host_bytes + 64 * MiB) as d:
        client, pool = engine(d, block_bytes, n)
        filler, filler_pool = engine(d, block_bytes, batch, model="filler")
        try:
            warm_pool_mapping(d, client, n, batch)
            hashes = new_hashes(n)
            os.sync()  # start with no dirty pages of earlier cases
            # Spill: stores stream through the small host tier; every host victim goes to the write queue.
            t0 = time.perf_counter()
            store_s = timed_store(client, hashes, batch, n)
            s = wait_for_spills(d, expect_spills, t0)
            t_spilled = time.perf_counter()
            os.sync()
            t_synced = time.perf_counter()
            spilled = s.counters.spills
            # Untimed: another namespace's blocks push the rest out to disk, then an admin evict frees
            # the host tier, so the cold loads below read every block from disk and their onboarding
            # into host memory never has to spill anything.
            timed_store(filler, new_hashes(host_blocks), batch, batch)
            wait_for_spills(d, n, t0)
            d.evict_namespace(filler.namespace_id)
            _, tiers = client.lookup(hashes)
            assert len(tiers) == n and all(t == pb.TIER_DISK for t in tiers), "blocks not all on disk"
            files = list(disk_path.rglob("*.kvb")) + list(disk_path.rglob("*.kvseg"))  # either disk format
            method = evict_page_cache(files, evict)
            resident = resident_fraction(files)
            before = d.stats().counters
            load_s = timed_load(client, hashes, batch, n, pb.TIER_DISK)
            after = d.stats().counters
            verified = verify_one_batch(client, pool, hashes[:batch])
            # The same block files read by plain preadv with the daemon's reader thread count:
            # what the disk and this file layout allow, without the daemon.
            evict_page_cache(files, evict)
            files_gbps = read_files_parallel(files, READER_THREADS)
        finally:
            for c, p in ((client, pool), (filler, filler_pool)):
                c.close()
                p.close()
                p.unlink()
    raw_after = raw_file_io(disk_dir, total, evict)
    raw = {k: max(raw_before[k], raw_after[k]) if k.endswith("gbps") else raw_after[k] for k in raw_after}
    drift = ", ".join(f"{k.removesuffix('_gbps').replace('_', ' ')} {raw_before[k]:.2f} / {raw_after[k]:.2f}"
                      for k in raw_after if k.endswith("gbps"))
    n_rpc_store = len(batches(n, batch))
    n_rpc_load = len(batches(n, batch))
    verify_note = [] if verified else ["VERIFY FAILED"]
    spill_bytes = spilled * block_bytes
    load_notes = [f"page cache evicted by {method}"
                  + (f", {resident:.1%} resident before the load" if resident is not None else ""),
                  f"raw read: {raw['evict_method']}"
                  + (f", {raw['resident_before_read']:.1%} resident"
                     if raw["resident_before_read"] is not None else "")]
    if after.spills != before.spills:
        load_notes.append(f"{after.spills - before.spills} spills during the loads")
    common = dict(tier="disk", block_bytes=block_bytes, batch=batch)
    load = dict(blocks=n, nbytes=n * block_bytes, seconds=load_s, gbps=n * block_bytes / load_s / 1e9,
                rpc_ms=load_s / n_rpc_load * 1e3, **common)
    return [
        Row(op="spill (page cache)", blocks=spilled, nbytes=spill_bytes, seconds=t_spilled - t0,
            gbps=spill_bytes / (t_spilled - t0) / 1e9, rpc_ms=store_s / n_rpc_store * 1e3,
            limit="raw sequential write, no fsync", limit_gbps=raw["write_page_cache_gbps"],
            notes=[f"{n} blocks stored through a {host_bytes >> 20} MiB host tier, {spilled} spilled",
                   f"raw GB/s before / after the daemon's run: {drift}"], **common),
        Row(op="spill + sync", blocks=spilled, nbytes=spill_bytes, seconds=t_synced - t0,
            gbps=spill_bytes / (t_synced - t0) / 1e9, rpc_ms=store_s / n_rpc_store * 1e3,
            limit="raw sequential write + fsync", limit_gbps=raw["write_fsync_gbps"], **common),
        Row(op="load, cold cache", limit="raw sequential read, cold", limit_gbps=raw["read_cold_gbps"],
            notes=load_notes + verify_note, **load),
        Row(op="load, cold cache", limit=f"raw preadv of the same block files, {READER_THREADS} threads, cold",
            limit_gbps=files_gbps, **load),
    ]


def wait_for_spills(d: Daemon, spills: int, t0: float) -> admin_pb2.StatsReply:
    """Poll Stats until the write queue is empty and at least `spills` spills are done."""
    while True:
        s = d.stats()
        if s.write_queue_depth == 0 and s.counters.spills >= spills:
            return s
        if time.perf_counter() - t0 > 600:
            raise TimeoutError(f"spills stuck at {s.counters.spills}/{spills}")
        time.sleep(0.005)


# ----------------------------------------------------------------------------------------------
# Report


def fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= MiB and n % MiB == 0 else f"{n >> 10} KiB"


def markdown(rows: list[Row]) -> str:
    out = ["| tier | operation | block | blocks (batch) | MiB | kvservice GB/s | ms / RPC | limit, same run | "
           "limit GB/s | ratio |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for r in rows:
        out.append(f"| {r.tier} | {r.op} | {fmt_size(r.block_bytes)} | {r.blocks} ({r.batch}) | {r.nbytes / MiB:.0f} "
                   f"| {r.gbps:.2f} | {r.rpc_ms:.1f} | {r.limit} | {r.limit_gbps:.2f} | {r.ratio:.2f} |")
    return "\n".join(out)


def machine() -> dict:
    info: dict = {"python": platform.python_version(), "torch": torch.__version__,
                  "torch_threads": torch.get_num_threads(), "nproc": os.cpu_count(),
                  "loadavg_start": os.getloadavg()}
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                info["mem_gib"] = round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    return info


def filesystem(path: Path) -> str:
    out = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True)
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or len(lines) < 2:
        return "unknown"
    dev, fstype = lines[-1].split()[:2]
    return f"{fstype} on {dev}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="64,256,1024", help="block sizes in KiB, comma-separated [64,256,1024]")
    p.add_argument("--total-mib", type=int, default=256, help="bytes moved per case, MiB [256]")
    p.add_argument("--batch", type=int, default=256, help="blocks per Store/Load RPC [256]")
    p.add_argument("--repeats", type=int, default=3, help="host-tier repetitions, median reported [3]")
    p.add_argument("--disk-host-mib", type=int, default=32, help="host tier of the disk cases, MiB [32]")
    p.add_argument("--dir", help="where the disk tier and the raw file go [a temporary directory under /tmp]")
    p.add_argument("--evict", choices=("fadvise", "drop_caches"), default="fadvise",
                   help="how to make the page cache cold before reads [fadvise on each file]")
    p.add_argument("--cases", default="host,disk", help="which tiers to run [host,disk]")
    p.add_argument("--out", help="write the figures as JSON here")
    a = p.parse_args()
    sizes = [int(s) * KiB for s in a.sizes.split(",")]
    cases = set(a.cases.split(","))
    total = a.total_mib * MiB

    workdir = Path(tempfile.mkdtemp(prefix="kvbench-", dir="/tmp"))  # short: holds the Unix sockets
    disk_dir = Path(tempfile.mkdtemp(prefix="kvbench-disk-", dir=a.dir)) if a.dir else workdir
    info = machine()
    info["disk_dir"] = str(disk_dir)
    info["filesystem"] = filesystem(disk_dir)
    print(f"kvservice tier bandwidth: {a.total_mib} MiB per case, block sizes {a.sizes} KiB, batch {a.batch}; "
          f"{info.get('cpu', '?')}, {info['nproc']} CPUs, torch {info['torch']} ({info['torch_threads']} threads); "
          f"disk dir {disk_dir} ({info['filesystem']})", flush=True)
    rows: list[Row] = []
    t_start = time.monotonic()
    try:
        for size in sizes:
            if "host" in cases:
                rows += host_case(workdir, size, total, a.batch, a.repeats)
                print(f"  host {fmt_size(size)}: store {rows[-2].gbps:.2f} GB/s, load {rows[-1].gbps:.2f} GB/s, "
                      f"memcpy {rows[-1].limit_gbps:.2f} GB/s", flush=True)
            if "disk" in cases:
                rows += disk_case(workdir, disk_dir, size, total, a.batch, a.disk_host_mib * MiB, a.evict)
                print(f"  disk {fmt_size(size)}: spill {rows[-4].gbps:.2f} GB/s (+sync {rows[-3].gbps:.2f}), "
                      f"cold load {rows[-1].gbps:.2f} GB/s; raw write {rows[-4].limit_gbps:.2f} "
                      f"(+fsync {rows[-3].limit_gbps:.2f}), raw cold read {rows[-2].limit_gbps:.2f}", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if disk_dir != workdir:
            shutil.rmtree(disk_dir, ignore_errors=True)
    info["loadavg_end"] = os.getloadavg()
    info["seconds"] = round(time.monotonic() - t_start, 1)
    print()
    print(markdown(rows))
    notes = [f"{r.tier} {r.op} {fmt_size(r.block_bytes)}: {'; '.join(r.notes)}" for r in rows if r.notes]
    if notes:
        print("\nNotes:\n" + "\n".join(f"- {n}" for n in notes))
    print(f"\n{info['seconds']} s; load average {info['loadavg_start'][0]:.2f} at start, "
          f"{info['loadavg_end'][0]:.2f} at end")
    if a.out:
        Path(a.out).write_text(json.dumps({
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": info, "params": vars(a),
            "rows": [asdict(r) | {"ratio": r.ratio} for r in rows]}, indent=2) + "\n")
        print(f"wrote {a.out}")
    return 1 if any("VERIFY FAILED" in r.notes for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
