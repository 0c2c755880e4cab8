"""The candidates for a Lookup channel without gRPC, measured before one was chosen (issue 10).

    .venv/bin/python bench/lookup_candidates.py [--iters 3000]

A server subprocess holds a real BlockCache (no gRPC) with 1024 blocks stored, and serves
BlockCache.lookup over a Unix socket in length-prefixed frames (kvwire.lookup_frames), two ways:
  loop     an asyncio.Protocol on the event loop that owns the cache (no task per call): what the
           daemon does now (kvservice/api/lookup_channel.py)
  loop-buffered  the same as an asyncio.BufferedProtocol reading into one preallocated buffer
  thread   a dedicated thread doing blocking recv and calling lookup itself, while the loop thread
           runs the cache (measured only: it reads the index while the loop mutates it, see below)
and the client, in this process, times an empty round trip (0 hashes) and a Lookup of 1024 hashes,
all servers running at once and the calls interleaved in rounds (a busy box's noise falls on all).
Beside them: BlockCache.lookup called in-process (the work itself), and the lower bound of a
shared-memory read path (the engine probing an open-addressing table of 32-byte keys with numpy,
without the locking and the collision handling a real one needs).
Prints a Markdown table (ms).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from kvservice.core.cache import BlockCache
from kvservice.core.clock import FakeClock
from kvservice.ops.config import Config
from kvwire.lookup_frames import HEADER, frame, read_frame
from tests.corekit import CANARY, Pool, h, ns_spec

N = 1024
WARMUP = 20


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def timed(call, iters: int) -> list[float]:
    for _ in range(WARMUP):
        call()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        call()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


async def cache_with_blocks(tmp: str) -> tuple[BlockCache, str]:
    cfg = replace(Config(), socket_path=os.path.join(tmp, "kv.sock"), host_capacity_bytes=64 << 20, disk_path="",
                  disk_capacity_bytes=0, io_backend="posix", lease_seconds=1e9)
    cache = BlockCache(cfg, FakeClock())
    await cache.start()
    pool = Pool(num_blocks=N, block_bytes=4096)
    sid = cache.open_session(ns_spec("candidates"), pool.spec, CANARY, "bench").session_id
    await cache.store(sid, b"".join(h(i) for i in range(N)), list(range(N)))
    return cache, sid


def answer(cache: BlockCache, sid: str, payload: bytes) -> bytes:
    return bytes(cache.lookup(sid, payload)) if payload else b""  # the tiers, one byte each


class _Served(asyncio.Protocol):
    def __init__(self, cache: BlockCache, sid: str) -> None:
        self.cache, self.sid, self.buf = cache, sid, bytearray()

    def connection_made(self, transport) -> None:
        self.t = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while len(self.buf) >= HEADER.size:
            (n,) = HEADER.unpack_from(self.buf)
            if len(self.buf) < HEADER.size + n:
                return
            payload = bytes(self.buf[HEADER.size:HEADER.size + n])
            del self.buf[:HEADER.size + n]
            self.t.write(frame(answer(self.cache, self.sid, payload)))


class _ServedBuffered(asyncio.BufferedProtocol):
    """The same, reading into one preallocated buffer (no bytes object per read)."""

    def __init__(self, cache: BlockCache, sid: str) -> None:
        self.cache, self.sid = cache, sid
        self.buf = bytearray(1 << 20)
        self.view = memoryview(self.buf)
        self.end = 0

    def connection_made(self, transport) -> None:
        self.t = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view[self.end:]

    def buffer_updated(self, nbytes: int) -> None:
        self.end += nbytes
        pos = 0
        while self.end - pos >= HEADER.size:
            (n,) = HEADER.unpack_from(self.buf, pos)
            if self.end - pos - HEADER.size < n:
                break
            payload = bytes(self.view[pos + HEADER.size:pos + HEADER.size + n])
            pos += HEADER.size + n
            self.t.write(frame(answer(self.cache, self.sid, payload)))
        if pos:
            rest = self.end - pos
            self.buf[:rest] = self.view[pos:self.end]
            self.end = rest


def serve(kind: str, path: str) -> None:
    async def main() -> None:
        with tempfile.TemporaryDirectory(prefix="kvcand") as tmp:
            cache, sid = await cache_with_blocks(tmp)
            if kind == "loop":
                await asyncio.get_running_loop().create_unix_server(lambda: _Served(cache, sid), path)
            elif kind == "loop-buffered":
                await asyncio.get_running_loop().create_unix_server(lambda: _ServedBuffered(cache, sid), path)
            else:
                srv = socket.socket(socket.AF_UNIX)
                srv.bind(path)
                srv.listen()

                def one(c: socket.socket) -> None:
                    while True:
                        head = c.recv(HEADER.size, socket.MSG_WAITALL)
                        if len(head) < HEADER.size:
                            return
                        (n,) = HEADER.unpack(head)
                        payload = c.recv(n, socket.MSG_WAITALL) if n else b""
                        c.sendall(frame(answer(cache, sid, payload)))

                def accept() -> None:
                    while True:
                        threading.Thread(target=one, args=(srv.accept()[0],), daemon=True).start()
                threading.Thread(target=accept, daemon=True).start()
            print("ready", flush=True)
            while True:  # the loop wakes now and then, as the daemon's does
                await asyncio.sleep(0.01)
    asyncio.run(main())


def measure(kinds: list[str], iters: int, rounds: int) -> list[tuple[str, list[float]]]:
    """All servers at once; the calls interleaved by rounds, so the box's noise falls on all alike."""
    packed = b"".join(h(i) for i in range(N))
    with tempfile.TemporaryDirectory(prefix="kvcand") as d:
        procs, socks = [], []
        try:
            for kind in kinds:
                path = f"{d}/{kind}.sock"
                proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, path], stdout=subprocess.PIPE,
                                        text=True)
                procs.append(proc)
                assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
                s = socket.socket(socket.AF_UNIX)
                s.connect(path)
                socks.append(s)

            def call(s: socket.socket, data: bytes, want: int):
                def go() -> None:
                    s.sendall(data)
                    assert len(read_frame(s)) == want
                return go
            calls = []
            for kind, s in zip(kinds, socks):
                calls.append((f"{kind}: empty round trip", call(s, frame(b""), 0)))
                calls.append((f"{kind}: Lookup x{N}", call(s, frame(packed), N)))
            times: dict[str, list[float]] = {name: [] for name, _ in calls}
            for _ in range(rounds):
                for name, go in calls:
                    times[name] += timed(go, max(1, iters // rounds))
            return list(times.items())
        finally:
            for s in socks:
                s.close()
            for proc in procs:
                proc.terminate()
                proc.wait()


def shm_lower_bound(iters: int) -> list[float]:
    cap = 8 * N
    keys = np.zeros((cap, 32), np.uint8)
    tier = np.zeros(cap, np.uint8)
    packed = b"".join(h(i) for i in range(N))
    arr = np.frombuffer(packed, np.uint8).reshape(N, 32)
    slot = arr[:, :8].copy().view(np.uint64).ravel() % cap
    keys[slot] = arr
    tier[slot] = 2

    def look() -> tuple[int, list[int]]:
        a = np.frombuffer(packed, np.uint8).reshape(-1, 32)
        sl = a[:, :8].copy().view(np.uint64).ravel() % cap
        ok = (keys[sl] == a).all(axis=1) & (tier[sl] > 0)
        miss = np.flatnonzero(~ok)
        k = int(miss[0]) if miss.size else len(ok)
        return k, tier[sl[:k]].tolist()
    return timed(look, iters)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=10, help="the calls of each candidate, interleaved in this many rounds")
    p.add_argument("--serve", nargs=2, metavar=("KIND", "PATH"))
    a = p.parse_args()
    if a.serve:
        return serve(*a.serve)

    async def inproc() -> list[float]:
        with tempfile.TemporaryDirectory(prefix="kvcand") as tmp:
            cache, sid = await cache_with_blocks(tmp)
            packed = b"".join(h(i) for i in range(N))
            return timed(lambda: cache.lookup(sid, packed), a.iters)
    rows = [(f"BlockCache.lookup x{N} in-process (the work itself)", asyncio.run(inproc()))]
    rows += measure(["loop", "loop-buffered", "thread"], a.iters, a.rounds)
    rows.append((f"shared memory: numpy probe of x{N} (lower bound, no locking)", shm_lower_bound(a.iters)))
    print(f"{a.iters} calls one at a time; ms\n")
    print("| candidate | p50 | p99 | mean |")
    print("| --- | ---: | ---: | ---: |")
    for name, xs in rows:
        print(f"| {name} | {pct(xs, 0.5):.3f} | {pct(xs, 0.99):.3f} | {statistics.mean(xs):.3f} |")


if __name__ == "__main__":
    main()
