"""Admin.Stats without walking the index (issue 10 item 2): BlockCache.namespace_stats and
tier_stats read counts the lifecycle keeps where blocks change state (kvservice.placement.tier_counts)
and retention's sums, O(namespaces + sessions + tiers). Each scenario checks, after every step,
that they equal the walk they replaced (BlockCache._namespace_stats_walked / _tier_stats_walked,
the reference BlockCache.audit also checks), and the figures themselves; a lease or a deadline
that runs out by the clock alone changes pinned / retained blocks with no call in between.
"""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from kvservice.core.types import CacheError, ErrorCode, LoadStatus, PrefetchStatus, StoreStatus
from kvservice.disk.disk_tier import DiskTier
from kvservice.memory.host_tier import HostTier
from kvservice.placement.index import BlockIndex, Entry
from kvservice.placement.lru import ChainLRU
from kvservice.placement.tier_counts import ExpiringCount
from tests.corekit import BLOCK, Engine, Pool, h, ns_spec, small_config, started_cache


def checked(cache) -> tuple[dict[str, dict], dict[str, dict]]:
    """The Stats rows (by namespace id, by tier name), after checking them against the walk."""
    now = cache.clock.now()
    rows, tiers = cache.namespace_stats(), cache.tier_stats()
    assert rows == cache._namespace_stats_walked(now)
    assert tiers == cache._tier_stats_walked(now)
    assert cache.audit(idle=False) == []
    return {r["namespace_id"]: r for r in rows}, {t["name"]: t for t in tiers}


def only(rows: dict[str, dict]) -> dict:
    assert len(rows) == 1, rows
    return next(iter(rows.values()))


async def test_retention_deadlines_run_out_by_the_clock_alone(tmp_path):
    """Scenario: a host tier only; 4 blocks stored plainly, 2 with a 100 s TTL, one of the plain ones
    retained later. Retained bytes (namespace) and retained blocks (tier) follow; as the clock passes
    each deadline they drop with no call but Stats."""
    cfg = small_config(tmp_path, disk_blocks=0, host_capacity_bytes=8 * BLOCK)
    async with started_cache(cfg) as cache:
        pool = Pool(num_blocks=16)
        eng = Engine(cache, pool)
        assert all(r.status == StoreStatus.STORED for r in await eng.store([0, 1, 2, 3]))
        assert all(r.status == StoreStatus.STORED for r in await eng.store([4, 5], ttl=100.0))
        rows, tiers = checked(cache)
        row = only(rows)
        assert (row["host_blocks"], row["host_bytes"], row["disk_blocks"], row["retained_bytes"]) == \
               (6, 6 * BLOCK, 0, 2 * BLOCK)
        assert row["sessions"] == 1
        assert (tiers["host"]["blocks"], tiers["host"]["retained_blocks"], tiers["host"]["pinned_blocks"]) == (6, 2, 0)
        assert "disk" not in tiers

        cache.clock.advance(50.0)
        assert (await cache.retain(eng.sid, [h(0)], 100.0))[0] == cache.clock.now() + 100.0
        rows, tiers = checked(cache)
        assert only(rows)["retained_bytes"] == 3 * BLOCK and tiers["host"]["retained_blocks"] == 3

        cache.clock.advance(60.0)  # blocks 4 and 5 ran out (t = 100); block 0 runs until t = 150
        rows, tiers = checked(cache)
        assert only(rows)["retained_bytes"] == BLOCK and tiers["host"]["retained_blocks"] == 1
        cache.clock.advance(100.0)
        rows, tiers = checked(cache)
        assert only(rows)["retained_bytes"] == 0 and tiers["host"]["retained_blocks"] == 0
        assert only(rows)["host_blocks"] == 6  # expired blocks stay, they just stop counting as retained

        assert await cache.evict(expired=True) == 3
        rows, tiers = checked(cache)
        assert only(rows)["host_blocks"] == 3 and tiers["host"]["blocks"] == 3
        pool.close()


