"""A Store into a full host tier without a disk tier takes slots past the capacity (the tier's headroom,
kvservice.core.tiers.store_headroom_bytes) and evicts once its copy is queued (HostRoom.trim_host), so
the evictions run beside the copy. What an engine or an operator sees after the call is the same as
evicting first: the same victims, the tier within its capacity, the same refusals when pins hold the
room; a Store cancelled at any loop step leaves nothing of it behind."""

from __future__ import annotations

import asyncio

import pytest

from kvservice.core import tiers
from kvservice.core.types import LoadStatus, StoreStatus
from tests.corekit import BLOCK, Engine, Pool, h, small_config, started_cache
from tests.test_store_cancellation import cancel_after_steps

HOST_BLOCKS = 8


def _config(tmp_path):
    return small_config(tmp_path, disk_blocks=0, host_capacity_bytes=HOST_BLOCKS * BLOCK)


def _resident(cache) -> list[bytes]:
    return sorted(e.hash for e in cache.tiers.host.entries_oldest_first())


async def _fill_and_store(cache, pool, pin: int = 0) -> tuple[list, list[bytes], dict]:
    """8 blocks stored, 0-3 loaded again (the LRU's newest now), `pin` of the oldest pinned; then a
    Store of 3 new blocks. Returns its results, the resident hashes after it and the host tier row."""
    eng = Engine(cache, pool)
    assert all(r.status == StoreStatus.STORED for r in await eng.store(list(range(HOST_BLOCKS))))
    assert all(r.status == LoadStatus.LOADED for r in await eng.load([0, 1, 2, 3]))
    held = list(cache.tiers.host.entries_oldest_first())[:pin]
    for e in held:
        e.pins += 1
        cache.tiers.host.counts.pinned(e)
    res = await eng.store([100, 101, 102])
    for e in held:
        e.pins -= 1
        cache.tiers.host.counts.unpinned(e)
    host = cache.tiers.host
    return res, _resident(cache), {"used": host.used_bytes, "capacity": host.capacity_bytes}


