"""What an Admin.Stats call (and a Prometheus /metrics scrape) costs a daemon with many blocks.

    .venv/bin/python bench/stats_cost.py [--blocks 100000] [--block-bytes 1024] [--calls 300] [--disk]

Starts the daemon through the shared process harness (harness/daemon.py), fills its host tier with
--blocks blocks through KVClient (batches of 4096; every 7th batch stored with a TTL, so retained
counts are not all zero; with --disk a disk tier too and 10% more blocks than the host tier holds,
so some spill), then times --calls Admin.Stats calls on one gRPC channel over the Unix socket, one
after another, and as many /metrics scrapes, beside the same number of grpc.health.v1 Checks on the
same channel (the round trip with no work in it). Both Stats views run on the daemon's event loop:
what a call costs above the Check is what every engine's Store / Load / Lookup waits behind.
Prints p50 / p99 / max in ms.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from engine_client import KVClient, Namespace, ShmKVPool  # noqa: E402
from harness.daemon import Daemon, free_tcp_port  # noqa: E402
from kvwire.v1 import admin_pb2, admin_pb2_grpc  # noqa: E402
from lookup_latency import pct  # noqa: E402  (bench/ is this script's directory)

BATCH = 4096


def timed(fn, calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--blocks", type=int, default=100_000)
    p.add_argument("--block-bytes", type=int, default=1024)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--disk", action="store_true", help="a disk tier too; 10%% more blocks than the host tier holds")
    a = p.parse_args()
    bb, n = a.block_bytes, a.blocks
    host_blocks = n if not a.disk else int(n / 1.1)
    metrics = f"127.0.0.1:{free_tcp_port()}"
    d = Daemon(host_capacity=host_blocks * bb + (1 << 20), disk_capacity=(2 * n * bb + (256 << 20)) if a.disk else 0,
               lease_seconds=None, log_level="warning", extra=["--max-batch-blocks", str(BATCH), "--metrics", metrics])
    pool = ShmKVPool(BATCH, bb)
    try:
        d.start(timeout=120)
        with KVClient(d.target, Namespace("bench-stats", "uint8", 16, "block-contiguous"), pool,
                      client_name="bench/stats_cost.py", timeout=600.0) as kv:
            t0 = time.perf_counter()
            for k, lo in enumerate(range(0, n, BATCH)):
                hi = min(n, lo + BATCH)
                res = kv.store([os.urandom(32) for _ in range(hi - lo)], list(range(hi - lo)),
                               ttl_seconds=3600.0 if k % 7 == 0 else 0.0)
                assert all(r.status == 1 for r in res), res[0]
            fill_s = time.perf_counter() - t0
            s = d.settle(timeout=300)
            tiers = {t.name: t for t in s.tiers}
            print(f"{n} blocks of {bb} B stored in {fill_s:.1f} s; host tier {tiers['host'].blocks} blocks "
                  f"({tiers['host'].retained_blocks} retained)"
                  + (f", disk tier {tiers['disk'].blocks}" if "disk" in tiers else ""))
            with grpc.insecure_channel(d.target) as ch:
                admin, health = admin_pb2_grpc.AdminStub(ch), health_pb2_grpc.HealthStub(ch)
                stats = lambda: admin.Stats(admin_pb2.StatsRequest(), timeout=30)  # noqa: E731
                check = lambda: health.Check(health_pb2.HealthCheckRequest(service=""), timeout=30)  # noqa: E731
                scrape = lambda: urllib.request.urlopen(f"http://{metrics}/metrics", timeout=30).read()  # noqa: E731
                for fn in (stats, check, scrape):  # warm up
                    timed(fn, 5)
                rows = [("Admin.Stats", timed(stats, a.calls)), ("health Check (round trip)", timed(check, a.calls)),
                        ("/metrics scrape", timed(scrape, a.calls))]
        print(f"{a.calls} calls each, one after another, ms:")
        print("| call | p50 | p99 | max | mean |")
        print("|---|---|---|---|---|")
        for name, xs in rows:
            print(f"| {name} | {pct(xs, 0.5):.2f} | {pct(xs, 0.99):.2f} | {max(xs):.2f} | {statistics.mean(xs):.2f} |")
    finally:
        try:
            d.stop(timeout=120)
        finally:
            d.close()
            pool.close()
            pool.unlink()


if __name__ == "__main__":
    main()