async def test_prefetch_leases_and_copies_in_flight_count_as_pinned(tmp_path):
    """Scenario: 4 host blocks; the session prefetches 0 and 1 (leased: pinned), loads 0 (its lease
    did its job: unpinned), then the clock passes block 1's lease end: unpinned with no reaping. A
    Load whose copy is held in flight pins its blocks until the copy ends. Leases still running
    when their session closes end with it."""
    cfg = small_config(tmp_path, disk_blocks=0, host_capacity_bytes=8 * BLOCK, pin_lease_seconds=5.0,
                       prefetch_share=1.0, prefetch_total_share=1.0, lease_seconds=1000.0)
    async with started_cache(cfg) as cache:
        pool = Pool(num_blocks=16)
        eng = Engine(cache, pool)
        await eng.store([0, 1, 2, 3])
        out = await cache.prefetch(eng.sid, [h(0), h(1)])
        assert [r.status for r in out] == [PrefetchStatus.ALREADY_IN_HOST] * 2
        _, tiers = checked(cache)
        assert tiers["host"]["pinned_blocks"] == 2
        assert [r.status for r in await eng.load([0])] == [LoadStatus.LOADED]
        _, tiers = checked(cache)
        assert tiers["host"]["pinned_blocks"] == 1
        cache.clock.advance(6.0)  # block 1's lease ran out; nothing reaped it yet
        assert len(cache.tiers.life.leases) == 1
        _, tiers = checked(cache)
        assert tiers["host"]["pinned_blocks"] == 0
        cache.reap_sessions()
        _, tiers = checked(cache)
        assert tiers["host"]["pinned_blocks"] == 0 and len(cache.tiers.life.leases) == 0

        # a lease taken again, then a Load's copy held in flight on top of it
        await cache.prefetch(eng.sid, [h(2)])
        memory = cache._sessions.get(eng.sid).memory
        started, go = threading.Event(), threading.Event()
        scatter = memory.scatter_from

        def held_scatter(*args):
            started.set()
            go.wait(10)
            return scatter(*args)

        memory.scatter_from = held_scatter
        try:
            load = asyncio.ensure_future(eng.load([1, 2, 3]))
            while not started.is_set():
                await asyncio.sleep(0.001)
            _, tiers = checked(cache)
            assert tiers["host"]["pinned_blocks"] == 3  # 1 and 3 by the copy, 2 by its lease and the copy
            cache.clock.advance(6.0)  # block 2's lease ends by the clock while the copy still pins it
            _, tiers = checked(cache)
            assert tiers["host"]["pinned_blocks"] == 3
            go.set()
            assert [r.status for r in await load] == [LoadStatus.LOADED] * 3
        finally:
            go.set()
            memory.scatter_from = scatter
        _, tiers = checked(cache)
        assert tiers["host"]["pinned_blocks"] == 0
        assert cache.audit() == []

        await cache.prefetch(eng.sid, [h(0), h(3)])  # leases that end with their session, before their time
        _, tiers = checked(cache)
        assert tiers["host"]["pinned_blocks"] == 2
        await cache.close_session(eng.sid)
        _, tiers = checked(cache)
        assert tiers["host"]["pinned_blocks"] == 0 and len(cache.tiers.life.leases) == 0
        pool.close()


