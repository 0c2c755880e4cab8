#!/usr/bin/env python3
"""Daemon memory under traffic (DESIGN §7: "daemon memory under any traffic <= host capacity + a
fixed overhead you state"): 8 engine processes of mixed traffic against one daemon, its RSS
sampled throughout, beside the host capacity and the daemon's RSS with an empty host tier.

    .venv/bin/python bench/daemon_memory.py [--engines 8] [--host-mib 256] [--block-kib 64] [--rounds 40]

Each engine (harness/engine_proc.py, a shared-memory pool) stores batches of new blocks (a third
retained), loads back a hot block of every earlier batch and a few random ones, prefetches and
looks up, so the host tier churns, spills to disk and onboards. Prints a Markdown table:
overhead = peak RSS - host capacity, and growth = peak RSS - RSS right after start (the arena is
faulted in at start, so growth is what traffic adds).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.daemon import Daemon  # noqa: E402
from harness.engine import EngineProc  # noqa: E402

MiB = 1 << 20


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024
    return 0


def engine_traffic(eng: EngineProc, k: int, rounds: int, batch: int, errors: list) -> None:
    rng = random.Random(k)
    hot: list[int] = []
    try:
        for r in range(rounds):
            base = 10_000_000 * (k + 1) + r * batch
            nums = list(range(base, base + batch))
            eng.call("store", numbers=nums, ttl=600 if r % 3 == 0 else 0)
            hot.append(nums[0])
            probe = hot[-8:] + rng.sample(range(10_000_000 * (k + 1), base + batch), 4)
            res = eng.call("load", numbers=probe, slots=list(range(batch, batch + len(probe))))
            if not all(x for x, s in zip(res["exact"], res["status"]) if s == 1):
                errors.append(f"engine {k}: wrong bytes")
            eng.call("prefetch", numbers=hot[-4:])
            eng.call("lookup", numbers=nums)
    except Exception as e:  # noqa: BLE001
        errors.append(f"engine {k}: {e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--host-mib", type=int, default=256)
    p.add_argument("--block-kib", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=40)
    a = p.parse_args()
    bb = a.block_kib << 10
    with Daemon(host_capacity=a.host_mib * MiB, disk_capacity=4 * a.host_mib * MiB, lease_seconds=30) as d:
        pid = d.proc.pid
        time.sleep(0.5)
        start = rss(pid)
        engines = [EngineProc(d.target, "--blocks", str(a.batch + 16), "--block-bytes", str(bb), "--model", f"m{k % 3}")
                   for k in range(a.engines)]
        errors: list[str] = []
        peak = [start]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], rss(pid))
                time.sleep(0.02)
        sampler = threading.Thread(target=sample)
        sampler.start()
        t0 = time.perf_counter()
        workers = [threading.Thread(target=engine_traffic, args=(e, k, a.rounds, a.batch, errors)) for k, e in enumerate(engines)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        took = time.perf_counter() - t0
        done.set()
        sampler.join()
        s = d.stats()
        for e in engines:
            e.close()
        end = rss(pid)
    stored = a.engines * a.rounds * a.batch * bb
    cap = a.host_mib * MiB
    print(f"Daemon memory, {a.engines} engines x {a.rounds} rounds of {a.batch} x {a.block_kib} KiB blocks "
          f"({stored / MiB:.0f} MiB stored in {took:.1f} s), host tier {a.host_mib} MiB, disk {4 * a.host_mib} MiB, "
          f"{os.cpu_count()} CPUs\n")
    print("| RSS after start | peak RSS | RSS at end | host capacity | overhead (peak - capacity) | growth (peak - start) |"
          " spills | disk onboards | errors |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    print(f"| {start / MiB:.0f} MiB | {peak[0] / MiB:.0f} MiB | {end / MiB:.0f} MiB | {cap / MiB:.0f} MiB | "
          f"{(peak[0] - cap) / MiB:.0f} MiB | {(peak[0] - start) / MiB:.0f} MiB | {s.counters.spills} | "
          f"{s.counters.disk_onboards} | {len(errors)} |")
    for e in errors[:5]:
        print("error:", e)
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
