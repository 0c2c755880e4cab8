"""Where a Lookup of 1024 hashes spends its CPU, part by part, in one process (no sockets): the
parts bench/lookup_latency.py's end-to-end figure is made of, on a real BlockCache.

    .venv/bin/python bench/lookup_parts.py [--namespace-blocks 200000] [--scatter] [--iters 3000]

A BlockCache (no gRPC, no disk tier) stores the chain's 1024 blocks and others of the same
namespace up to `--namespace-blocks` (the chain first as one run, or with `--scatter` spread
among them: its entries far apart in memory, each probe missing the CPU caches), then each part
is called `--iters` times, interleaved in `--rounds` rounds (a busy box's noise falls on all):

  client  encode   KVClient's framed LookupRequest (kvwire.lookup_frames.request_frame; in a tree
                   before it, _pack, the message, serialize, frame)
  server  decode   LookupRequest.FromString and its hashes field
          split    BlockCache._hashes: the packed field into one bytes object per hash
          probe    BlockIndex.prefix_tiers on those hashes (fresh objects each call: hashing included)
          lookup   BlockCache.lookup of the packed field (session, split, probe)
          reply    the ChannelReply frame from the tiers (convert.lookup_channel_reply)
          answer   LookupChannel.answer(payload) serialized and framed: the daemon's whole part
  client  decode   ChannelReply.FromString and lookup_channel_answer: what KVClient.lookup returns

Prints a Markdown table of p50 / p99 in microseconds. For A/B, run it from each tree in turn.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine_client.client import _pack, lookup_channel_answer  # noqa: E402
from kvservice.api import convert  # noqa: E402
from kvservice.api.lookup_channel import LookupChannel  # noqa: E402
from kvservice.core.cache import BlockCache  # noqa: E402
from kvservice.core.clock import FakeClock  # noqa: E402
from kvservice.ops.config import Config  # noqa: E402
from kvwire.lookup_frames import frame  # noqa: E402
from kvwire.v1 import kvcache_pb2  # noqa: E402

try:
    from kvwire.lookup_frames import request_frame  # noqa: E402
except ImportError:  # a tree before it (A/B runs): KVClient built the message, serialized and framed it
    request_frame = None
from tests.corekit import CANARY, Pool, ns_spec  # noqa: E402

N = 1024
BATCH = 2048
BLOCK_BYTES = 256
WARMUP = 50


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def filled_cache(tmp: str, total: int, scatter: bool) -> tuple[BlockCache, str, list[bytes], Pool]:
    cfg = replace(Config(), socket_path=os.path.join(tmp, "kv.sock"),
                  host_capacity_bytes=(total + BATCH) * BLOCK_BYTES + (16 << 20), disk_path="",
                  disk_capacity_bytes=0, io_backend="posix", lease_seconds=1e9)
    cache = BlockCache(cfg, FakeClock())
    await cache.start()
    pool = Pool(num_blocks=BATCH, block_bytes=BLOCK_BYTES)
    sid = cache.open_session(ns_spec("lookup-parts"), pool.spec, CANARY, "bench").session_id
    rng = random.Random(10)
    chain = [rng.randbytes(32) for _ in range(N)]
    filler = [rng.randbytes(32) for _ in range(max(0, total - N))]
    if scatter and filler:
        batches = -(-(N + len(filler)) // BATCH)
        order: list[bytes] = []
        for b in range(batches):
            order += chain[b * N // batches:(b + 1) * N // batches]
            order += filler[b * len(filler) // batches:(b + 1) * len(filler) // batches]
    else:
        order = chain + filler
    for i in range(0, len(order), BATCH):
        part = order[i:i + BATCH]
        await cache.store(sid, b"".join(part), list(range(len(part))))
    return cache, sid, chain, pool


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--namespace-blocks", type=int, default=200_000)
    p.add_argument("--scatter", action="store_true")
    p.add_argument("--iters", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=10)
    a = p.parse_args()

    async def run() -> list[tuple[str, list[float]]]:
        with tempfile.TemporaryDirectory(prefix="kvparts") as tmp:
            cache, sid, chain, pool = await filled_cache(tmp, max(a.namespace_blocks, N), a.scatter)
            try:
                packed = b"".join(chain)
                tiers = cache.lookup(sid, packed)
                assert len(tiers) == N, len(tiers)
                ns = cache._session(sid, "").namespace
                index = cache._t.index
                payload = kvcache_pb2.LookupRequest(session_id=sid, hashes=packed).SerializeToString()
                reply = convert.lookup_channel_reply(tiers).SerializeToString()
                channel = LookupChannel(cache, os.path.join(tmp, "unused.lookup"), None, cache.config.max_batch_blocks)
                uid = os.getuid()
                def encode() -> bytes:
                    if request_frame is not None:
                        return request_frame(sid, chain)
                    return frame(kvcache_pb2.LookupRequest(session_id=sid, hashes=_pack(chain)).SerializeToString())
                parts: list[tuple[str, Callable[[], object]]] = [
                    ("client: encode (KVClient's framed LookupRequest)", encode),
                    ("server: decode (FromString, .hashes)", lambda: kvcache_pb2.LookupRequest.FromString(payload).hashes),
                    ("server: split (BlockCache._hashes)", lambda: cache._hashes(packed)),
                    ("server: probe (split + BlockIndex.prefix_tiers)",
                     lambda: index.prefix_tiers(ns, cache._hashes(packed))),
                    ("server: BlockCache.lookup", lambda: cache.lookup(sid, packed)),
                    ("server: reply (ChannelReply frame from the tiers)",
                     lambda: frame(convert.lookup_channel_reply(tiers).SerializeToString())),
                    ("server: all (LookupChannel.answer, serialized, framed)",
                     lambda: frame(channel.answer(uid, payload).SerializeToString())),
                    ("client: decode (FromString, lookup_channel_answer)",
                     lambda: lookup_channel_answer(kvcache_pb2.ChannelReply.FromString(reply), N)),
                ]
                assert channel.answer(uid, payload).prefix_blocks == N
                times: list[list[float]] = [[] for _ in parts]
                per_round = max(1, a.iters // a.rounds)
                clock = time.perf_counter
                for _ in range(a.rounds):
                    for (_name, call), out in zip(parts, times):
                        for _ in range(WARMUP):
                            call()
                        for _ in range(per_round):
                            t0 = clock()
                            call()
                            out.append((clock() - t0) * 1e6)
                return [(name, xs) for (name, _), xs in zip(parts, times)]
            finally:
                await cache.drain_and_stop()
                pool.close()

    rows = asyncio.run(run())
    total = max(a.namespace_blocks, N)
    print(f"Lookup of {N} hashes, all stored, {total} blocks in the namespace (the chain "
          f"{'scattered among them' if a.scatter else 'stored first, one run'}); {a.iters} calls of each part, "
          f"interleaved in {a.rounds} rounds; us\n")
    print("| part | p50 us | p99 us | mean us |")
    print("| --- | ---: | ---: | ---: |")
    for name, xs in rows:
        print(f"| {name} | {pct(xs, 0.5):.1f} | {pct(xs, 0.99):.1f} | {statistics.mean(xs):.1f} |")


if __name__ == "__main__":
    main()