async def test_spills_disk_reads_evictions_and_a_restart_keep_the_counts(tmp_path):
    """Scenario: a host tier of 4 blocks over a disk tier of 24. Retained and plain blocks stored
    beyond the host tier spill; Loads and a Prefetch read disk blocks back (onboarded, leased on
    both tiers); retained blocks expire; admin evictions; a restart recovers the disk tier (its
    blocks adopted with their deadlines). After each step the counts equal the walk."""
    cfg = small_config(tmp_path, disk_blocks=24, pin_lease_seconds=5.0, prefetch_share=1.0,
                       prefetch_total_share=1.0, lease_seconds=1e6)
    clock_at = None
    async with started_cache(cfg) as cache:
        pool = Pool(num_blocks=16)
        eng = Engine(cache, pool)
        assert all(r.status == StoreStatus.STORED for r in await eng.store([0, 1, 2, 3], ttl=1000.0))
        checked(cache)
        for lo in (4, 8, 12):
            assert all(r.status == StoreStatus.STORED for r in await eng.store(list(range(lo, lo + 4))))
            checked(cache)
        await cache.tiers.drain()
        rows, tiers = checked(cache)
        row = only(rows)
        assert tiers["disk"]["blocks"] >= 12 and row["disk_blocks"] == tiers["disk"]["blocks"]
        assert row["disk_bytes"] == row["disk_blocks"] * BLOCK
        assert row["host_blocks"] == tiers["host"]["blocks"] <= 4
        assert tiers["disk"]["retained_blocks"] == 4 and row["retained_bytes"] == 4 * BLOCK

        res = await eng.load([0, 1, 2, 3])  # disk hits, onboarded
        assert all(r.status == LoadStatus.LOADED for r in res)
        await asyncio.gather(*cache._background)
        await cache.tiers.drain()
        checked(cache)
        out = await cache.prefetch(eng.sid, [h(i) for i in (5, 6)])  # staged from disk, leased
        await cache.tiers.drain()
        _, tiers = checked(cache)
        staged = [r for r in out if r.status == PrefetchStatus.STAGED]
        assert staged and tiers["host"]["pinned_blocks"] == len(staged) and tiers["disk"]["pinned_blocks"] >= len(staged)
        cache.clock.advance(6.0)
        _, tiers = checked(cache)
        assert tiers["host"]["pinned_blocks"] == tiers["disk"]["pinned_blocks"] == 0

        assert all(r.status == StoreStatus.STORED for r in await eng.store([20, 21], ttl=5000.0))
        await cache.tiers.drain()
        checked(cache)
        cache.clock.advance(1000.0)  # blocks 0-3 ran out; 20 and 21 run until 5000 s after their store
        rows, tiers = checked(cache)
        assert only(rows)["retained_bytes"] == 2 * BLOCK
        assert tiers["host"]["retained_blocks"] + tiers["disk"]["retained_blocks"] >= 2
        assert await cache.evict(expired=True) == 4
        await cache.tiers.drain()
        checked(cache)
        clock_at = cache.clock
        await cache.close_session(eng.sid)
        pool.close()
        disk_before = cache.tier_stats()[1]["blocks"]

    async with started_cache(cfg, clock_at) as cache:  # restart: the disk tier's blocks are adopted
        rows, tiers = checked(cache)
        row = only(rows)
        assert tiers["disk"]["blocks"] == row["disk_blocks"] >= disk_before - 2 and row["sessions"] == 0
        assert row["host_blocks"] == 0 and tiers["host"]["blocks"] == 0
        assert row["retained_bytes"] == 2 * BLOCK and tiers["disk"]["retained_blocks"] == 2
        clock_at.advance(5000.0)
        rows, tiers = checked(cache)
        assert only(rows)["retained_bytes"] == 0 and tiers["disk"]["retained_blocks"] == 0
        pool = Pool(num_blocks=16)
        eng = Engine(cache, pool)
        assert all(r.status == LoadStatus.LOADED for r in await eng.load([20, 21]))
        await asyncio.gather(*cache._background)
        checked(cache)
        assert await cache.evict(all=True) > 0
        await cache.tiers.drain()
        rows, tiers = checked(cache)
        assert (only(rows)["host_blocks"], only(rows)["disk_blocks"]) == (0, 0)
        assert tiers["host"]["blocks"] == tiers["disk"]["blocks"] == 0
        await cache.close_session(eng.sid)
        pool.close()


