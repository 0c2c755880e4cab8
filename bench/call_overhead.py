#!/usr/bin/env python3
"""Per-call cost of Store and Load as an engine sees it, split into the daemon's own time and the rest.

    .venv/bin/python bench/call_overhead.py [--block-bytes 4096] [--blocks 16,256,8192,32768] [--calls 200]

For each batch size, against a fresh daemon (harness/daemon.py, host tier of 4 batches, no disk tier) and a
ShmKVPool client per --routes (KVClient on the daemon's frames channel, and with lookup_channel=False on
gRPC; their calls interleaved): --calls Stores of new hashes, each followed by a Load of them into other
pool blocks. Per call: the wall time the client sees, and the daemon's own time (the
difference of Admin.Stats' store / load latency sums around the call: BlockCache's work and its copies,
no gRPC). "outside" = the rest: gRPC, the request and reply conversions, the client's loop thread. The
first 5 calls of each size are warm-up. On the channel route the client's own part of "outside" is
split out: "client before" (from the call to its request handed to the socket: packing, encoding, and
the hop to the client's loop thread where the call takes that path) and "client after" (from the whole answer read to the call's return). Prints medians in a Markdown table (ms) and, as the floor of
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
from engine_client import lookup_channel  # noqa: E402
from harness.daemon import Daemon  # noqa: E402
from kvwire.v1 import kvcache_pb2  # noqa: E402

WARMUP = 5
_SENT: dict[str, float] = {}  # the client's last frames-channel round trip: when it began writing, when the answer was read


def _timed_round_trips() -> None:
    """Stamp the start and end of every frames-channel round trip of this process (the client's side): the
    blocking LookupChannel's (KVClient's one-batch Store and Load, from the caller's thread) and the
    AsyncLookupChannel's (from the client's loop)."""
    real_async = lookup_channel.AsyncLookupChannel._round_trip
    real_sync = lookup_channel.LookupChannel._round_trip

    async def stamped_async(self, request, limit):
        _SENT["send"] = time.perf_counter()
        try:
            return await real_async(self, request, limit)
        finally:
            _SENT["answer"] = time.perf_counter()

    def stamped_sync(self, sock, framed, limit):
        _SENT["send"] = time.perf_counter()
        try:
            return real_sync(self, sock, framed, limit)
        finally:
            _SENT["answer"] = time.perf_counter()
    lookup_channel.AsyncLookupChannel._round_trip = stamped_async
    lookup_channel.LookupChannel._round_trip = stamped_sync


def measure(block_bytes: int, n: int, calls: int, routes: list[str]) -> dict[tuple[str, str], tuple[float, ...]]:
    """Per (call, route): medians of (wall, the daemon's own, outside, client before, client after) in ms
    (the client's parts nan off the channel route); the routes' calls interleaved."""
    with Daemon(tag="ovh", host_capacity=4 * n * block_bytes, disk_capacity=0, lease_seconds=None,
                extra=["--max-batch-blocks", str(max(1024, n))]) as d, ShmKVPool(2 * n, block_bytes) as pool:
        clients = {route: KVClient(d.target, Namespace("overhead", "bfloat16", 16, "x"), pool,
                                   client_name=f"bench/call_overhead.py {route}", timeout=120,
                                   lookup_channel=route == "channel") for route in routes}
        for c in clients.values():
            c.connect(required=True)

        def own(name: str) -> float:
            return next((x.sum for x in d.admin("Stats").latencies if x.name == name), 0.0)

        rows: dict[tuple[str, str], list[tuple[float, ...]]] = {
            (name, route): [] for name in ("store", "load") for route in routes}
        for k in range(calls + WARMUP):
            for route, c in clients.items():
                hs = [os.urandom(32) for _ in range(n)]
                for name, call, ids, want in (("store", c.store, range(n), kvcache_pb2.STORED),
                                              ("load", c.load, range(n, 2 * n), kvcache_pb2.LOADED)):
                    a = own(name)
                    _SENT.clear()
                    t0 = time.perf_counter()
                    res = call(hs, list(ids))
                    t1 = time.perf_counter()
                    wall = t1 - t0
                    b = own(name)
                    split = ((_SENT["send"] - t0, t1 - _SENT["answer"]) if route == "channel" and len(_SENT) == 2
                             else (float("nan"), float("nan")))
                    if len(res.statuses) != n or list(res.statuses).count(want) != n:
                        raise RuntimeError(f"{name} of {n}: not every block {want}: {res[0]}")
                    if k >= WARMUP:
                        rows[name, route].append((wall, b - a, *split))
        for c in clients.values():
            c.close()
    def med(xs: list[tuple[float, ...]], f) -> float:
        return statistics.median(map(f, xs)) * 1e3
    return {key: (med(xs, lambda x: x[0]), med(xs, lambda x: x[1]), med(xs, lambda x: x[0] - x[1]),
                  med(xs, lambda x: x[2]), med(xs, lambda x: x[3])) for key, xs in rows.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--block-bytes", type=int, default=4096)
    ap.add_argument("--blocks", default="16,256,8192,32768", help="batch sizes (blocks per call), comma-separated")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--routes", default="channel,grpc",
                    help="channel: the daemon's frames channel (KVClient's default); grpc: lookup_channel=False")
    args = ap.parse_args()
    routes = args.routes.split(",")
    _timed_round_trips()
    print(f"Per-call cost, {args.block_bytes}-byte blocks, {args.calls} calls each (medians, ms)\n")
    print("| call | route | blocks | end to end | the daemon's own | outside the daemon | client before | client after |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- |")
    for n in (int(x) for x in args.blocks.split(",")):
        got = measure(args.block_bytes, n, args.calls if n <= 4096 else max(10, args.calls // 10), routes)
        for (name, route), (wall, own, outside, before, after) in got.items():
            print(f"| {name} | {route} | {n} | {wall:.2f} | {own:.2f} | {outside:.2f} | {before:.2f} | {after:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
