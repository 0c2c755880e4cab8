"""Retention and eviction semantics of DESIGN §5, driven on the core with a FakeClock.

Host tier: 4 blocks; disk tier: 8 blocks (tests/corekit.small_config). Blocks are numbered;
`Engine.load` checks every loaded block byte for byte.
"""

from __future__ import annotations

import pytest

from kvservice.core.clock import FakeClock
from kvservice.core.types import LoadStatus, StoreStatus, Tier
from tests.corekit import Engine, Pool, h, small_config, started_cache


@pytest.fixture
def pool():
    p = Pool(num_blocks=16)
    yield p
    p.close()


def tiers_of(eng: Engine, numbers: list[int]) -> list[Tier]:
    return [(eng.cache.lookup(eng.sid, [h(i)]) or [Tier.NONE])[0] for i in numbers]


async def store_each(eng: Engine, numbers, ttl=0.0):
    for i in numbers:
        (r,) = await eng.store([i], ttl)
        assert r.status in (StoreStatus.STORED, StoreStatus.ALREADY_STORED, StoreStatus.STORED_NOT_RETAINED)
    await eng.cache.tiers.drain()


async def test_retained_blocks_outlive_disk_pressure_that_evicts_unmarked(tmp_path, pool):
    """Scenario: two retained blocks, then a stream of best-effort blocks far larger than
    host + disk. The unmarked ones are evicted; the retained ones stay loadable, byte-exact."""
    async with started_cache(small_config(tmp_path)) as cache:
        eng = Engine(cache, pool)
        await store_each(eng, [0, 1], ttl=1000)
        await store_each(eng, range(2, 30))
        res = await eng.load([0, 1])
        assert [r.status for r in res] == [LoadStatus.LOADED] * 2
        c = cache.counters
        assert c.disk_evictions_unmarked > 0
        assert c.disk_evictions_retained == 0 and c.disk_evictions_expired == 0
        assert tiers_of(eng, [2, 3]) == [Tier.NONE, Tier.NONE]


async def test_expired_retained_blocks_become_ordinary_and_go_after_unmarked(tmp_path, pool):
    """Scenario: blocks retained for 10 s expire. They are not deleted at expiry (still on disk),
    and under pressure they are evicted before any unexpired retained block."""
    clock = FakeClock()
    async with started_cache(small_config(tmp_path), clock) as cache:
        eng = Engine(cache, pool)
        await store_each(eng, [0, 1, 2, 3], ttl=10)
        await store_each(eng, [4, 5, 6, 7], ttl=1000)
        clock.advance(20)
        assert tiers_of(eng, [0, 1, 2, 3]) == [Tier.DISK] * 4  # expired, still there
        await store_each(eng, [8, 9, 10, 11], ttl=1000)  # disk now full: 0-3 expired, 4-7 retained
        await store_each(eng, [12, 13, 14, 15], ttl=1000)
        assert tiers_of(eng, [0, 1, 2, 3]) == [Tier.NONE] * 4
        assert Tier.NONE not in tiers_of(eng, list(range(4, 16)))
        assert cache.counters.disk_evictions_expired == 4
        assert cache.counters.disk_evictions_retained == 0


async def test_unexpired_retained_blocks_are_evicted_in_deadline_order(tmp_path, pool):
    """Scenario: the disk is full of unexpired retained blocks with different deadlines; each
    new spill evicts the block whose deadline comes first."""
    async with started_cache(small_config(tmp_path)) as cache:
        eng = Engine(cache, pool)
        for i, ttl in zip([0, 1, 2, 3], [500, 100, 300, 200]):
            await store_each(eng, [i], ttl=ttl)
        await store_each(eng, [4, 5, 6, 7], ttl=1000)
        await store_each(eng, [8, 9, 10, 11], ttl=1000)  # disk: 0-7, full
        gone = []
        for new in (12, 13, 14, 15):
            await store_each(eng, [new], ttl=1000)
            gone.append([i for i in range(4) if tiers_of(eng, [i]) == [Tier.NONE]])
        assert gone == [[1], [1, 3], [1, 2, 3], [0, 1, 2, 3]]
        assert cache.counters.disk_evictions_retained == 4


