"""Counters that say what they count (issue 12): write-queue waiting vs in progress and its
high-water mark, the protect-unexpired refusal of a Store, and Admin.DescribeBlocks.

The queue and the refusal are driven on the core objects; the Stats fields and the block view
through a real daemon over its Unix socket (and grpcurl on its TCP listener).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time

import grpc
import pytest

from engine_client import KVClient, Namespace, ShmKVPool
from kvservice.core.types import StoreStatus
from kvwire.v1 import admin_pb2
from kvservice.disk.write_queue import WriteQueue
from tests.corekit import Engine, Pool, small_config, started_cache
from tests.daemon_kit import Daemon

BLOCK = 4096


async def test_write_queue_counts_waiting_and_in_progress_apart() -> None:
    """Scenario: depth 4, one writer, the disk stuck on the first write. Five jobs were submitted:
    one is in progress, four wait; `waiting` never exceeds the configured depth (the old
    `write_queue_depth` said 5), and the high-water mark remembers 4 after the queue drains."""
    release = asyncio.Event()
    done: list[int] = []

    async def handler(job: int) -> None:
        await release.wait()
        done.append(job)

    q: WriteQueue[int] = WriteQueue(depth=4, writers=1, policy="wait", handler=handler)
    q.start()
    try:
        for job in range(5):
            assert await q.submit(job, sheddable=False)
            await asyncio.sleep(0)  # let the writer take what it can
        assert (q.waiting, q.in_flight, q.depth) == (4, 1, 5)
        assert q.waiting <= q.capacity and q.high_water == 4
        release.set()
        await q.drain()
        assert (q.waiting, q.in_flight, q.high_water) == (0, 0, 4) and done == list(range(5))
    finally:
        await q.stop()


async def test_an_idle_writer_keeps_the_high_water_mark_at_zero() -> None:
    """Scenario: writes arrive one at a time and a writer is always free: nothing ever waited."""
    async def handler(job: int) -> None:
        await asyncio.sleep(0)

    q: WriteQueue[int] = WriteQueue(depth=4, writers=2, policy="wait", handler=handler)
    q.start()
    try:
        for job in range(6):
            await q.submit(job, sheddable=False)
            await q.drain()
        assert q.high_water == 0
    finally:
        await q.stop()


@pytest.fixture
def pool():
    p = Pool(num_blocks=16)
    yield p
    p.close()


async def test_protect_unexpired_store_refusal_says_why_and_is_counted(tmp_path, pool) -> None:
    """Scenario: protect-unexpired; the disk (8 blocks) and the host tier (4) are full of unexpired
    retained blocks, nothing is pinned. A new Store is refused admission: its message names the
    retained blocks and protect_unexpired (not "pinned by loads"), and admission_refusals counts
    each refused block, globally and for the namespace."""
    async with started_cache(small_config(tmp_path, protect_unexpired=True)) as cache:
        eng = Engine(cache, pool)
        for i in range(12):
            (r,) = await eng.store([i], 1000)
            assert r.status == StoreStatus.STORED
        before = cache.counters.admission_refusals
        results = await eng.store([12, 13])
        assert [r.status for r in results] == [StoreStatus.NOT_STORED] * 2
        for r in results:
            assert "unexpired retained" in r.message and "protect_unexpired" in r.message, r.message
            assert "pinned" not in r.message
        assert cache.counters.admission_refusals == before + 2
        (ns,) = cache.namespace_stats()
        assert ns["counters"].admission_refusals == cache.counters.admission_refusals


# --- over the wire


def _ns() -> Namespace:
    return Namespace("operator-stats", "float16", 16, "layer-first")


def test_stats_write_queue_fields_over_the_wire() -> None:
    """Scenario: a real daemon with a 4-deep write queue, one writer and a disk capped at 64 KiB/s;
    an engine stores 40 blocks into an 8-block host tier, so 32 spills pile up behind the writer.
    Stats shows at most 4 waiting and at most one writer's batch in progress (the spill it took and
    the at most 4 queued behind it), the high-water mark reaches the capacity, and once the spills
    are written both are 0 while the mark stays."""
    pool = ShmKVPool(40, BLOCK, layout="layer-first", num_layers=1)
    extra = ["--write-queue-depth", "4", "--writer-threads", "1", "--disk-write-bytes-per-second", "64KiB"]
    try:
        with Daemon(host_capacity="32KiB", disk_capacity="1MiB", extra=extra) as d, \
                KVClient(d.target, _ns(), pool, client_name="stats") as kv:
            hashes = kv.hasher.hash_blocks(list(range(40 * 16)))
            stores = kv.submit_store(hashes, list(range(40)))  # waits on the full queue: poll meanwhile
            seen = []
            while not stores.done():
                s = d.stats()
                seen.append((s.write_queue_depth, s.writes_in_progress, s.write_queue_high_water))
                time.sleep(0.02)
            assert all(w <= 4 and p <= 5 for w, p, _ in seen), seen
            deadline = time.monotonic() + 30  # the spill count lands when a batch settles, its writer slot
            # ends when the writer task resumes: poll for both, not one then the other
            while ((s := d.stats()).counters.spills < 32 or s.write_queue_depth or s.writes_in_progress) \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
            assert s.counters.spills == 32
            assert (s.write_queue_depth, s.writes_in_progress) == (0, 0)
            assert s.write_queue_capacity == 4 and s.write_queue_high_water == 4
    finally:
        pool.close()
        pool.unlink()


GRPCURL = shutil.which("grpcurl", path=os.path.dirname(sys.executable))


def test_describe_blocks_shows_tier_deadline_and_pin() -> None:
    """Scenario: an engine stores 12 blocks, 4 with a TTL, into an 8-block host tier (the oldest 4
    spill to disk). Admin.DescribeBlocks, with hashes as hex strings, answers per hash in the order
    asked: tier(s), disk state, retained_until as a Timestamp, pinned, size; an unknown hash is
    stored=false; a bad hex string is INVALID_ARGUMENT naming its index. grpcurl reads the same."""
    pool = ShmKVPool(12, BLOCK, layout="layer-first", num_layers=1)
    try:
        with Daemon(host_capacity="32KiB", disk_capacity="1MiB", tcp=True) as d, \
                KVClient(d.target, _ns(), pool, client_name="describe") as kv:
            hashes = kv.hasher.hash_blocks(list(range(12 * 16)))
            t0 = time.time()
            assert all(r.status == 1 for r in kv.store(hashes[:4], list(range(4)), ttl_seconds=600))
            assert all(r.status == 1 for r in kv.store(hashes[4:], list(range(4, 12))))
            deadline = time.monotonic() + 20
            while d.stats().counters.spills < 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            unknown = bytes(range(32))
            asked = [hashes[0].hex(), hashes[11].hex(), unknown.hex()]
            reply = d.admin("DescribeBlocks", namespace_id=kv.namespace_id, hashes=asked)
            first, last, missing = reply.blocks
            assert [b.hash for b in reply.blocks] == asked
            assert first.stored and list(first.tiers) == ["disk"] and first.disk == "on_disk"
            assert first.retained and abs(first.retained_until.ToSeconds() - (t0 + 600)) < 30
            assert not first.pinned and first.bytes == BLOCK
            assert last.stored and list(last.tiers) == ["host"] and last.disk == "none"
            assert not last.retained and not last.HasField("retained_until")
            assert abs(last.stored_at.ToSeconds() - time.time()) < 60
            assert not missing.stored and not missing.tiers

            with pytest.raises(grpc.RpcError) as err:
                d.admin("DescribeBlocks", namespace_id=kv.namespace_id, hashes=[hashes[0].hex(), "xyz"])
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "hashes[1]" in err.value.details()
            with pytest.raises(grpc.RpcError) as err:
                d.admin("DescribeBlocks", namespace_id="no-such-namespace", hashes=[hashes[0].hex()])
            assert err.value.code() == grpc.StatusCode.NOT_FOUND

            if GRPCURL is not None:
                data = json.dumps({"namespace_id": kv.namespace_id, "hashes": [hashes[0].hex()]})
                out = subprocess.run([GRPCURL, "-plaintext", "-d", data, d.tcp_address,
                                      "kvservice.v1.Admin/DescribeBlocks"],
                                     capture_output=True, text=True, timeout=30, check=True).stdout
                (block,) = json.loads(out)["blocks"]
                assert block["tiers"] == ["disk"] and block["retained"] is True
                assert block["retained_until"].endswith("Z")  # RFC 3339, as protobuf JSON writes a Timestamp
    finally:
        pool.close()
        pool.unlink()


def test_list_sessions_opened_at_is_a_timestamp() -> None:
    """Scenario: grpcurl's JSON shows when a session opened as an RFC 3339 time, not a float."""
    pool = ShmKVPool(2, BLOCK, layout="layer-first", num_layers=1)
    try:
        with Daemon(disk_capacity="") as d, KVClient(d.target, _ns(), pool, client_name="ts"):
            (s,) = d.admin("ListSessions").sessions
            assert isinstance(s.opened_at, type(admin_pb2.BlockInfo().stored_at))
            assert abs(s.opened_at.ToSeconds() - time.time()) < 60
    finally:
        pool.close()
        pool.unlink()
