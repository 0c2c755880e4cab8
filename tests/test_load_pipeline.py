"""A large Load of host blocks is copied in parts (BlockCache._load_host_parts): each part's
bookkeeping runs beside the next part's copy. Driven with parts of two blocks:
  - a Load of 10 blocks goes in 5 copies, every block byte-exact, its reuse counted once, its chain
    refreshed as one (head newest), nothing left pinned;
  - cancelled while its second part is copying, it leaves no pin once the copies in flight end,
    and the blocks load again;
  - a copy that fails in the second part fails the Load and leaves no pin either;
  - a later part with a miss: the head goes in parts, that part and the rest as one batch (the
    miss MISSING, the others LOADED), the whole chain refreshed head newest;
  - each part is looked up when it is handed over: a block evicted while an earlier part copies is
    MISSING (never stale bytes), the others LOADED, nothing left pinned;
  - cancelled while that rest's one batch copies, it leaves no pin either.
"""

from __future__ import annotations

import asyncio

import pytest

import kvservice.core.pipeline as pipeline_mod
from kvservice.core.types import LoadStatus, StoreStatus
from kvservice.memory.engine_memory import ShmEngineMemory
from tests.corekit import BLOCK, engine_on, h, small_config, started_cache
from tests.test_store_cancellation import Gate, cancelled, until


@pytest.fixture(params=[False, True], ids=["bookkeeping-beside-copies", "enqueue-first"])
def parts_of_two(monkeypatch, request):
    """Loads in parts of two blocks; each test runs with and without pipeline.LOAD_ENQUEUE_FIRST
    (bookkeeping only once the part just handed over is queued)."""
    monkeypatch.setattr(pipeline_mod, "PIPELINE_BLOCKS", 2)
    monkeypatch.setattr(pipeline_mod, "PIPELINE_FIRST", 2)
    monkeypatch.setattr(pipeline_mod, "LOAD_ENQUEUE_FIRST", request.param)


@pytest.fixture
def scatters(monkeypatch):
    """Host -> engine copies, counted; each from the one numbered `hold_from` (0-based) on waits at
    `gate` (open unless a test closes it), and the one numbered `fail_at` raises in its copy thread."""
    gate = Gate()
    gate.open.set()
    gate.calls = []
    gate.fail_at = -1
    gate.hold_from = 0
    real = ShmEngineMemory.scatter_from

    def scatter(self, block_ids, arena, offsets, enqueued=None):
        k = len(gate.calls)
        gate.calls.append(list(block_ids))
        if enqueued is not None:  # as a device copy: queued at once, its end waits (pipeline.ENQUEUE_FIRST)
            enqueued()
        if k >= gate.hold_from:
            gate.wait()
        if k == gate.fail_at:
            raise OSError("engine pool gone")
        return real(self, block_ids, arena, offsets)

    monkeypatch.setattr(ShmEngineMemory, "scatter_from", scatter)
    return gate


async def held_load(eng, scatters, stored: list[int], numbers: list[int], inside: int) -> asyncio.Future:
    """Store `stored`, close the copies' gate and start a Load of `numbers`: its task, once
    `inside` of its copies wait at the gate."""
    assert {r.status for r in await eng.store(stored)} == {StoreStatus.STORED}
    scatters.calls.clear()
    scatters.open.clear()
    task = asyncio.ensure_future(eng.load(numbers))
    await until(lambda: scatters.inside >= inside, f"{inside} of the Load's copies in flight")
    return task


async def cancel_then_drain(task: asyncio.Future, scatters, cache) -> None:
    """Cancel a held Load (the cache consistent meanwhile), open the gate, and once its copies have
    ended and their done callbacks ran: no pin left (the idle audit)."""
    assert cache.audit(idle=False) == []
    await cancelled(task)
    scatters.open.set()
    await until(lambda: scatters.inside == 0, "the copies to end")
    await asyncio.sleep(0.05)  # their done callbacks run on the loop
    assert cache.audit() == []


async def test_a_load_in_parts_is_byte_exact_and_refreshes_one_chain(tmp_path, parts_of_two, scatters):
    cfg = small_config(tmp_path, disk_blocks=0, host_capacity_bytes=32 * BLOCK)
    async with started_cache(cfg) as cache:
        async with engine_on(cache, 64) as eng:
            assert {r.status for r in await eng.store(list(range(20)))} == {StoreStatus.STORED}
            scatters.calls.clear()
            rs = await eng.load(list(range(10)))  # checks the bytes of every LOADED block
            assert [r.status for r in rs] == [LoadStatus.LOADED] * 10
            assert [len(c) for c in scatters.calls] == [2] * 5
            order = [e.hash for e in cache.tiers.host.entries_oldest_first()]
            assert order[-10:] == [h(i) for i in reversed(range(10))]  # head newest, as one chain
            d = cache.tiers.index.namespace(cache._sessions.get(eng.sid).namespace)
            assert [d[h(i)].reuse for i in range(12)] == [1] * 10 + [0] * 2
            assert cache.counters.loads_host == 10
            assert cache.audit() == []


