"""Lookup latency of 1024 hashes over the Unix socket (DESIGN §7: p50 <= 0.3 ms, p99 <= 1 ms),
beside the floor measured in the same run: an empty round trip (Heartbeat) on the same channel.

    .venv/bin/python bench/lookup_latency.py [--hashes 1024] [--iters 2000] [--stored 1024]
Starts a real daemon subprocess, stores `--stored` blocks, then times Lookup with the async
client (grpc.aio stub, one call at a time) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # noqa: E402

from engine_client import BlockHasher, KVClient, Namespace, ShmKVPool  # noqa: E402
from kvwire.v1 import kvcache_pb2, kvcache_pb2_grpc  # noqa: E402
from tests.daemon_kit import Daemon  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def timed(stub_call, request, iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        await stub_call(request, timeout=10)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


async def measure(target: str, session: str, hashes: list[bytes], iters: int) -> tuple[list[float], list[float]]:
    async with grpc.aio.insecure_channel(target) as ch:
        stub = kvcache_pb2_grpc.KVCacheStub(ch)
        hb = kvcache_pb2.HeartbeatRequest(session_id=session)
        lk = kvcache_pb2.LookupRequest(session_id=session, hashes=b"".join(hashes))  # packed: n x 32 bytes
        await timed(stub.Heartbeat, hb, 50)  # warm up
        await timed(stub.Lookup, lk, 50)
        return await timed(stub.Heartbeat, hb, iters), await timed(stub.Lookup, lk, iters)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hashes", type=int, default=1024)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--stored", type=int, default=1024, help="how many of the looked-up blocks are stored")
    a = p.parse_args()
    ns = Namespace("bench-lookup", "float16", 16, "block-contiguous")
    block_bytes = 4096
    with Daemon(host_capacity="64MiB", disk_capacity="", extra=["--lease-seconds", "600"]) as d, \
            ShmKVPool(max(a.stored, 1), block_bytes) as pool, \
            KVClient(d.target, ns, pool, client_name="lookup bench") as client:
        hashes = BlockHasher(ns).hash_blocks(list(range(16 * a.hashes)))
        if a.stored:
            client.store(hashes[: a.stored], list(range(a.stored)))
        hb, lk = asyncio.run(measure(d.target, client.session_id, hashes, a.iters))
    print(f"Lookup of {a.hashes} hashes ({a.stored} stored), {a.iters} calls one at a time, Unix socket, grpc.aio\n")
    print("| call | p50 ms | p99 ms | mean ms | p50 / floor p50 | target p50 / p99 |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    floor = pct(hb, 0.5)
    print(f"| Heartbeat (floor: empty round trip) | {floor:.3f} | {pct(hb, 0.99):.3f} | {statistics.mean(hb):.3f} | 1.00 | - |")
    print(f"| Lookup x{a.hashes} | {pct(lk, 0.5):.3f} | {pct(lk, 0.99):.3f} | {statistics.mean(lk):.3f} | "
          f"{pct(lk, 0.5) / floor:.2f} | 0.3 / 1.0 ms |")


if __name__ == "__main__":
    main()