async def test_victims_of_several_namespaces_leave_each_namespace_s_counts(tmp_path):
    """Scenario: no disk tier, a host tier of 6 blocks; two namespaces store in turns, so a Store's
    victims (dropped as one batch) belong to both namespaces."""
    cfg = small_config(tmp_path, disk_blocks=0, host_capacity_bytes=6 * BLOCK)
    async with started_cache(cfg) as cache:
        pools = [Pool(num_blocks=16), Pool(num_blocks=16)]
        a, b = Engine(cache, pools[0]), Engine(cache, pools[1], ns_spec(model="other"))
        for k in range(6):
            await a.store([10 * k, 10 * k + 1])
            checked(cache)
            await b.store([10 * k + 2, 10 * k + 3, 10 * k + 4], ttl=30.0 * (k % 2))
            rows, tiers = checked(cache)
            assert sum(r["host_blocks"] for r in rows.values()) == tiers["host"]["blocks"] <= 6
        rows, _ = checked(cache)
        assert len(rows) == 2 and all(r["host_blocks"] for r in rows.values())
        assert await cache.evict(namespace=cache._sessions.get(b.sid).namespace) > 0
        rows, tiers = checked(cache)
        assert rows[cache._sessions.get(b.sid).namespace]["host_blocks"] == 0
        for p in pools:
            p.close()


async def test_stats_and_describe_blocks_walk_no_block(tmp_path, monkeypatch):
    """With the walks made to fail, Stats' two views still answer (and DescribeBlocks' namespace
    check): they read counts, not entries."""
    cfg = small_config(tmp_path, disk_blocks=16)
    async with started_cache(cfg) as cache:
        pool = Pool(num_blocks=16)
        eng = Engine(cache, pool)
        await eng.store(list(range(8)), ttl=10.0)
        await cache.tiers.drain()
        before = checked(cache)

        def no_walk(*args, **kw):
            raise AssertionError("Stats walked the blocks")

        for cls, name in ((BlockIndex, "values"), (HostTier, "entries"), (HostTier, "entries_oldest_first"),
                          (DiskTier, "entries"), (ChainLRU, "values"), (ChainLRU, "oldest_first")):
            monkeypatch.setattr(cls, name, no_walk)
        rows = {r["namespace_id"]: r for r in cache.namespace_stats()}
        tiers = {t["name"]: t for t in cache.tier_stats()}
        assert (rows, tiers) == before
        ns = only(rows)["namespace_id"]
        assert cache.describe_blocks(ns, [h(7), h(99)])[1] is None
        with pytest.raises(CacheError) as err:
            cache.describe_blocks("0" * 32, [h(0)])
        assert err.value.code == ErrorCode.NOT_FOUND
        monkeypatch.undo()
        await cache.close_session(eng.sid)
        pool.close()


def test_expiring_count_equals_the_walk_through_a_random_history():
    """ExpiringCount against a brute-force count: members joining and leaving, times moving later
    (or ending and starting again), the clock advancing between reads, reads at random moments."""
    rng = random.Random(11)
    entries = [Entry("ns", bytes([i]) * 32, 1, 0, 0.0) for i in range(40)]
    c = ExpiringCount(lambda e: e.deadline)
    members: set[int] = set()
    now = 0.0
    for step in range(5000):
        k = rng.randrange(len(entries))
        e = entries[k]
        op = rng.random()
        if op < 0.3:  # joins (or is added again)
            members.add(k)
            c.add(e)
        elif op < 0.5:
            members.discard(k)
            c.discard(e)
        elif op < 0.75:  # its time moves (later, or to 0 and back: a lease ended and taken again)
            e.deadline = 0.0 if rng.random() < 0.2 else max(e.deadline, now) + rng.choice([0.5, 1, 3, 10])
            if e.deadline == 0.0:
                c.discard(e)
                members.discard(k)
            elif k in members:
                c.add(e)
        elif op < 0.9:
            now += rng.choice([0.0, 0.5, 1.0, 2.0])
        else:
            assert c.count(now) == sum(1 for j in members if entries[j].deadline > now), step
    assert c.count(now) == sum(1 for j in members if entries[j].deadline > now)