async def test_a_load_cancelled_in_its_second_part_leaves_no_pin(tmp_path, parts_of_two, scatters):
    cfg = small_config(tmp_path, disk_blocks=0, host_capacity_bytes=32 * BLOCK)
    async with started_cache(cfg) as cache:
        async with engine_on(cache, 64) as eng:
            try:
                task = await held_load(eng, scatters, list(range(10)), list(range(10)), 2)
                await cancel_then_drain(task, scatters, cache)
                rs = await eng.load(list(range(10)))
                assert [r.status for r in rs] == [LoadStatus.LOADED] * 10
                assert cache.audit() == []
            finally:
                scatters.open.set()


async def test_a_copy_failing_in_the_second_part_fails_the_load_and_leaves_no_pin(tmp_path, parts_of_two, scatters):
    cfg = small_config(tmp_path, disk_blocks=0, host_capacity_bytes=32 * BLOCK)
    async with started_cache(cfg) as cache:
        async with engine_on(cache, 64) as eng:
            assert {r.status for r in await eng.store(list(range(10)))} == {StoreStatus.STORED}
            scatters.calls.clear()
            scatters.fail_at = 1
            with pytest.raises(OSError, match="engine pool gone"):
                await eng.load(list(range(10)))
            await until(lambda: scatters.inside == 0, "the copies to end")
            await asyncio.sleep(0.05)
            assert cache.audit() == []
            scatters.fail_at = -1
            rs = await eng.load(list(range(10)))
            assert [r.status for r in rs] == [LoadStatus.LOADED] * 10


async def test_a_miss_in_a_later_part_loads_the_rest_as_one_batch(tmp_path, parts_of_two, scatters):
    cfg = small_config(tmp_path, disk_blocks=0, host_capacity_bytes=32 * BLOCK)
    async with started_cache(cfg) as cache:
        async with engine_on(cache, 64) as eng:
            assert {r.status for r in await eng.store(list(range(6)) + list(range(7, 10)))} == {StoreStatus.STORED}
            scatters.calls.clear()
            rs = await eng.load(list(range(10)))  # block 6 was never stored: the fourth part
            assert [r.status for r in rs] == [LoadStatus.LOADED] * 6 + [LoadStatus.MISSING] + [LoadStatus.LOADED] * 3
            assert [len(c) for c in scatters.calls] == [2, 2, 2, 3]  # three parts, then 7..9 as one batch
            order = [e.hash for e in cache.tiers.host.entries_oldest_first()]
            assert order[-9:] == [h(i) for i in (9, 8, 7, 5, 4, 3, 2, 1, 0)]  # head newest, as one chain
            assert cache.counters.loads_host == 9 and cache.counters.load_misses == 1
            assert cache.audit() == []


async def test_a_block_evicted_while_an_earlier_part_copies_is_missing(tmp_path, parts_of_two, scatters):
    cfg = small_config(tmp_path, disk_blocks=0, host_capacity_bytes=32 * BLOCK)
    async with started_cache(cfg) as cache:
        async with engine_on(cache, 64) as eng:
            try:
                task = await held_load(eng, scatters, list(range(10)), list(range(10)), 1)
                d = cache.tiers.index.namespace(cache._sessions.get(eng.sid).namespace)
                victim = d[h(8)]
                assert not victim.pins  # not looked up yet: its part is not handed over
                cache.tiers.life.evict(victim, keep_slot=False)
                cache.tiers.life.forget(victim)
                assert cache.audit(idle=False) == []
                scatters.open.set()
                rs = await task
                assert [r.status for r in rs] == [LoadStatus.LOADED] * 8 + [LoadStatus.MISSING, LoadStatus.LOADED]
                await until(lambda: scatters.inside == 0, "the copies to end")
                assert cache.audit() == []
            finally:
                scatters.open.set()


async def test_a_load_cancelled_while_the_rest_after_its_parts_copies_leaves_no_pin(tmp_path, parts_of_two, scatters):
    """Three parts of host hits go, then the rest (from the part with a miss) is one batch: cancelled
    while that batch's copy runs, the Load leaves no pin once it ends, and loads again."""
    cfg = small_config(tmp_path, disk_blocks=0, host_capacity_bytes=32 * BLOCK)
    async with started_cache(cfg) as cache:
        async with engine_on(cache, 64) as eng:
            try:
                scatters.hold_from = 3  # the three head parts pass; the rest's copy waits
                task = await held_load(eng, scatters, list(range(6)) + list(range(7, 10)), list(range(10)), 1)
                assert [len(c) for c in scatters.calls] == [2, 2, 2, 3]
                await cancel_then_drain(task, scatters, cache)
                rs = await eng.load(list(range(10)))
                assert [r.status for r in rs] == [LoadStatus.LOADED] * 6 + [LoadStatus.MISSING] + [LoadStatus.LOADED] * 3
                assert cache.audit() == []
            finally:
                scatters.open.set()
