"""A Store's spills into a full disk tier, as a batch (Tiers._spill_victims): one disk eviction
plan for all the victims' bytes, the planned disk blocks freed with one store call, one slot
reservation call; and a policy budget that counts each slot's metadata share (Tiers._size_budget),
so in a full tier no spill's first reservation fails (each used to, then evicted one more block).
Core-level, real segment files."""

from __future__ import annotations

import asyncio
import os

from kvservice.core.types import LoadStatus, Tier
from tests.corekit import BLOCK, Engine, Pool, small_config, started_cache

N = 16  # blocks per Store; the host tier holds as many


async def _settled(cache) -> None:
    while cache._background:
        await asyncio.gather(*list(cache._background), return_exceptions=True)
    await cache.tiers.drain()


def _files_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


async def test_a_full_tier_spills_each_store_as_one_batch_and_no_reservation_fails(tmp_path, monkeypatch):
    """Scenario: 10 Stores of 16 new blocks into a disk tier of 64 blocks (it fills after the
    fourth): from then on every Store's 16 victims get their slots from one reservation call that
    places all of them (none refused, none re-planned), each Store frees its disk victims with one
    call, the files stay within the capacity, nothing is half-made, and the newest 64 blocks on
    disk plus the 16 in host memory load byte-exact."""
    cfg = small_config(tmp_path, disk_blocks=4 * N, host_capacity_bytes=N * BLOCK)
    async with started_cache(cfg) as cache:
        pool = Pool(num_blocks=12 * N)  # Loads go to its upper half
        try:
            eng = Engine(cache, pool)
            seg = cache.tiers.segments
            reserves: list[tuple[int, int]] = []  # (blocks asked, refused)
            frees: list[int] = []
            real_reserve, real_reserve_many, real_free_many = seg.reserve, seg.reserve_many, seg.free_many

            def reserve(size):
                loc = real_reserve(size)
                reserves.append((1, int(loc is None)))
                return loc

            def reserve_many(sizes):
                locs = real_reserve_many(sizes)
                reserves.append((len(sizes), sum(loc is None for loc in locs)))
                return locs

            def free_many(locs):
                frees.append(len(locs))
                return real_free_many(locs)

            monkeypatch.setattr(seg, "reserve", reserve)
            monkeypatch.setattr(seg, "reserve_many", reserve_many)
            monkeypatch.setattr(seg, "free_many", free_many)
            for k in range(10):
                await eng.store(list(range(k * N, (k + 1) * N)))
                await _settled(cache)
                assert _files_bytes(cfg.disk_path) <= cfg.disk_capacity_bytes
                assert cache.audit() == []
            full = reserves[4:]  # the Stores after the tier filled (the 6th Store on)
            assert full and all(asked == N and refused == 0 for asked, refused in full), reserves
            assert frees[-5:] == [N] * 5, frees
            res = await eng.load(list(range(5 * N, 10 * N)))  # Engine.load compares the bytes
            assert all(r.status == LoadStatus.LOADED for r in res)
            assert sum(r.tier == Tier.DISK for r in res) == 4 * N
        finally:
            pool.close()


async def test_a_written_batch_settles_at_once_with_its_figures_exact(tmp_path, monkeypatch):
    """Scenario: Stores of 16 new blocks (every other one retained) into a full host tier whose spill
    staging budget holds 4 blocks, so each written batch has staged victims (off the tier's capacity)
    and unstaged ones (still on it, members of the host tier until written): every batch settles
    through Lifecycle.spills_written as one pass, and after each Store the tiers' and namespaces'
    figures are exact (audit walks every block), the disk copies load byte-exact."""
    cfg = small_config(tmp_path, disk_blocks=8 * N, host_capacity_bytes=N * BLOCK)
    async with started_cache(cfg) as cache:
        pool = Pool(num_blocks=14 * N)  # Loads go to its upper part
        try:
            eng = Engine(cache, pool)
            t = cache.tiers
            t.host.staging_bytes = 4 * BLOCK
            seen: list[tuple[int, int]] = []  # (staged, unstaged) entries of each batch settled at once
            real = t.life.spills_written

            def spills_written(entries):
                seen.append((sum(e.staged for e in entries), sum(not e.staged for e in entries)))
                return real(entries)
            monkeypatch.setattr(t.life, "spills_written", spills_written)
            for k in range(7):
                await eng.store(list(range(k * N, (k + 1) * N)), ttl=60.0 if k % 2 else 0.0)
                await _settled(cache)
                assert cache.audit() == []
            assert sum(s for s, _ in seen) > 0 and sum(u for _, u in seen) > 0, seen
            assert sum(s + u for s, u in seen) == 6 * N  # every spill settled in a batch
            res = await eng.load(list(range(0, 6 * N)))  # Engine.load compares the bytes
            assert all(r.status == LoadStatus.LOADED and r.tier == Tier.DISK for r in res)
            await _settled(cache)  # the disk hits' onboarding into host slots, after the reply
            assert cache.audit() == []
        finally:
            pool.close()
