"""Lookup latency of 1024 hashes as an engine sees it (DESIGN §7: p50 <= 0.3 ms, p99 <= 1 ms), on
each channel the daemon serves it on, each beside that channel's empty round trip, in one run.

    .venv/bin/python bench/lookup_latency.py [--hashes 1024] [--iters 2000] [--stored 1024]
        [--namespace-blocks 200000 [--scatter]] [--channel-only]

Starts a real daemon subprocess, stores `--stored` blocks of the looked-up chain (and, with
`--namespace-blocks N`, other blocks of the same namespace up to N in all: a daemon's dict probes
miss the CPU caches once its index is large; `--scatter` spreads the chain's blocks among them, one
Store batch after another, instead of one run as an engine's prompt stores them), then times, one
call at a time:
  Lookup channel  the daemon's plain Unix socket (<socket_path>.lookup, kvservice/api/lookup_channel.py):
                  its empty round trip (KVClient.lookup of 0 hashes), and Lookup of `--hashes` through
                  KVClient.lookup, KVClient.submit_lookup(...).result() and submit_lookup until its done
                  callback runs (what model_runner's scheduler waits for), and as raw frames, no client;
  gRPC            the same through a KVClient(lookup_channel=False) (a synchronous gRPC channel from the
                  caller's thread), raw stubs, the daemon's Heartbeat;
  (both)          AsyncKVClient.lookup in its own event loop, with and without the channel;
  floor           gRPC alone: an empty unary call to a bare grpc.aio echo server (a subprocess, Unix
                  socket, no interceptor, no servicer), from a synchronous and from a grpc.aio channel.
The synchronous calls are interleaved in `--rounds` rounds (a busy box's noise falls on all alike);
the two grpc.aio rows run after them. Checks that both channels answer the same. Prints one Markdown table, the ratio of each KVClient
Lookup to the target, and whether the target holds. `--channel-only`: the Lookup channel's rows
alone (no gRPC, no floor, no AsyncKVClient), for quick A/B runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # noqa: E402

from engine_client import AsyncKVClient, BlockHasher, KVClient, Namespace, ShmKVPool  # noqa: E402
from harness.daemon import Daemon  # noqa: E402
from kvwire.lookup_frames import frame, lookup_socket_path, read_frame  # noqa: E402
from kvwire.v1 import kvcache_pb2, kvcache_pb2_grpc  # noqa: E402

WARMUP = 50


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


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


class EchoServer:
    """The floor's server: a bare grpc.aio echo server in a subprocess, for the duration of a with."""

    def __enter__(self) -> EchoServer:
        self._dir = tempfile.TemporaryDirectory(prefix="kvecho")
        self.target = f"unix:{self._dir.name}/echo.sock"
        self._proc = subprocess.Popen([sys.executable, __file__, "--role", "echo", "--socket",
                                       f"{self._dir.name}/echo.sock"], stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None and self._proc.stdout.readline().strip() == "ready"
        return self

    def __exit__(self, *exc: object) -> None:
        self._proc.terminate()
        self._proc.wait()
        self._dir.cleanup()


TARGET_P50_MS, TARGET_P99_MS = 0.3, 1.0
STORE_BATCH = 1024


def fill_namespace(client: KVClient, chain: list[bytes], others: int, scatter: bool) -> None:
    """Store the chain's blocks and `others` random ones, in Store batches of STORE_BATCH: the chain
    first as one run, or (scatter) each batch holding an equal share of the chain among the others."""
    rng = random.Random(10)
    filler = [rng.randbytes(32) for _ in range(others)]
    if scatter and chain and filler:
        batches = max(1, -(-(len(chain) + len(filler)) // STORE_BATCH))
        order: list[bytes] = []
        for b in range(batches):
            order += chain[b * len(chain) // batches:(b + 1) * len(chain) // batches]
            order += filler[b * len(filler) // batches:(b + 1) * len(filler) // batches]
    else:
        order = chain + filler
    for i in range(0, len(order), STORE_BATCH):
        part = order[i:i + STORE_BATCH]
        statuses = client.store(part, list(range(len(part)))).statuses
        assert set(statuses) == {kvcache_pb2.STORED}, f"Store batch {i // STORE_BATCH}: {sorted(set(statuses))}"


def to_callback(client: KVClient, hashes: list[bytes]) -> Callable[[], float]:
    """One submit_lookup() until its done callback runs, in ms: what model_runner's scheduler waits
    for (it never calls result(); the callback runs on the client's thread that got the answer)."""
    done = threading.Event()
    t = [0.0, 0.0]

    def answered(_f: object) -> None:
        t[1] = time.perf_counter()
        done.set()

    def call() -> float:
        done.clear()
        t[0] = time.perf_counter()
        client.submit_lookup(hashes).add_done_callback(answered)
        done.wait(10)
        return (t[1] - t[0]) * 1e3
    return call


def frames_call(sock: socket.socket, payload: bytes) -> Callable[[], None]:
    """One raw LookupRequest frame on a connection to the Lookup channel: no client code around it."""
    data = frame(payload)

    def call() -> None:
        sock.sendall(data)
        reply = kvcache_pb2.ChannelReply.FromString(read_frame(sock))
        assert not reply.code, reply.message
    return call


def interleaved(calls: list[tuple[str, str, Callable[[], object], bool]], iters: int, rounds: int
                ) -> list[tuple[str, str, list[float], bool]]:
    """Time every call `iters` times, one at a time, interleaved in `rounds` rounds so that a busy
    box's noise falls on all of them alike. A call that returns a float reports its own ms."""
    times: list[list[float]] = [[] for _ in calls]
    per_round = max(1, iters // rounds)
    for _ in range(rounds):
        for (_ch, _name, call, _against), out in zip(calls, times):
            for _ in range(WARMUP // rounds + 1):
                call()
            for _ in range(per_round):
                t0 = time.perf_counter()
                own = call()
                out.append(own if isinstance(own, float) else (time.perf_counter() - t0) * 1e3)
    return [(ch, name, out, against) for (ch, name, _call, against), out in zip(calls, times)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hashes", type=int, default=1024)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=10, help="the synchronous calls, interleaved in this many rounds")
    p.add_argument("--stored", type=int, default=1024, help="how many of the looked-up blocks are stored")
    p.add_argument("--namespace-blocks", type=int, default=0,
                   help="blocks stored in the namespace in all (the chain's `--stored` among them; 0: those alone)")
    p.add_argument("--scatter", action="store_true",
                   help="store the chain's blocks spread among the namespace's others (default: one run, first)")
    p.add_argument("--block-bytes", type=int, default=4096)
    p.add_argument("--channel-only", action="store_true", help="the Lookup channel's rows alone")
    p.add_argument("--role", default="bench")
    p.add_argument("--socket", default="")
    a = p.parse_args()
    if a.role == "echo":
        return echo_server(a.socket)
    ns = Namespace("bench-lookup", "float16", 16, "block-contiguous")
    block_bytes = a.block_bytes
    n = a.hashes
    total = max(a.namespace_blocks, a.stored)
    host_mib = max(64, -(-total * block_bytes * 11 // 10 >> 20) + 16)
    with Daemon(host_capacity=f"{host_mib}MiB", disk_capacity="", extra=["--lease-seconds", "600"]) as d, \
            ShmKVPool(max(a.stored, 1, min(total, STORE_BATCH)), block_bytes) as pool, \
            KVClient(d.target, ns, pool, client_name="lookup bench") as client, \
            KVClient(d.target, ns, pool, client_name="lookup bench grpc", lookup_channel=False) as grpc_client, \
            EchoServer() as echo, grpc.insecure_channel(echo.target) as echo_channel, \
            grpc.insecure_channel(d.target) as chan, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        hashes = BlockHasher(ns).hash_blocks(list(range(16 * n)))
        fill_namespace(client, hashes[: a.stored], total - a.stored, a.scatter)
        expected = client.lookup(hashes)
        assert expected[0] == min(a.stored, n)
        assert grpc_client.lookup(hashes) == expected == client.submit_lookup(hashes).result()
        assert client.lookup_route == "lookup channel" and grpc_client.lookup_route == "grpc", \
            (client.lookup_route, grpc_client.lookup_route)
        lk = kvcache_pb2.LookupRequest(session_id=client.session_id, hashes=b"".join(hashes))  # packed: n x 32 bytes
        empty = kvcache_pb2.LookupRequest(session_id=client.session_id)
        hb = kvcache_pb2.HeartbeatRequest(session_id=client.session_id)
        stub = kvcache_pb2_grpc.KVCacheStub(chan)
        echo_call = echo_channel.unary_unary("/bench.Echo/Echo", request_serializer=_ident,
                                             response_deserializer=_ident)
        raw.connect(lookup_socket_path(d.socket_path))
        ch, g = "Lookup channel", "gRPC"
        calls: list[tuple[str, str, Callable[[], object], bool]] = [
            (ch, "empty round trip: KVClient.lookup of 0 hashes", lambda: client.lookup([]), False),
            (ch, f"Lookup x{n}: KVClient.lookup", lambda: client.lookup(hashes), True),
            (ch, f"Lookup x{n}: KVClient.submit_lookup().result()", lambda: client.submit_lookup(hashes).result(), True),
            (ch, f"Lookup x{n}: KVClient.submit_lookup() to its done callback", to_callback(client, hashes), True),
            (ch, "empty round trip: raw frames, no client", frames_call(raw, empty.SerializeToString()), False),
            (ch, f"Lookup x{n}: raw frames, no client", frames_call(raw, lk.SerializeToString()), False),
            (g, "empty round trip: KVClient.lookup of 0 hashes", lambda: grpc_client.lookup([]), False),
            (g, f"Lookup x{n}: KVClient.lookup", lambda: grpc_client.lookup(hashes), True),
            (g, f"Lookup x{n}: KVClient.submit_lookup().result()", lambda: grpc_client.submit_lookup(hashes).result(),
             True),
            (g, f"Lookup x{n}: KVClient.submit_lookup() to its done callback", to_callback(grpc_client, hashes), True),
            (g, "empty round trip: Heartbeat, raw stub, sync channel", lambda: stub.Heartbeat(hb, timeout=10), False),
            (g, f"Lookup x{n}: raw stub, sync channel", lambda: stub.Lookup(lk, timeout=10), False),
            ("floor", "bare grpc.aio echo server, empty call, sync channel", lambda: echo_call(b"", timeout=10), False),
        ]
        if a.channel_only:
            calls = [c for c in calls if c[0] == ch]
        rows = interleaved(calls, a.iters, a.rounds)

        async def aio() -> tuple[list[float], list[float], list[float]]:
            async with AsyncKVClient(d.target, ns, pool, client_name="lookup bench async") as ac, \
                    AsyncKVClient(d.target, ns, pool, client_name="lookup bench async grpc",
                                  lookup_channel=False) as ag, \
                    grpc.aio.insecure_channel(echo.target) as ech:
                assert await ac.lookup(hashes) == await ag.lookup(hashes) == expected
                f = ech.unary_unary("/bench.Echo/Echo", request_serializer=_ident, response_deserializer=_ident)
                return (await timed_async(lambda: ac.lookup(hashes), a.iters),
                        await timed_async(lambda: ag.lookup(hashes), a.iters),
                        await timed_async(lambda: f(b"", timeout=10), a.iters))
        if not a.channel_only:
            async_channel, async_grpc, aio_floor = asyncio.run(aio())
            rows.append((ch, f"Lookup x{n}: AsyncKVClient.lookup in its loop (not interleaved)", async_channel, False))
            rows.append((g, f"Lookup x{n}: AsyncKVClient.lookup in its loop (not interleaved)", async_grpc, False))
            rows.append(("floor", "bare grpc.aio echo server, empty call, grpc.aio channel (not interleaved)",
                         aio_floor, False))
        assert client.lookup(hashes) == expected and client.lookup_route == "lookup channel"

    where = (f"; {total} blocks in the namespace, the chain's {'scattered among them' if a.scatter else 'stored first'}"
             if total > a.stored else "")
    print(f"Lookup of {n} hashes ({a.stored} stored{where}), {a.iters} calls of each, one at a time, interleaved in "
          f"{a.rounds} rounds, Unix sockets; target p50 <= {TARGET_P50_MS} ms, p99 <= {TARGET_P99_MS} ms "
          "(ratio = figure / target: <= 1 holds)\n")
    print("| channel | call | p50 ms | p99 ms | mean ms | p50 / target | p99 / target |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for channel, name, xs, against in rows:
        p50, p99 = pct(xs, 0.5), pct(xs, 0.99)
        ratios = f"{p50 / TARGET_P50_MS:.2f} | {p99 / TARGET_P99_MS:.2f}" if against else "- | -"
        print(f"| {channel} | {name} | {p50:.3f} | {p99:.3f} | {statistics.mean(xs):.3f} | {ratios} |")
    print()
    for channel, name, xs, against in rows:
        if against:
            p50, p99 = pct(xs, 0.5), pct(xs, 0.99)
            ok = p50 <= TARGET_P50_MS and p99 <= TARGET_P99_MS
            print(f"{channel}, {name}: p50 {p50:.3f} ms, p99 {p99:.3f} ms: {'HOLDS' if ok else 'MISSED'}")


if __name__ == "__main__":
    main()
