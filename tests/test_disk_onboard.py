"""A Load whose disk blocks find no free or clean host slot (the host tier full of blocks not yet
spilled) reads them into scratch buffers, serves them from there, and onboards them after the
reply as one batch (Tiers.onboard_many): one host-room plan for all of them (their victims spill
together), the slots taken (loose), filled on a copy thread off the event loop, and given to their
blocks once the copy has ended (cancelled: given back once the copy thread is done with them).
Core-level, on real segment files; the victims' spill writes are held at the segment I/O
boundary (os_pwritev) to cancel the onboarding while it waits for them."""

from __future__ import annotations

import asyncio
import threading
from contextlib import asynccontextmanager

import kvservice.core.host_room as host_room_mod
from kvservice.core.types import LoadStatus, PrefetchStatus, StoreStatus, Tier
from kvservice.disk import segment
from kvservice.placement.index import DiskState
from tests.corekit import BLOCK, Engine, Pool, h, small_config, started_cache
from tests.test_store_cancellation import cancelled

N = 16  # blocks per Store and per Load; the host tier holds as many


async def _settled(cache) -> None:
    while cache._background:
        await asyncio.gather(*list(cache._background), return_exceptions=True)
    await cache.tiers.drain()


def _get(cache, i: int):
    found = [e for e in cache.tiers.index.values() if e.hash == h(i)]
    assert len(found) == 1
    return found[0]


def _room_calls(cache, monkeypatch) -> list[int]:
    """The `n` of every Tiers.make_host_room call from now on (one per eviction plan)."""
    calls: list[int] = []
    real = cache.tiers.make_host_room

    def counted(size, n, now):
        calls.append(n)
        return real(size, n, now)

    monkeypatch.setattr(cache.tiers, "make_host_room", counted)
    return calls


async def _dirty_host(cache, eng: Engine) -> None:
    """Blocks 0..15 on disk only; the host tier full of 16..31, none of them on disk yet."""
    await eng.store(list(range(N)))
    await eng.store(list(range(N, 2 * N)))  # 0..15 spill
    await _settled(cache)
    assert all(_get(cache, i).slot < 0 and _get(cache, i).disk == DiskState.ON_DISK for i in range(N))
    assert all(_get(cache, i).slot >= 0 and _get(cache, i).disk == DiskState.NONE for i in range(N, 2 * N))


@asynccontextmanager
async def _dirty(cfg):
    """A started cache with an engine on it, its host tier made dirty by _dirty_host: (cache, engine)."""
    async with started_cache(cfg) as cache:
        pool = Pool(num_blocks=4 * N)
        try:
            eng = Engine(cache, pool)
            await _dirty_host(cache, eng)
            yield cache, eng
        finally:
            pool.close()


@asynccontextmanager
async def _spills_held(eng: Engine, monkeypatch):
    """Spill writes held at the segment I/O boundary: blocks 2N..3N are stored (they fill the spill
    staging budget; their writes wait at the boundary) before the body runs. Yields release(), which
    lets every held write go and writes go straight through again; on exit they go in any case."""
    gate, entered = threading.Event(), threading.Event()
    real_write = segment.os_pwritev

    def held(fd, bufs, off):
        entered.set()
        gate.wait(10)
        return real_write(fd, bufs, off)

    def release() -> None:
        gate.set()
        monkeypatch.setattr(segment, "os_pwritev", real_write)

    monkeypatch.setattr(segment, "os_pwritev", held)
    try:
        await eng.store(list(range(2 * N, 3 * N)))
        while not entered.is_set():
            await asyncio.sleep(0.005)
        yield release
    finally:
        gate.set()


async def test_a_load_into_a_dirty_host_tier_is_onboarded_as_one_batch(tmp_path, monkeypatch):
    """Scenario: the Load is served byte-exact from scratch (no clean slot to land in); after the
    reply its 16 blocks are onboarded with one make_host_room call (not one per block), the 16
    dirty blocks they replace are spilled (on disk, out of the host tier), disk_onboards counts
    16, the next Load of them is all host hits with the same bytes, and nothing is half-made."""
    cfg = small_config(tmp_path, disk_blocks=4 * N, host_capacity_bytes=N * BLOCK)
    async with _dirty(cfg) as (cache, eng):
        calls = _room_calls(cache, monkeypatch)
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


