#!/usr/bin/env python3
"""Per-call cost of Store and Load as an engine sees it, split into the daemon's own time and the rest.

    .venv/bin/python bench/call_overhead.py [--block-bytes 4096] [--blocks 16,256,8192,32768] [--calls 200]

For each batch size, against a fresh daemon (harness/daemon.py, host tier of 4 batches, no disk tier) and a
ShmKVPool client per --routes (KVClient on the daemon's frames channel, and with lookup_channel=False on
gRPC; their calls interleaved): --calls Stores of new hashes, each followed by a Load of them into other
pool blocks. Per call: the wall time the client sees, and the daemon's own time (the
difference of Admin.Stats' store / load latency sums around the call: BlockCache's work and its copies,
no gRPC). "outside" = the rest: gRPC, the request and reply conversions, the client's loop thread. The
first 5 calls of each size are warm-up. Prints medians in a Markdown table (ms) and, as the floor of
the outside part, nothing: bench/lookup_latency.py measures the empty gRPC round trip.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine_client import KVClient, Namespace, ShmKVPool  # noqa: E402
from harness.daemon import Daemon  # noqa: E402
from kvwire.v1 import kvcache_pb2  # noqa: E402

WARMUP = 5


def measure(block_bytes: int, n: int, calls: int, routes: list[str]) -> dict[tuple[str, str], tuple[float, float, float]]:
    """Per (call, route): medians of (wall, the daemon's own, outside) in ms; the routes' calls interleaved."""
    with Daemon(tag="ovh", host_capacity=4 * n * block_bytes, disk_capacity=0, lease_seconds=None,
                extra=["--max-batch-blocks", str(max(1024, n))]) as d, ShmKVPool(2 * n, block_bytes) as pool:
        clients = {route: KVClient(d.target, Namespace("overhead", "bfloat16", 16, "x"), pool,
                                   client_name=f"bench/call_overhead.py {route}", timeout=120,
                                   lookup_channel=route == "channel") for route in routes}
        for c in clients.values():
            c.connect(required=True)

        def own(name: str) -> float:
            return next((x.sum for x in d.admin("Stats").latencies if x.name == name), 0.0)

        rows: dict[tuple[str, str], list[tuple[float, float]]] = {
            (name, route): [] for name in ("store", "load") for route in routes}
        for k in range(calls + WARMUP):
            for route, c in clients.items():
                hs = [os.urandom(32) for _ in range(n)]
                for name, call, ids, want in (("store", c.store, range(n), kvcache_pb2.STORED),
                                              ("load", c.load, range(n, 2 * n), kvcache_pb2.LOADED)):
                    a = own(name)
                    t0 = time.perf_counter()
                    res = call(hs, list(ids))
                    wall = time.perf_counter() - t0
                    b = own(name)
                    if len(res.statuses) != n or list(res.statuses).count(want) != n:
                        raise RuntimeError(f"{name} of {n}: not every block {want}: {res[0]}")
                    if k >= WARMUP:
                        rows[name, route].append((wall, b - a))
        for c in clients.values():
            c.close()
    return {key: (statistics.median(w for w, _ in xs) * 1e3, statistics.median(o for _, o in xs) * 1e3,
                  statistics.median(w - o for w, o in xs) * 1e3) for key, xs in rows.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--block-bytes", type=int, default=4096)
    ap.add_argument("--blocks", default="16,256,8192,32768", help="batch sizes (blocks per call), comma-separated")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--routes", default="channel,grpc",
                    help="channel: the daemon's frames channel (KVClient's default); grpc: lookup_channel=False")
    args = ap.parse_args()
    routes = args.routes.split(",")
    print(f"Per-call cost, {args.block_bytes}-byte blocks, {args.calls} calls each (medians, ms)\n")
    print("| call | route | blocks | end to end | the daemon's own | outside the daemon |\n"
          "| --- | --- | --- | --- | --- | --- |")
    for n in (int(x) for x in args.blocks.split(",")):
        got = measure(args.block_bytes, n, args.calls if n <= 4096 else max(10, args.calls // 10), routes)
        for (name, route), (wall, own, outside) in got.items():
            print(f"| {name} | {route} | {n} | {wall:.2f} | {own:.2f} | {outside:.2f} |", flush=True)


if __name__ == "__main__":
    main()
