"""Restart of a daemon holding many small blocks on disk, as an engine sees it (issue 13's restart line).

    .venv/bin/python bench/restart_daemon.py [--blocks 1000000] [--dir /tmp] [--block-bytes 4096]

Stores --blocks blocks (each its own byte pattern; every 7th batch with a TTL) through KVClient into a daemon
with a small host tier, so nearly all of them spill to the disk tier (segments format); waits until the
spills are written, stops the daemon with SIGTERM, drops the page cache (root), starts a new daemon on the
same disk directory and times it to grpc.health SERVING (process start, imports and the index build
included); then Loads every block back through a new KVClient session and compares every byte. Blocks that
were only in host memory at the stop are allowed to be MISSING (the README: host-only copies do not
survive a restart); every block the disk tier held must load exact, and no block may come back wrong.
Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from engine_client import KVClient, Namespace, ShmKVPool
from harness.daemon import Daemon
from kvwire.v1 import kvcache_pb2

MiB = 1 << 20
kcp = kvcache_pb2


def drop_caches() -> str:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "dropped"
    except OSError as e:
        return f"not dropped ({e.strerror})"


def disk_blocks(d: Daemon) -> int:
    return {t.name: t.blocks for t in d.stats().tiers}.get("disk", 0)


def fill(pool: ShmKVPool, lo: int, hi: int, words: int) -> None:
    """Block i of the run holds the int64 words i*words .. (i+1)*words - 1 (pool slot i - lo)."""
    pool.buffer.view(torch.int64)[: (hi - lo) * words] = torch.arange(lo * words, hi * words, dtype=torch.int64)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=1_000_000)
    p.add_argument("--block-bytes", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--dir", default="/tmp")
    a = p.parse_args()
    n, bb, batch, words = a.blocks, a.block_bytes, a.batch, a.block_bytes // 8
    hashes = [hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest() for i in range(n)]
    ns = Namespace("bench-restart", "float16", 16, "block-contiguous")
    capacity = n * (bb + 512) + 256 * MiB
    work = os.path.join(a.dir, f"restart-daemon-{os.getpid()}")
    kw = {"host_capacity": "64MiB", "disk_capacity": capacity, "disk_path": os.path.join(work, "disk"),
          "io_backend": "auto", "lease_seconds": None, "log_level": "warning", "extra": ["--disk-format", "segments"]}
    out: dict = {"blocks": n, "block_bytes": bb}
    with ShmKVPool(batch, bb) as pool:
        d = Daemon(os.path.join(work, "d1"), **kw)
        try:
            d.start(timeout=120)
            with KVClient(d.target, ns, pool, client_name="restart bench") as c:
                t0 = time.perf_counter()
                stored = 0
                for k, lo in enumerate(range(0, n, batch)):
                    hi = min(n, lo + batch)
                    fill(pool, lo, hi, words)
                    res = c.store(hashes[lo:hi], list(range(hi - lo)), ttl_seconds=86400.0 if k % 7 == 0 else 0.0)
                    stored += sum(1 for s in res.statuses if s == kcp.STORED)
                out["store_s"] = time.perf_counter() - t0
            out["stored"] = stored
            d.settle(timeout=600)
            out["on_disk_before_stop"] = disk_blocks(d)
            out["stop_status"] = d.stop(timeout=300)
        finally:
            d.close()
        out["page_cache"] = drop_caches()
        out["load_average"] = os.getloadavg()[0]
        d = Daemon(os.path.join(work, "d2"), **kw)
        try:
            d.start(timeout=300)
            out["serving_s"] = d.start_seconds
            out["indexed_after_restart"] = disk_blocks(d)
            counts = {"exact": 0, "wrong": 0, "missing": 0, "failed": 0}
            poison = torch.full((batch * words,), -1, dtype=torch.int64)
            with KVClient(d.target, ns, pool, client_name="restart bench, after") as c:
                t0 = time.perf_counter()
                for lo in range(0, n, batch):
                    hi = min(n, lo + batch)
                    view = pool.buffer.view(torch.int64)
                    view[:] = poison
                    res = c.load(hashes[lo:hi], list(range(hi - lo)))
                    expect = torch.arange(lo * words, hi * words, dtype=torch.int64).view(hi - lo, words)
                    same = (view[: (hi - lo) * words].view(hi - lo, words) == expect).all(dim=1).tolist()
                    for s, ok in zip(res.statuses, same):
                        if s == kcp.LOADED:
                            counts["exact" if ok else "wrong"] += 1
                        elif s == kcp.MISSING:
                            counts["missing"] += 1
                        else:
                            counts["failed"] += 1
                out["load_s"] = time.perf_counter() - t0
            out.update(counts)
        finally:
            d.close()
    shutil.rmtree(work, ignore_errors=True)
    print(f"Restart with {n} blocks of {bb} bytes through the daemon ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"page cache {out['page_cache']}, load average {out['load_average']:.1f})\n")
    print("| stored | on disk at the stop | indexed after restart | SERVING s | loaded exact | wrong | missing | "
          "failed | store s | load-all s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(f"| {out['stored']} | {out['on_disk_before_stop']} | {out['indexed_after_restart']} | {out['serving_s']:.1f} | "
          f"{out['exact']} | {out['wrong']} | {out['missing']} | {out['failed']} | {out['store_s']:.1f} | "
          f"{out['load_s']:.1f} |")
    ok = out["wrong"] == 0 and out["failed"] == 0 and out["exact"] >= out["on_disk_before_stop"]
    print(f"\nevery block the disk held loads exact, none wrong: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