async def test_an_onboard_cancelled_while_its_victims_spill_holds_no_slot_and_leaves_nothing_half_made(
        tmp_path, monkeypatch):
    """Scenario: the batch's victims' spill writes are held at the segment I/O boundary, so the
    onboarding waits for their room after the Load's reply; meanwhile it holds no host slot that
    no block owns (the core's accounts balance between calls, as the property machine checks);
    its task is cancelled (the daemon stopping), the writes let go: nothing is half-made, the
    victims end on disk, and the Load's blocks still load byte-exact from disk."""
    cfg = small_config(tmp_path, disk_blocks=4 * N, host_capacity_bytes=N * BLOCK)
    async with _dirty(cfg) as (cache, eng), _spills_held(eng, monkeypatch) as release:
        res = await eng.load(list(range(N)))  # no clean slot: served from scratch
        assert [(r.status, r.tier) for r in res] == [(LoadStatus.LOADED, Tier.DISK)] * N
        await asyncio.sleep(0.05)  # the onboarding now waits for its victims' (32..47) spills
        assert cache._background and all(_get(cache, i).slot < 0 for i in range(N))
        assert cache.tiers.host.loose_bytes == 0
        host = sum(e.size for e in cache.tiers.index.values() if e.host_buf is not None)
        assert host == cache.tiers.host.used_bytes
        for task in list(cache._background):
            task.cancel()
        release()
        await _settled(cache)
        assert cache.tiers.host.loose_bytes == 0
        assert all(_get(cache, i).slot < 0 for i in range(N))  # not onboarded
        assert cache.audit() == []
        res = await eng.load(list(range(N)))
        assert all(r.status == LoadStatus.LOADED for r in res)


async def test_a_prefetch_into_a_dirty_host_tier_is_staged_as_one_batch(tmp_path, monkeypatch):
    """Scenario: the host tier is full of blocks not yet on disk and a Prefetch asks for 16 disk
    blocks: they are read into scratch and onboarded with one make_host_room call (the 16 victims
    spill together, one wait for their room, not a wait per block); every block is STAGED under a
    lease, the next Load of them is all host hits with the same bytes, and nothing is half-made.
    The daemon's Prefetch latency and its disk-read latency are observed once each."""
    cfg = small_config(tmp_path, disk_blocks=4 * N, host_capacity_bytes=N * BLOCK, prefetch_share=1.0,
                       prefetch_total_share=1.0)
    async with _dirty(cfg) as (cache, eng):
        calls = _room_calls(cache, monkeypatch)
        out = await cache.prefetch(eng.sid, [h(i) for i in range(N)])
        assert [r.status for r in out] == [PrefetchStatus.STAGED] * N, [r.message for r in out]
        assert calls == [N]
        now = cache.clock.now()
        assert all(_get(cache, i).slot >= 0 and _get(cache, i).lease_until > now for i in range(N))
        await _settled(cache)
        assert all(_get(cache, i).slot < 0 and _get(cache, i).disk == DiskState.ON_DISK for i in range(N, 2 * N))
        assert cache.stats.total.prefetch_staged == N
        lat = {hist.name: hist.count for hist in cache.latencies}
        assert lat["prefetch"] == 1 and lat["prefetch_read"] == 1
        assert cache.audit() == []
        res = await eng.load(list(range(N)))  # Engine.load compares the bytes
        assert [(r.status, r.tier) for r in res] == [(LoadStatus.LOADED, Tier.HOST)] * N


async def test_a_prefetch_cancelled_while_its_victims_spill_leaves_nothing_half_made(tmp_path, monkeypatch):
    """Scenario: a Prefetch's 16 disk blocks land in scratch (the host tier full of blocks not yet on
    disk) and its one onboarding waits for the victims' spill writes, which are held at the segment
    I/O boundary. The call is cancelled there (its engine gone): it raises CancelledError, holds no
    pin and no lease afterwards, no slot is left that no block owns, and once the writes let go the
    audit is clean, the victims are on disk and the prefetched blocks still load byte-exact."""
    cfg = small_config(tmp_path, disk_blocks=4 * N, host_capacity_bytes=N * BLOCK, prefetch_share=1.0,
                       prefetch_total_share=1.0)
    async with _dirty(cfg) as (cache, eng), _spills_held(eng, monkeypatch) as release:
        onboarding = asyncio.Event()
        real_onboard = cache.tiers.onboard_many

        async def onboard_many(entries, bufs, evict=True):
            onboarding.set()
            return await real_onboard(entries, bufs, evict)

        monkeypatch.setattr(cache.tiers, "onboard_many", onboard_many)
        task = asyncio.ensure_future(cache.prefetch(eng.sid, [h(i) for i in range(N)]))
        await asyncio.wait_for(onboarding.wait(), 10)  # read into scratch; now it waits for its victims' room
        await asyncio.sleep(0.05)
        assert not task.done() and cache.tiers.reads_in_flight == 0
        assert all(_get(cache, i).slot < 0 for i in range(N))  # not onboarded yet
        await cancelled(task)
        now = cache.clock.now()
        assert all(_get(cache, i).pins == 0 and _get(cache, i).lease_until <= now for i in range(N))
        assert cache.tiers.host.loose_bytes == 0
        assert cache.audit(idle=False) == []
        release()
        await _settled(cache)
        assert cache.audit() == []
        assert all(_get(cache, i).disk == DiskState.ON_DISK for i in range(N, 2 * N))
        res = await eng.load(list(range(N)))  # Engine.load compares the bytes
        assert all(r.status == LoadStatus.LOADED for r in res)