async def test_protect_unexpired_refuses_admission_and_counts_it(tmp_path, pool):
    """Scenario: protect-unexpired, the disk full of unexpired retained blocks. Best-effort
    host victims are refused admission (counted); no retained block is lost, and a host
    full of retained blocks that could only be dropped refuses new stores instead."""
    async with started_cache(small_config(tmp_path, protect_unexpired=True)) as cache:
        eng = Engine(cache, pool)
        await store_each(eng, range(0, 12), ttl=1000)  # 8 on disk (full), 4 in host, all retained
        assert Tier.NONE not in tiers_of(eng, list(range(12)))
        res = await eng.store([12])
        assert res[0].status == StoreStatus.NOT_STORED  # host holds only retained blocks the disk can't take
        assert Tier.NONE not in tiers_of(eng, list(range(12)))
        for chunk in ([0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]):
            assert [r.status for r in await eng.load(chunk)] == [LoadStatus.LOADED] * 4

    async with started_cache(small_config(tmp_path / "b", protect_unexpired=True, host_capacity_bytes=8 * 4096)) as cache:
        eng = Engine(cache, pool)
        await store_each(eng, range(0, 8), ttl=1000)   # host: 0-7 retained
        await store_each(eng, range(8, 16))            # unmarked: pushes 0-7 to disk (full)
        await store_each(eng, range(16, 20))           # unmarked host victims find the disk full
        assert cache.counters.admission_refusals >= 4
        assert Tier.NONE not in tiers_of(eng, list(range(8)))
        assert cache.counters.disk_evictions_retained == 0


async def test_retained_only_gate_spills_only_retained_blocks(tmp_path, pool):
    """Scenario: gate retained-only. Best-effort host victims are dropped (counted as gate
    drops); retained victims spill to disk and load back byte-exact."""
    async with started_cache(small_config(tmp_path, admission_gate="retained-only")) as cache:
        eng = Engine(cache, pool)
        await store_each(eng, [0, 1], ttl=1000)
        await store_each(eng, [2, 3, 4, 5])
        await store_each(eng, [6, 7, 8, 9])
        assert tiers_of(eng, [0, 1]) == [Tier.DISK, Tier.DISK]
        assert tiers_of(eng, [2, 3, 4, 5]) == [Tier.NONE] * 4
        assert cache.counters.drops_gate == 4 and cache.counters.spills == 2
        assert [r.status for r in await eng.load([0, 1])] == [LoadStatus.LOADED] * 2


async def test_min_reuse_gate_spills_blocks_reused_enough(tmp_path, pool):
    """Scenario: gate min-reuse=2. A block loaded twice spills when evicted; one loaded once
    or never is dropped."""
    async with started_cache(small_config(tmp_path, admission_gate="min-reuse=2")) as cache:
        eng = Engine(cache, pool)
        await store_each(eng, [0, 1, 2, 3])
        for _ in range(2):
            await eng.load([0])
        await eng.load([1])
        await store_each(eng, [4, 5, 6, 7])
        assert tiers_of(eng, [0]) == [Tier.DISK]
        assert tiers_of(eng, [1, 2, 3]) == [Tier.NONE] * 3
        assert cache.counters.drops_gate == 3


async def test_retained_bytes_cap_per_namespace(tmp_path, pool):
    """Scenario: a cap of 2 blocks of retained bytes per namespace. The third retained store is
    kept without retention (STORED_NOT_RETAINED, counted); Retain is refused the same way; once
    the first deadlines pass, retention is granted again. Another namespace has its own cap."""
    clock = FakeClock()
    async with started_cache(small_config(tmp_path, retained_cap_bytes=2 * 4096), clock) as cache:
        eng = Engine(cache, pool)
        res = await eng.store([0, 1, 2], ttl=100)
        assert [r.status for r in res] == [StoreStatus.STORED, StoreStatus.STORED, StoreStatus.STORED_NOT_RETAINED]
        assert res[2].deadline == 0.0 and res[0].deadline == clock.now() + 100
        assert await cache.retain(eng.sid, [h(3)], 100) == [0.0]  # not stored: 0
        assert await cache.retain(eng.sid, [h(2)], 100) == [0.0]  # over the cap: 0
        assert cache.counters.retain_cap_refusals == 2
        clock.advance(101)
        assert (await cache.retain(eng.sid, [h(2)], 100))[0] == clock.now() + 100

        other_pool = Pool(num_blocks=16)
        try:
            from tests.corekit import ns_spec
            other = Engine(cache, other_pool, ns=ns_spec(model="other"))
            assert [r.status for r in await other.store([0, 1], ttl=100)] == [StoreStatus.STORED] * 2
        finally:
            other_pool.close()


