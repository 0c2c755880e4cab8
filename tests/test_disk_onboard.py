"""A Load whose disk blocks find no free or clean host slot (the host tier full of blocks not yet
spilled) reads them into scratch buffers, serves them from there, and onboards them after the
reply as one batch (Tiers.onboard_many): one host-room plan for all of them (their victims spill
together), the copies into the host slots made off the loop. Core-level, on real segment files;
a copy is held at its one Python boundary (tiers._copy_rows) to cancel it mid-way."""

from __future__ import annotations

import asyncio
import threading

from kvservice.core import tiers as tiers_mod
from kvservice.core.types import LoadStatus, Tier
from kvservice.placement.index import DiskState
from tests.corekit import BLOCK, Engine, Pool, h, small_config, started_cache

N = 16  # blocks per Store and per Load; the host tier holds as many


async def _settled(cache) -> None:
    while cache._background:
        await asyncio.gather(*list(cache._background), return_exceptions=True)
    await cache.tiers.drain()


def _get(cache, i: int):
    found = [e for e in cache.tiers.index.values() if e.hash == h(i)]
    assert len(found) == 1
    return found[0]


async def _dirty_host(cache, eng: Engine) -> None:
    """Blocks 0..15 on disk only; the host tier full of 16..31, none of them on disk yet."""
    await eng.store(list(range(0, N)))
    await eng.store(list(range(N, 2 * N)))  # 0..15 spill
    await _settled(cache)
    assert all(_get(cache, i).slot < 0 and _get(cache, i).disk == DiskState.ON_DISK for i in range(N))
    assert all(_get(cache, i).slot >= 0 and _get(cache, i).disk == DiskState.NONE for i in range(N, 2 * N))


async def test_a_load_into_a_dirty_host_tier_is_onboarded_as_one_batch(tmp_path, monkeypatch):
    """Scenario: the Load is served byte-exact from scratch (no clean slot to land in); after the
    reply its 16 blocks are onboarded with one make_host_room call (not one per block), the 16
    dirty blocks they replace are spilled (on disk, out of the host tier), disk_onboards counts
    16, the next Load of them is all host hits with the same bytes, and nothing is half-made."""
    cfg = small_config(tmp_path, disk_blocks=4 * N, host_capacity_bytes=N * BLOCK)
    async with started_cache(cfg) as cache:
        pool = Pool(num_blocks=4 * N)
        try:
            eng = Engine(cache, pool)
            await _dirty_host(cache, eng)
            calls: list[int] = []
            real = cache.tiers.make_host_room

            def counted(size, n, now):
                calls.append(n)
                return real(size, n, now)

            monkeypatch.setattr(cache.tiers, "make_host_room", counted)
            onboards = cache.stats.total.disk_onboards
            res = await eng.load(list(range(N)))  # Engine.load compares the bytes
            assert [(r.status, r.tier) for r in res] == [(LoadStatus.LOADED, Tier.DISK)] * N
            await _settled(cache)
            assert calls == [N]
            assert cache.stats.total.disk_onboards == onboards + N
            assert all(_get(cache, i).slot >= 0 for i in range(N))
            assert all(_get(cache, i).slot < 0 and _get(cache, i).disk == DiskState.ON_DISK for i in range(N, 2 * N))
            assert cache.audit() == []
            res = await eng.load(list(range(N)))
            assert [(r.status, r.tier) for r in res] == [(LoadStatus.LOADED, Tier.HOST)] * N
        finally:
            pool.close()


async def test_an_onboard_cancelled_during_its_copy_gives_its_slots_back_once_the_copy_ends(tmp_path, monkeypatch):
    """Scenario: the batch's copy into the host slots is held at _copy_rows and its task is
    cancelled (the daemon stopping): the slots are not handed out while the copy still writes
    them; once it ends they are free again, no block claims them, the accounts balance, and the
    blocks still load byte-exact from disk."""
    gate, entered = threading.Event(), threading.Event()
    real_copy = tiers_mod._copy_rows

    def held(rows, srcs):
        entered.set()
        gate.wait(10)
        real_copy(rows, srcs)

    cfg = small_config(tmp_path, disk_blocks=4 * N, host_capacity_bytes=N * BLOCK)
    try:
        async with started_cache(cfg) as cache:
            pool = Pool(num_blocks=4 * N)
            try:
                eng = Engine(cache, pool)
                await _dirty_host(cache, eng)
                monkeypatch.setattr(tiers_mod, "_copy_rows", held)
                res = await eng.load(list(range(N)))
                assert all(r.status == LoadStatus.LOADED for r in res)
                while not entered.is_set():
                    await asyncio.sleep(0.005)
                loose = cache.tiers.host.loose_bytes
                assert loose == N * BLOCK  # taken for the copy, given to no block yet
                for task in list(cache._background):
                    task.cancel()
                await asyncio.sleep(0.02)
                assert cache.tiers.host.loose_bytes == loose  # the copy still writes them
                gate.set()
                while cache.tiers.host.loose_bytes:
                    await asyncio.sleep(0.005)
                monkeypatch.setattr(tiers_mod, "_copy_rows", real_copy)
                await _settled(cache)
                assert all(_get(cache, i).slot < 0 for i in range(N))  # not onboarded
                assert cache.audit() == []
                res = await eng.load(list(range(N)))
                assert all(r.status == LoadStatus.LOADED for r in res)
            finally:
                pool.close()
    finally:
        gate.set()