async def test_with_onboard_disk_hits_clean_a_load_into_a_dirty_host_tier_writes_nothing(tmp_path, monkeypatch):
    """Scenario: onboard_disk_hits = "clean". A Load of 16 disk blocks into a host tier full of blocks
    not yet on disk is served byte-exact from scratch, and afterwards nothing was evicted or spilled
    for it: no make_host_room call, the 16 dirty blocks are still in host memory and still not on
    disk, the loaded blocks stay on disk only (the next Load reads them from disk again, byte-exact),
    and the audit is clean. (The default, "always", onboards them: the first test above.)"""
    cfg = small_config(tmp_path, disk_blocks=4 * N, host_capacity_bytes=N * BLOCK, onboard_disk_hits="clean")
    async with _dirty(cfg) as (cache, eng):
        calls = _room_calls(cache, monkeypatch)
        spills = cache.stats.total.spills
        for _ in range(2):
            res = await eng.load(list(range(N)))  # Engine.load compares the bytes
            assert [(r.status, r.tier) for r in res] == [(LoadStatus.LOADED, Tier.DISK)] * N
            await _settled(cache)
            assert calls == [] and cache.stats.total.spills == spills
            assert all(_get(cache, i).slot < 0 and _get(cache, i).disk == DiskState.ON_DISK for i in range(N))
            assert all(_get(cache, i).slot >= 0 and _get(cache, i).disk == DiskState.NONE
                       for i in range(N, 2 * N))
            assert cache.audit() == []


@asynccontextmanager
async def _onboard_copies_held(monkeypatch):
    """Tiers.onboard_many's copies (scratch -> host slots, on its copy thread) held until release();
    yields (entered, release): entered is set once a copy is held."""
    gate, entered = threading.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    real = host_room_mod._copy_rows

    def held(rows, srcs):
        loop.call_soon_threadsafe(entered.set)
        gate.wait(10)
        return real(rows, srcs)

    monkeypatch.setattr(host_room_mod, "_copy_rows", held)
    try:
        yield entered, gate.set
    finally:
        gate.set()


async def test_a_load_answers_before_its_onboarding_copy_ends(tmp_path, monkeypatch):
    """Scenario: the onboarding after a Load into a dirty host tier copies 16 blocks out of scratch
    (up to a whole Load's bytes). That copy runs on a copy thread: held there, the Load has already
    answered byte-exact, a Lookup is answered meanwhile (the event loop is free), the slots being
    filled are loose (taken, no block's) and the audit of a busy cache holds; released, the blocks
    are in host memory with the bytes that were stored, and nothing is left loose."""
    cfg = small_config(tmp_path, disk_blocks=4 * N, host_capacity_bytes=N * BLOCK)
    async with _dirty(cfg) as (cache, eng), _onboard_copies_held(monkeypatch) as (entered, release):
        res = await eng.load(list(range(N)))  # Engine.load compares the bytes
        assert [(r.status, r.tier) for r in res] == [(LoadStatus.LOADED, Tier.DISK)] * N
        await asyncio.wait_for(entered.wait(), 10)  # the onboarding's copy is on its thread, held
        assert cache._background and cache.tiers.host.loose_bytes == N * BLOCK
        assert cache.lookup(eng.sid, [h(i) for i in range(N)]) == [Tier.DISK] * N
        assert cache.audit(idle=False) == []
        release()
        await _settled(cache)
        assert cache.tiers.host.loose_bytes == 0 and cache.audit() == []
        assert all(_get(cache, i).slot >= 0 for i in range(N))
        res = await eng.load(list(range(N)))  # from host memory now, byte-exact
        assert [(r.status, r.tier) for r in res] == [(LoadStatus.LOADED, Tier.HOST)] * N


