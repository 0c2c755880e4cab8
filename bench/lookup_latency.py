"""Lookup latency of 1024 hashes over the Unix socket (DESIGN §7: p50 <= 0.3 ms, p99 <= 1 ms),
beside the floors measured in the same run, as an engine calls it.

    .venv/bin/python bench/lookup_latency.py [--hashes 1024] [--iters 2000] [--stored 1024]

Starts a real daemon subprocess, stores `--stored` blocks, then times, one call at a time:
  floor       gRPC alone: an empty unary call to a bare grpc.aio echo server (a subprocess, Unix
              socket, no interceptor, no servicer), from a synchronous and from a grpc.aio channel;
              and the daemon's Heartbeat (the empty round trip of the daemon) on both kinds of channel
  Lookup      raw stubs (grpc.aio in its loop; synchronous channel), and what an engine calls:
              KVClient.lookup and KVClient.submit_lookup(...).result() (the synchronous facade, which
              sends Lookup on its own synchronous channel), AsyncKVClient.lookup in its loop.
Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # noqa: E402

from engine_client import AsyncKVClient, BlockHasher, KVClient, Namespace, ShmKVPool  # noqa: E402
from kvwire.v1 import kvcache_pb2, kvcache_pb2_grpc  # noqa: E402
from tests.daemon_kit import Daemon  # noqa: E402

WARMUP = 50


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def timed_sync(call: Callable[[], object], iters: int) -> list[float]:
    for _ in range(WARMUP):
        call()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        call()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


async def timed_async(call, iters: int) -> list[float]:
    for _ in range(WARMUP):
        await call()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        await call()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _ident(x: bytes) -> bytes:
    return x


def echo_server(path: str) -> None:
    """The floor: a bare grpc.aio server with one unary method that returns its request."""
    async def echo(request: bytes, context) -> bytes:
        return request

    async def main() -> None:
        server = grpc.aio.server()
        handler = grpc.method_handlers_generic_handler(
            "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo, _ident, _ident)})
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"unix:{path}")
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()
    asyncio.run(main())


def bare_floor(iters: int) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory(prefix="kvecho") as d:
        path = f"{d}/echo.sock"
        p = subprocess.Popen([sys.executable, __file__, "--role", "echo", "--socket", path], stdout=subprocess.PIPE,
                             text=True)
        try:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
            out = {}
            with grpc.insecure_channel(f"unix:{path}") as ch:
                f = ch.unary_unary("/bench.Echo/Echo", request_serializer=_ident, response_deserializer=_ident)
                out["sync"] = timed_sync(lambda: f(b"", timeout=10), iters)

            async def aio() -> list[float]:
                async with grpc.aio.insecure_channel(f"unix:{path}") as ch:
                    f = ch.unary_unary("/bench.Echo/Echo", request_serializer=_ident, response_deserializer=_ident)
                    return await timed_async(lambda: f(b"", timeout=10), iters)
            out["aio"] = asyncio.run(aio())
            return out
        finally:
            p.terminate()
            p.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hashes", type=int, default=1024)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--stored", type=int, default=1024, help="how many of the looked-up blocks are stored")
    p.add_argument("--role", default="bench")
    p.add_argument("--socket", default="")
    a = p.parse_args()
    if a.role == "echo":
        return echo_server(a.socket)
    ns = Namespace("bench-lookup", "float16", 16, "block-contiguous")
    block_bytes = 4096
    rows: list[tuple[str, list[float]]] = []
    bare = bare_floor(a.iters)
    rows += [("floor: bare grpc.aio echo server, empty call, sync channel", bare["sync"]),
             ("floor: bare grpc.aio echo server, empty call, grpc.aio channel", bare["aio"])]
    with Daemon(host_capacity="64MiB", disk_capacity="", extra=["--lease-seconds", "600"]) as d, \
            ShmKVPool(max(a.stored, 1), block_bytes) as pool, \
            KVClient(d.target, ns, pool, client_name="lookup bench") as client:
        hashes = BlockHasher(ns).hash_blocks(list(range(16 * a.hashes)))
        if a.stored:
            client.store(hashes[: a.stored], list(range(a.stored)))
        hb = kvcache_pb2.HeartbeatRequest(session_id=client.session_id)
        lk = kvcache_pb2.LookupRequest(session_id=client.session_id, hashes=b"".join(hashes))  # packed: n x 32 bytes
        with grpc.insecure_channel(d.target) as ch:
            stub = kvcache_pb2_grpc.KVCacheStub(ch)
            rows.append(("daemon Heartbeat, sync channel", timed_sync(lambda: stub.Heartbeat(hb, timeout=10), a.iters)))
            sync_lookup = timed_sync(lambda: stub.Lookup(lk, timeout=10), a.iters)

        async def aio() -> tuple[list[float], list[float], list[float]]:
            async with grpc.aio.insecure_channel(d.target) as ch:
                stub = kvcache_pb2_grpc.KVCacheStub(ch)
                h = await timed_async(lambda: stub.Heartbeat(hb, timeout=10), a.iters)
                lookup = await timed_async(lambda: stub.Lookup(lk, timeout=10), a.iters)
            async with AsyncKVClient(d.target, ns, pool, client_name="lookup bench async") as ac:
                engine = await timed_async(lambda: ac.lookup(hashes), a.iters)
            return h, lookup, engine
        hb_aio, aio_lookup, async_client = asyncio.run(aio())
        rows.append(("daemon Heartbeat, grpc.aio channel", hb_aio))
        rows.append((f"Lookup x{a.hashes}, raw stub, sync channel", sync_lookup))
        rows.append((f"Lookup x{a.hashes}, raw stub, grpc.aio channel", aio_lookup))
        rows.append((f"Lookup x{a.hashes}, KVClient.lookup (engine view)", timed_sync(lambda: client.lookup(hashes),
                                                                                      a.iters)))
        rows.append((f"Lookup x{a.hashes}, KVClient.submit_lookup().result() (engine view)",
                     timed_sync(lambda: client.submit_lookup(hashes).result(), a.iters)))
        rows.append((f"Lookup x{a.hashes}, AsyncKVClient.lookup in its loop", async_client))
        assert client.lookup(hashes)[0] == min(a.stored, a.hashes)
    print(f"Lookup of {a.hashes} hashes ({a.stored} stored), {a.iters} calls one at a time, Unix socket; "
          "target p50 <= 0.3 ms, p99 <= 1 ms\n")
    print("| call | p50 ms | p99 ms | mean ms |")
    print("| --- | ---: | ---: | ---: |")
    for name, xs in rows:
        print(f"| {name} | {pct(xs, 0.5):.3f} | {pct(xs, 0.99):.3f} | {statistics.mean(xs):.3f} |")


if __name__ == "__main__":
    main()
