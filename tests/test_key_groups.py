"""Keys of k engine blocks (PoolDescription.blocks_per_key, kvservice/memory/key_groups.py): an engine
whose blocks are small has the daemon keep k of them as one block. The daemon's blocks are k x the
pool's block bytes, a key's k engine blocks back to back in its slot, checked by the CRC32C of those
bytes; Store and Load name k block ids per hash. Core-level (BlockCache on a shared-memory pool, real
segment files for the disk tier) and through a real daemon with the engine's KVClient, on both of
its data paths (frames channel and gRPC)."""

from __future__ import annotations

import asyncio
import os
import random

import grpc
import pytest

from engine_client import AsyncKVClient, KVClient, KVClientError, Namespace, ShmKVPool
from harness.daemon import Daemon
from kvservice.checksum import checksum, concat_checksums
from kvservice.core.namespaces import namespace_id
from kvservice.core.types import CacheError, ErrorCode, LoadStatus, StoreStatus, Tier
from kvservice.disk.tier_io import disk_capacity_for
from kvservice.placement.index import DiskState
from tests.corekit import CANARY, Pool, content, h, ns_spec, small_config, started_cache
from tests.test_store_cancellation import cancel_after_steps, until

K = 4  # engine blocks per key
PART = 4096  # engine block bytes
KEY = K * PART


@pytest.mark.parametrize("part,k", [(4096, 4), (65536, 3), (7, 16), (1, 2), (PART, 1)])
def test_a_keys_checksum_is_folded_from_its_blocks_checksums(part, k):
    """concat_checksums gives the CRC32C of each run of k parts from the parts' own CRC32Cs, as the
    checksum of the joined bytes would be (what the disk tier and the integrity checks verify)."""
    rng = random.Random(part * 31 + k)
    parts = [rng.randbytes(part) for _ in range(5 * k)]
    want = [checksum(b"".join(parts[i * k:(i + 1) * k])) for i in range(5)]
    assert concat_checksums([checksum(p) for p in parts], k, part) == want


def test_a_pool_of_keys_is_a_namespace_of_its_own():
    """Scenario: the same model and regions registered with 1 and with 4 blocks a key: the blocks
    mean other bytes, so the namespaces differ; blocks_per_key = 1 keeps the id of before."""
    a = Pool(num_blocks=8, block_bytes=PART)
    b = Pool(num_blocks=8, block_bytes=PART, blocks_per_key=K)
    try:
        sa, sb = a.spec, b.spec
        os.close(sa.shm_fd)
        os.close(sb.shm_fd)
        assert sb.key_bytes == KEY and sa.key_bytes == PART
        assert namespace_id(ns_spec(), sa) != namespace_id(ns_spec(), sb)
    finally:
        a.close()
        b.close()


def _engine_ids(n: int, seed: int, pool_blocks: int) -> list[int]:
    """k x n distinct engine block ids in a random order (a paged pool's free list)."""
    ids = list(range(pool_blocks))
    random.Random(seed).shuffle(ids)
    return ids[:n * K]


def _write_keys(pool: Pool, numbers: list[int], ids: list[int]) -> None:
    for j, i in enumerate(numbers):
        data = content(i, KEY)
        for p in range(K):
            pool.write(ids[j * K + p], data[p * PART:(p + 1) * PART])


def _read_keys(pool: Pool, n: int, ids: list[int]) -> list[bytes]:
    return [b"".join(pool.read(ids[j * K + p]) for p in range(K)) for j in range(n)]


async def _settled(cache) -> None:
    while cache._background:
        await asyncio.gather(*list(cache._background), return_exceptions=True)
    await cache.tiers.drain()