async def test_deadlines_only_extend(tmp_path, pool):
    """Scenario: Retain with a shorter TTL never moves a deadline earlier."""
    clock = FakeClock()
    async with started_cache(small_config(tmp_path), clock) as cache:
        eng = Engine(cache, pool)
        (r,) = await eng.store([0], ttl=100)
        assert await cache.retain(eng.sid, [h(0)], 10) == [r.deadline]
        assert await cache.retain(eng.sid, [h(0)], 200) == [clock.now() + 200]


class SlowWrites:
    """The POSIX backend with writes held until released: a full write queue on demand.
    Injected at the I/O boundary, the only way to make a local disk slow on purpose."""

    def __init__(self):
        import threading

        from kvservice.disk.io_backend import PosixIO
        self._io = PosixIO()
        self.name = "posix-slow"
        self.gate = threading.Event()

    def write_file(self, path, chunks):
        self.gate.wait(30)
        return self._io.write_file(path, chunks)

    def __getattr__(self, name):
        return getattr(self._io, name)


async def test_shed_drops_only_best_effort_spills(tmp_path, pool):
    """Scenario: write queue of depth 1, policy shed, writes stalled. Best-effort spills that
    find the queue full are dropped and counted; retained spills wait and all reach disk."""
    import asyncio
    io = SlowWrites()  # stalls the BlockIO backend: the one-file-per-block format's writes
    cfg = small_config(tmp_path, write_queue_depth=1, writer_threads=1, write_queue_policy="shed",
                       disk_blocks=32, disk_format="files")
    async with started_cache(cfg, io=io) as cache:
        eng = Engine(cache, pool)
        await eng.store([0, 1, 2, 3])
        await eng.store([4, 5, 6, 7], ttl=1000)  # evicts best-effort 0-3 into a stalled queue
        assert cache.counters.drops_pressure > 0
        task = asyncio.create_task(eng.store([8, 9, 10, 11]))  # evicts retained 4-7: they wait
        await asyncio.sleep(0.2)
        assert not task.done()
        io.gate.set()
        await task
        await cache.tiers.drain()
        assert cache.counters.drops_pressure < 4
        assert tiers_of(eng, [4, 5, 6, 7]) == [Tier.DISK] * 4
        assert [r.status for r in await eng.load([4, 5, 6, 7])] == [LoadStatus.LOADED] * 4


async def test_clean_shutdown_writes_retained_blocks_that_were_only_in_host_memory(tmp_path, pool):
    """Scenario: retained and best-effort blocks sit in the host tier (never spilled) when the
    daemon stops cleanly. After a restart on the same disk, the retained ones load back
    byte-exact from disk with their deadlines; the best-effort ones are gone (host memory)."""
    clock = FakeClock()
    cfg = small_config(tmp_path)
    async with started_cache(cfg, clock) as cache:
        eng = Engine(cache, pool)
        deadlines = [r.deadline for r in await eng.store([0, 1], ttl=1000)]
        await eng.store([2])
        assert tiers_of(eng, [0, 1, 2]) == [Tier.HOST] * 3
    async with started_cache(cfg, clock) as cache:
        eng = Engine(cache, pool)
        assert tiers_of(eng, [0, 1, 2]) == [Tier.DISK, Tier.DISK, Tier.NONE]
        assert await cache.retain(eng.sid, [h(0), h(1)], 0) == deadlines
        assert [r.status for r in await eng.load([0, 1])] == [LoadStatus.LOADED] * 2