@pytest.mark.parametrize("pin", [0, 3, 7])
async def test_a_store_past_the_capacity_evicts_what_evicting_first_evicts(tmp_path, monkeypatch, pin):
    """Scenario: a host-only tier of 8 blocks, full, blocks 0-3 refreshed by a Load; a Store of 3 new
    blocks, with 0, 3 or 7 of the oldest blocks pinned. With the headroom the Store answers what it
    answers when it evicts first (all stored; with 7 pinned, 1 stored and 2 refused with the same
    message), the same blocks are resident afterwards, and the tier is within its capacity."""
    outcomes = []
    for headroom in (tiers.STORE_HEADROOM_BYTES, 0):
        monkeypatch.setattr(tiers, "STORE_HEADROOM_BYTES", headroom)
        async with started_cache(_config(tmp_path / f"h{headroom}")) as cache:
            pool = Pool(num_blocks=32)
            try:
                assert cache.tiers.host.headroom_bytes == (HOST_BLOCKS // 2 * BLOCK if headroom else 0)
                res, resident, host = await _fill_and_store(cache, pool, pin)
                assert host["used"] <= host["capacity"]
                assert cache.audit() == []
                outcomes.append(([(r.status, r.message) for r in res], resident))
            finally:
                pool.close()
    with_headroom, evicting_first = outcomes
    assert with_headroom == evicting_first
    statuses = [s for s, _ in with_headroom[0]]
    if pin == 7:  # one unpinned block to evict: room for one of the three
        assert statuses == [StoreStatus.STORED] + [StoreStatus.NOT_STORED] * 2
    else:
        assert statuses == [StoreStatus.STORED] * 3


async def test_the_headroom_is_used_during_the_copy_and_given_back_before_the_answer(tmp_path):
    """Scenario: while the Store's copy runs (the gather thread holds it), the tier holds the 3 new
    blocks past its capacity and its 8 old ones; once the Store answers, the 3 oldest (the stored
    chain's tail) are gone and
    the tier is back within its capacity; the new blocks load byte-exact."""
    async with started_cache(_config(tmp_path)) as cache:
        pool = Pool(num_blocks=32)
        try:
            eng = Engine(cache, pool)
            await eng.store(list(range(HOST_BLOCKS)))
            host = cache.tiers.host
            mem = cache._sessions.get(eng.sid).memory
            seen: list[tuple[int, int]] = []
            real = mem.gather_into

            def gather_into(block_ids, arena, offsets, enqueued=None):
                seen.append((host.used_bytes, len(host)))  # in the copy thread, before it is queued
                return real(block_ids, arena, offsets, enqueued)
            mem.gather_into = gather_into
            res = await eng.store([100, 101, 102])
            assert [r.status for r in res] == [StoreStatus.STORED] * 3
            assert seen == [((HOST_BLOCKS + 3) * BLOCK, HOST_BLOCKS)]
            assert host.used_bytes == HOST_BLOCKS * BLOCK and len(host) == HOST_BLOCKS
            # a chain's tail is its oldest block: 5-7 went
            assert set(_resident(cache)) == {h(i) for i in [*range(HOST_BLOCKS - 3), 100, 101, 102]}
            assert [r.status for r in await eng.load([100, 101, 102])] == [LoadStatus.LOADED] * 3
            assert cache.audit() == []
        finally:
            pool.close()


async def test_a_store_into_the_headroom_cancelled_at_any_loop_step_leaves_nothing_behind(tmp_path):
    """Scenario: a full host-only tier; a Store of 3 new blocks is cancelled after s event-loop steps,
    for every s until one finishes uncancelled. After each, once its copy is over: the audit is clean
    (no entry, pin or slot of the cancelled Store), the tier is within its capacity, and the blocks
    store again and load byte-exact."""
    async with started_cache(_config(tmp_path)) as cache:
        pool = Pool(num_blocks=32)
        try:
            eng = Engine(cache, pool)
            await eng.store(list(range(HOST_BLOCKS)))
            base = 1000
            for s in range(200):
                batch = [base, base + 1, base + 2]
                finished = await cancel_after_steps(eng.store(batch), s)
                await asyncio.get_running_loop().run_in_executor(cache._copy_pool, lambda: None)
                for _ in range(50):  # a rolled-back reservation's slots go once its copy thread is done
                    if cache.audit() == []:
                        break
                    await asyncio.sleep(0.01)
                assert cache.audit() == [], f"after a cancel at step {s}"
                host = cache.tiers.host
                assert host.used_bytes <= host.capacity_bytes
                res = await eng.store(batch)
                assert all(r.status in (StoreStatus.STORED, StoreStatus.ALREADY_STORED) for r in res)
                assert [r.status for r in await eng.load(batch)] == [LoadStatus.LOADED] * 3
                base += 3
                if finished:
                    break
            else:
                raise AssertionError("the Store never finished within 200 loop steps")
            assert cache.tiers.host.headroom_bytes > 0
        finally:
            pool.close()


def test_the_headroom_is_half_the_tier_at_most_and_none_with_a_disk_tier(tmp_path):
    """Scenario: the arena holds the tier's capacity, the spill staging budget and the headroom:
    256 MiB by default, at most half the tier, none with a disk tier (its Stores evict first)."""
    small = small_config(tmp_path, disk_blocks=0, host_capacity_bytes=1 << 20)
    assert tiers.store_headroom_bytes(small) == 512 << 10
    big = small_config(tmp_path, disk_blocks=0, host_capacity_bytes=8 << 30)
    assert tiers.store_headroom_bytes(big) == tiers.STORE_HEADROOM_BYTES
    assert tiers.arena_bytes(big) == (8 << 30) + tiers.STORE_HEADROOM_BYTES
    with_disk = small_config(tmp_path, disk_blocks=8, host_capacity_bytes=8 << 30)
    assert tiers.store_headroom_bytes(with_disk) == 0
    assert tiers.arena_bytes(with_disk) == (8 << 30) + tiers.spill_staging_bytes(with_disk)