async def test_keys_store_and_load_byte_exact_from_host_and_disk(tmp_path):
    """Scenario: an engine with 4 blocks a key stores 12 keys from scattered pool blocks into a host
    tier of 4 keys and a disk tier of 16: the daemon's blocks are 16 KiB, each slot holds its key's 4
    blocks in order and is checked by their CRC32C; the 8 keys that spilled load from disk into other
    scattered blocks, the rest from host, all byte-exact; a Store naming one id per hash, or an id
    twice across keys, is refused as a whole with a message that says why; nothing is half-made."""
    cfg = small_config(tmp_path, disk_blocks=0, host_capacity_bytes=4 * KEY,
                       disk_capacity_bytes=disk_capacity_for(16, KEY))
    async with started_cache(cfg) as cache:
        pool = Pool(num_blocks=64, block_bytes=PART, blocks_per_key=K)
        try:
            opened = cache.open_session(ns_spec(), pool.spec, CANARY, "keys")
            sid = opened.session_id
            assert opened.block_bytes == KEY
            ids = _engine_ids(12, 1, 64)
            _write_keys(pool, list(range(12)), ids)
            for lo in (0, 4, 8):  # three Stores of 4 keys: the first 8 keys spill
                res = await cache.store(sid, [h(i) for i in range(lo, lo + 4)], ids[lo * K:(lo + 4) * K])
                assert [r.status for r in res] == [StoreStatus.STORED] * 4, [r.message for r in res]
            await _settled(cache)
            blocks = {e.hash: e for e in cache.tiers.index.values()}
            arena = cache.tiers.host.arena.base.numpy()
            for i in range(12):
                e = blocks[h(i)]
                assert e.size == KEY and e.checksum == checksum(content(i, KEY))
                if e.slot >= 0:
                    assert bytes(arena[e.slot:e.slot + KEY]) == content(i, KEY)
            assert sum(blocks[h(i)].disk == DiskState.ON_DISK for i in range(12)) >= 8
            for i in range(12):
                for p in range(K):
                    pool.write(ids[i * K + p], bytes(PART))
            out = _engine_ids(12, 2, 64)
            res = await cache.load(sid, [h(i) for i in range(12)], out)
            assert [r.status for r in res] == [LoadStatus.LOADED] * 12, [r.message for r in res]
            assert Tier.DISK in {r.tier for r in res} and Tier.HOST in {r.tier for r in res}
            assert _read_keys(pool, 12, out) == [content(i, KEY) for i in range(12)]
            with pytest.raises(CacheError) as bad:
                await cache.store(sid, [h(100), h(101)], [0, 1])
            assert bad.value.code == ErrorCode.INVALID_ARGUMENT and "4 engine blocks per hash" in str(bad.value)
            with pytest.raises(CacheError) as twice:
                await cache.store(sid, [h(100), h(101)], [0, 1, 2, 3, 4, 5, 6, 3])
            assert twice.value.code == ErrorCode.INVALID_ARGUMENT and "twice" in str(twice.value)
            assert cache.lookup(sid, [h(100)]) == []
            await _settled(cache)
            assert cache.audit() == []
        finally:
            pool.close()


NS = Namespace("key-groups", "float32", 64, "block-contiguous")  # tokens_per_block: a key's 4 x 16 tokens


@pytest.fixture
def daemon():
    with Daemon(host_capacity="1MiB", disk_capacity="4MiB", lease_seconds=5) as d:
        yield d


@pytest.mark.parametrize("channel", [True, False], ids=["frames-channel", "grpc"])
def test_an_engine_with_keys_stores_and_loads_through_the_daemon(daemon, channel):
    """Scenario: an engine's KVClient registers its pool with blocks_per_key = 4 and hashes its
    prompt in keys of 4 blocks: Store of 8 keys (32 scattered pool blocks) answers STORED per key,
    Lookup finds the 8, Load into 32 other blocks is byte-exact; a second client of the same pool
    layout with 1 block a key sees none of them (another namespace); a Store with one id per hash
    is refused by the client before it is sent. ListSessions shows the session's blocks_per_key."""
    with ShmKVPool(96, PART) as pool:
        ids = _engine_ids(8, 3, 96)
        data = [content(i, KEY) for i in range(8)]
        for j in range(8):
            for p in range(K):
                pool.write_block(ids[j * K + p], data[j][p * PART:(p + 1) * PART])
        with KVClient(daemon.target, NS, pool, client_name="keys", lookup_channel=channel,
                      blocks_per_key=K) as kv:
            hashes = kv._client.hasher.hash_blocks(range(8 * 64))
            assert len(hashes) == 8
            res = kv.store(hashes, ids)
            assert [r.status for r in res] == [StoreStatus.STORED] * 8, [r.message for r in res]
            assert kv.lookup(hashes) == (8, [Tier.HOST] * 8)
            assert [x.blocks_per_key for x in daemon.admin("ListSessions").sessions] == [K]  # what operators see
            out = _engine_ids(8, 4, 96)
            res = kv.load(hashes, out)
            assert [r.status for r in res] == [LoadStatus.LOADED] * 8, [r.message for r in res]
            assert [b"".join(pool.read_block(out[j * K + p]) for p in range(K)) for j in range(8)] == data
            with pytest.raises(KVClientError) as bad:
                kv.store(hashes, ids[:8])
            assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with KVClient(daemon.target, NS, pool, client_name="blocks", lookup_channel=channel) as single:
            assert single.lookup(hashes) == (0, [])


def test_the_daemon_refuses_a_pool_with_too_many_blocks_a_key(daemon):
    """Scenario: a pool registered with blocks_per_key above the limit (16): the client refuses it
    before it registers; a hand-made registration is refused by the daemon with INVALID_ARGUMENT."""
    with ShmKVPool(64, PART) as pool:
        with pytest.raises(ValueError, match="blocks_per_key"):
            AsyncKVClient(daemon.target, NS, pool, blocks_per_key=17)
        client = AsyncKVClient(daemon.target, NS, pool, blocks_per_key=2)
        client.blocks_per_key = 17  # past the client's own check: what the daemon says

        async def attempt():
            try:
                await client.connect()
            finally:
                await client.close()
        with pytest.raises(KVClientError) as refused:
            asyncio.run(attempt())
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and "blocks_per_key" in str(refused.value)