async def test_a_prefetch_cancelled_during_its_onboarding_copy_gives_the_slots_back(tmp_path, monkeypatch):
    """Scenario: a Prefetch whose 16 disk blocks landed in scratch is cancelled while its onboarding
    copy runs (held on the copy thread). It raises CancelledError at once; the slots that copy
    writes stay taken (loose) until the thread is done with them, then go back to the arena; the
    blocks are not onboarded, no pin or lease is left, and they still load byte-exact from disk."""
    cfg = small_config(tmp_path, disk_blocks=4 * N, host_capacity_bytes=N * BLOCK, prefetch_share=1.0,
                       prefetch_total_share=1.0)
    async with _dirty(cfg) as (cache, eng), _onboard_copies_held(monkeypatch) as (entered, release):
        await _settled(cache)
        task = asyncio.ensure_future(cache.prefetch(eng.sid, [h(i) for i in range(N)]))
        await asyncio.wait_for(entered.wait(), 10)
        await cancelled(task)
        assert cache.tiers.host.loose_bytes == N * BLOCK  # the copy thread still writes them
        assert cache.audit(idle=False) == []
        release()
        for _ in range(200):
            if not cache.tiers.host.loose_bytes:
                break
            await asyncio.sleep(0.01)
        await _settled(cache)
        now = cache.clock.now()
        assert cache.tiers.host.loose_bytes == 0 and cache.audit() == []
        assert all(_get(cache, i).slot < 0 and _get(cache, i).pins == 0 and _get(cache, i).lease_until <= now
                   for i in range(N))
        res = await eng.load(list(range(N)))  # Engine.load compares the bytes
        assert all(r.status == LoadStatus.LOADED for r in res)


async def test_a_store_waits_for_an_onboarding_copy_instead_of_being_refused(tmp_path, monkeypatch):
    """Scenario: a Load of 16 disk blocks into a dirty host tier of 16 blocks; its onboarding copy is
    held on its thread (its 16 slots loose, the dirty blocks they replace spilling). A Store of 16 new blocks asked meanwhile does not answer NOT_STORED for the
    slots that are only loose for a memcpy: it waits for the copy, then evicts (the onboarded blocks
    have a disk copy) and stores all 16, byte-exact, and nothing is left loose or half-made."""
    cfg = small_config(tmp_path, disk_blocks=6 * N, host_capacity_bytes=N * BLOCK)
    async with _dirty(cfg) as (cache, eng), _onboard_copies_held(monkeypatch) as (entered, release):
        res = await eng.load(list(range(N)))
        assert [(r.status, r.tier) for r in res] == [(LoadStatus.LOADED, Tier.DISK)] * N
        await asyncio.wait_for(entered.wait(), 10)
        store = asyncio.ensure_future(eng.store(list(range(3 * N, 4 * N))))
        await asyncio.sleep(0.1)
        assert not store.done(), "the Store must wait for the onboarding copy, not be refused"
        release()
        rs = await asyncio.wait_for(store, 10)
        assert [r.status for r in rs] == [StoreStatus.STORED] * N, [r.message for r in rs][:2]
        await _settled(cache)
        assert cache.tiers.host.loose_bytes == 0 and cache.audit() == []
        res = await eng.load(list(range(3 * N, 4 * N)))  # Engine.load compares the bytes
        assert [r.status for r in res] == [LoadStatus.LOADED] * N


async def test_a_store_cancelled_while_it_waits_for_an_onboarding_copy_leaves_nothing_half_made(tmp_path, monkeypatch):
    """Scenario: as above, the Store of 16 new blocks waits for a Load's onboarding copy (held on its
    thread); it is cancelled there. It raises CancelledError, none of its hashes is left reserved or
    in the index; once the copy is released the onboarded blocks are resident, nothing is loose, and
    the same 16 blocks store again, byte-exact."""
    cfg = small_config(tmp_path, disk_blocks=6 * N, host_capacity_bytes=N * BLOCK)
    async with _dirty(cfg) as (cache, eng), _onboard_copies_held(monkeypatch) as (entered, release):
        await eng.load(list(range(N)))
        await asyncio.wait_for(entered.wait(), 10)
        store = asyncio.ensure_future(eng.store(list(range(3 * N, 4 * N))))
        await asyncio.sleep(0.1)
        assert not store.done()
        await cancelled(store)
        assert not [e for e in cache.tiers.index.values() if not e.ready], "half-made entries after the cancel"
        assert cache.lookup(eng.sid, [h(3 * N)]) == []
        assert cache.audit(idle=False) == []
        release()
        await _settled(cache)
        assert cache.tiers.host.loose_bytes == 0 and cache.audit() == []
        assert all(_get(cache, i).slot >= 0 for i in range(N))
        rs = await eng.store(list(range(3 * N, 4 * N)))
        assert [r.status for r in rs] == [StoreStatus.STORED] * N
        res = await eng.load(list(range(3 * N, 4 * N)))  # Engine.load compares the bytes
        assert [r.status for r in res] == [LoadStatus.LOADED] * N