async def test_a_keys_store_cancelled_after_any_number_of_loop_steps_leaves_nothing_half_made(tmp_path):
    """Scenario: a Store of 4 keys (16 scattered engine blocks) into a full host tier of 4 keys (so
    it evicts, spills through one writer and copies k blocks a key) is cancelled after s event-loop
    steps, for every s up to 48 (each await point of the store path) and then doubling, until one
    finishes uncancelled (the copies and spills run in threads). After each: audit is clean once the copies
    and spills are done (no room, pin or entry of the cancelled Store), and the keys store again and
    load byte-exact into other scattered blocks (or are stored already, when the cancel came after
    the commit)."""
    cfg = small_config(tmp_path, disk_blocks=0, host_capacity_bytes=4 * KEY,
                       disk_capacity_bytes=disk_capacity_for(64, KEY), write_queue_depth=1, writer_threads=1)
    async with started_cache(cfg) as cache:
        pool = Pool(num_blocks=64, block_bytes=PART, blocks_per_key=K)
        try:
            sid = cache.open_session(ns_spec(), pool.spec, CANARY, "keys").session_id
            base = 0

            async def store(numbers, seed):
                ids = _engine_ids(len(numbers), seed, 32)  # the store side: blocks 0-31 of the pool
                _write_keys(pool, numbers, ids)
                return await cache.store(sid, [h(i) for i in numbers], ids)

            for s in [*range(48), *(48 << i for i in range(10))]:
                await store([1000 + base + j for j in range(4)], 2 * s)  # host full of other keys
                batch = [base + j for j in range(4)]
                finished = await cancel_after_steps(store(batch, 2 * s + 1), s)
                await asyncio.get_running_loop().run_in_executor(cache._copy_pool, lambda: None)
                await _settled(cache)
                assert cache.audit() == [], f"after a cancel at step {s}"
                res = await store(batch, 2 * s + 1)
                assert all(r.status in (StoreStatus.STORED, StoreStatus.ALREADY_STORED) for r in res), \
                    [r.message for r in res]
                out = [32 + i for i in _engine_ids(4, s, 32)]  # the load side: blocks 32-63
                res = await cache.load(sid, [h(i) for i in batch], out)
                assert [r.status for r in res] == [LoadStatus.LOADED] * 4, [r.message for r in res]
                assert _read_keys(pool, 4, out) == [content(i, KEY) for i in batch]
                await _settled(cache)
                assert cache.audit() == []
                base += 4
                if finished:
                    break
            else:
                raise AssertionError("the keys Store never finished within 12288 loop steps")
        finally:
            pool.close()


async def test_a_keys_load_cancelled_after_any_number_of_loop_steps_leaves_nothing_pinned(tmp_path):
    """Scenario: 12 keys stored into a host tier of 4 (8 spilled to disk); a Load of all 12 (disk reads
    into pinned rows of keys, scattered as 4 blocks each; host hits scattered from their slots) is
    cancelled after s event-loop steps, for every s up to 48 and then doubling, until one finishes
    uncancelled. After each: once the reads and copies in flight end, audit is clean (no pin, no
    lease, no half-made entry), and the next Load of the 12 is byte-exact."""
    cfg = small_config(tmp_path, disk_blocks=0, host_capacity_bytes=4 * KEY,
                       disk_capacity_bytes=disk_capacity_for(16, KEY))
    async with started_cache(cfg) as cache:
        pool = Pool(num_blocks=96, block_bytes=PART, blocks_per_key=K)
        try:
            sid = cache.open_session(ns_spec(), pool.spec, CANARY, "keys").session_id
            ids = _engine_ids(12, 5, 48)
            _write_keys(pool, list(range(12)), ids)
            for lo in (0, 4, 8):
                res = await cache.store(sid, [h(i) for i in range(lo, lo + 4)], ids[lo * K:(lo + 4) * K])
                assert [r.status for r in res] == [StoreStatus.STORED] * 4, [r.message for r in res]
            await _settled(cache)
            hashes = [h(i) for i in range(12)]
            want = [content(i, KEY) for i in range(12)]
            for s in [*range(48), *(48 << i for i in range(10))]:
                out = [48 + i for i in _engine_ids(12, s, 48)]
                finished = await cancel_after_steps(cache.load(sid, hashes, out), s)
                await _settled(cache)  # then the reads and copies in flight end (in their threads)
                await until(lambda: cache.audit() == [], f"a clean audit after a cancel at step {s}: {cache.audit()}")
                for i in out:
                    pool.write(i, bytes(PART))
                res = await cache.load(sid, hashes, out)
                assert [r.status for r in res] == [LoadStatus.LOADED] * 12, [r.message for r in res]
                assert _read_keys(pool, 12, out) == want
                if finished:
                    break
            else:
                raise AssertionError("the keys Load never finished within 12288 loop steps")
        finally:
            pool.close()
