"""A large Store is planned and copied in parts (BlockCache._store_chunk, PIPELINE_BLOCKS): the
next part's eviction plan runs beside the previous part's copy. Driven here with parts of one or
two blocks, so the small batches of the tests take that path:
  - the lifecycle property machine (cancellation and dead clients at every await point, audit at
    every step, every LOADED block byte-exact) runs again on it;
  - a Store of 10 blocks in parts of 2 stores every block byte-exact and commits them as one chain
    (its head is the newest in the LRU, as a Store in one part);
  - cancelled while its second part is copying, it leaves nothing reserved, pinned or half-made,
    and the same hashes store again;
  - a part that does not fit (pinned tier) answers NOT_STORED for the rest of the chunk and keeps
    the prefix stored;
  - a hash a Store has reserved but not placed yet (a RESERVED entry) is not stored for Lookup and
    Load, and another Store of it waits for the first one: ALREADY_STORED once it committed,
    NOT_STORED if it was cancelled; a hash twice in one Store in parts is stored once.
"""

from __future__ import annotations

import asyncio
import contextvars

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

import kvservice.core.cache as cache_mod
import kvservice.core.pipeline as pipeline_mod
from kvservice.core.types import LoadStatus, StoreStatus
from tests.corekit import BLOCK, engine_on, h, small_config, started_cache
from tests.test_lifecycle_properties import LifecycleMachine
from tests.test_store_cancellation import cancelled, gated_gather, restore_works, until  # noqa: F401 (fixture)

_chunk_parts: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("chunk_parts", default=None)


@pytest.fixture(params=[(True, False), (False, False), (True, True)],
                ids=["enqueue-first", "plan-beside-copies", "head-first"])
def parts_of(monkeypatch, request):
    """Set the part size; returns the sizes of the parts planned so far (one list for the test).
    `parts_of.per_chunk`: how many parts each chunk stored was planned in (per task: concurrent
    Stores do not mix their counts). Each test runs with pipeline.ENQUEUE_FIRST on (the default: the
    next part planned once the copy just handed over is queued) and off, and with parts by bytes
    (pipeline.STORE_FIRST_BYTES of two blocks: a Store of more than two blocks reserves its first
    part, starts its copy, then reserves the rest, StorePath._store_head_first; the parts are the
    same as by count, as the first part is at most the part size)."""
    enqueue_first, head_first = request.param
    monkeypatch.setattr(pipeline_mod, "ENQUEUE_FIRST", enqueue_first)
    monkeypatch.setattr(pipeline_mod, "STORE_FIRST_BYTES", 2 * BLOCK if head_first else 0)
    monkeypatch.setattr(pipeline_mod, "STORE_GROW", 2)
    planned: list[int] = []
    per_chunk: list[int] = []
    real, real_chunk = cache_mod.BlockCache._host_room, cache_mod.BlockCache._store_chunk

    async def counted(self, size, n, now):
        planned.append(n)
        mine = _chunk_parts.get()
        if mine is not None:
            mine.append(n)
        return await real(self, size, n, now)

    async def chunk(self, s, pos, entries, *args):
        mine: list[int] = []
        token = _chunk_parts.set(mine)
        try:
            return await real_chunk(self, s, pos, entries, *args)
        finally:
            _chunk_parts.reset(token)
            per_chunk.append(len(mine))

    monkeypatch.setattr(cache_mod.BlockCache, "_host_room", counted)
    monkeypatch.setattr(cache_mod.BlockCache, "_store_chunk", chunk)

    def set_parts(blocks: int, depth: int = 2) -> list[int]:
        monkeypatch.setattr(pipeline_mod, "PIPELINE_BLOCKS", blocks)
        monkeypatch.setattr(pipeline_mod, "PIPELINE_DEPTH", depth)
        return planned
    set_parts.per_chunk = per_chunk
    return set_parts


def test_lifecycle_properties_hold_for_stores_in_parts(parts_of):
    planned = parts_of(1)  # stores of 3 and 4 blocks go in parts of one
    run_state_machine_as_test(LifecycleMachine, settings=settings(
        max_examples=30, stateful_step_count=15, deadline=None, suppress_health_check=[HealthCheck.too_slow]))
    assert planned and max(parts_of.per_chunk) >= 3, "the property machine's Stores did not go in parts"


async def test_a_store_in_parts_is_byte_exact_and_one_chain(tmp_path, parts_of):
    planned = parts_of(2)
    cfg = small_config(tmp_path, disk_blocks=0, host_capacity_bytes=16 * BLOCK)
    async with started_cache(cfg) as cache:
        async with engine_on(cache, 32) as eng:
            rs = await eng.store(list(range(10)))
            assert [r.status for r in rs] == [StoreStatus.STORED] * 10
            assert planned == [2] * 5
            rs = await eng.store(list(range(100, 110)))  # evicts 4 of the first Store's blocks, tail first
            assert [r.status for r in rs] == [StoreStatus.STORED] * 10
            order = [e.key.hash for e in cache.tiers.host.entries_oldest_first()]
            assert order[-10:] == [h(i) for i in reversed(range(100, 110))]  # head newest, as one chain
            assert order[:6] == [h(i) for i in reversed(range(6))]  # the first chain's tail went first
            rs = await eng.load(list(range(100, 110)))  # checks the bytes of every LOADED block
            assert [r.status for r in rs] == [LoadStatus.LOADED] * 10
            assert cache.audit() == []


def test_parts_by_bytes_start_small_and_grow_to_the_part_size(monkeypatch):
    monkeypatch.setattr(pipeline_mod, "PIPELINE_BLOCKS", 2048)
    monkeypatch.setattr(pipeline_mod, "PIPELINE_FIRST", 256)
    mib = 1 << 20
    sizes = lambda n, bb, first, grow: [hi - lo for lo, hi in pipeline_mod.parts(n, bb, first, grow)]  # noqa: E731
    # 2 GiB of 2 MiB blocks (one part by count): 256 MiB first, then 8 x that
    assert sizes(1024, 2 * mib, 256 * mib, 8) == [128, 896]
    assert sizes(8192, 256 << 10, 256 * mib, 8) == [1024, 2048, 2048, 2048, 1024]
    assert sizes(32768, 64 << 10, 256 * mib, 8) == [2048] * 16  # the first part is at most PIPELINE_BLOCKS
    assert sizes(100, 2 * mib, 256 * mib, 8) == [100]  # 200 MiB: one part
    assert sizes(1024, 2 * mib, 0, 8) == [1024]  # off: by count
    assert sizes(8192, 4096, 0, 8) == [256, 512, 1024, 2048, 2048, 2048, 256]  # by count, doubling
    for n, bb, first in ((1000, 3 * mib, 7 * mib), (5000, 64 << 10, mib), (3, 4 * mib, mib)):
        ps = pipeline_mod.parts(n, bb, first, 8)
        assert ps[0][0] == 0 and ps[-1][1] == n and all(a[1] == b[0] for a, b in zip(ps, ps[1:]))
        assert pipeline_mod.in_parts(n, bb, first) == (len(ps) > 1)


async def test_a_store_in_byte_sized_parts_is_byte_exact_and_one_chain(tmp_path, parts_of, monkeypatch):
    planned = parts_of(4)
    monkeypatch.setattr(pipeline_mod, "STORE_FIRST_BYTES", 2 * BLOCK)
    monkeypatch.setattr(pipeline_mod, "STORE_GROW", 2)
    cfg = small_config(tmp_path, disk_blocks=0, host_capacity_bytes=16 * BLOCK)
    async with started_cache(cfg) as cache:
        async with engine_on(cache, 32) as eng:
            rs = await eng.store(list(range(10)))  # 10 blocks: by count one part; by bytes 2, 4, 4
            assert [r.status for r in rs] == [StoreStatus.STORED] * 10
            assert planned == [2, 4, 4]
            order = [e.key.hash for e in cache.tiers.host.entries_oldest_first()]
            assert order == [h(i) for i in reversed(range(10))]  # head newest, as one chain
            rs = await eng.load(list(range(10)))  # checks the bytes of every LOADED block
            assert [r.status for r in rs] == [LoadStatus.LOADED] * 10
            assert cache.audit() == []


async def _nothing_left_once_the_copies_end(cache, eng, gate, numbers: list[int]) -> None:
    """After a cancelled Store: open the gate, and once its copies are done nothing of it is left
    (audit clean, no host room taken) and the same blocks store again, byte-exact."""
    gate.open.set()
    await until(lambda: gate.inside == 0, "the copies to end")
    await asyncio.sleep(0.05)
    assert cache.audit() == []
    assert cache.tiers.host.used_bytes == 0
    await restore_works(eng, numbers)


async def _cancel_a_gated_store(cache, eng, gate, copies: int, what: str, after_cancel, in_flight=None) -> None:
    """Store blocks 0-7 with the copies held at the gate, cancel the Store once `copies` copies are
    inside (in_flight() checked just before), check after_cancel(), then that nothing of it is left
    once the copies end (_nothing_left_once_the_copies_end)."""
    try:
        gate.open.clear()
        task = asyncio.ensure_future(eng.store(list(range(8))))
        await until(lambda: gate.inside >= copies, what)
        if in_flight is not None:
            in_flight()
        await cancelled(task)
        after_cancel()
        await _nothing_left_once_the_copies_end(cache, eng, gate, list(range(8)))
    finally:
        gate.open.set()


async def test_a_store_cancelled_in_its_second_part_rolls_back_every_part(tmp_path, parts_of, gated_gather):  # noqa: F811
    parts_of(2, depth=2)
    cfg = small_config(tmp_path, disk_blocks=0, host_capacity_bytes=16 * BLOCK)
    async with started_cache(cfg) as cache:
        async with engine_on(cache, 32) as eng:
            def in_flight() -> None:
                assert cache.audit(idle=False) == []

            def after() -> None:
                assert not [e for e in cache.tiers.index.values() if not e.ready], "half-made entries after the cancel"
            await _cancel_a_gated_store(cache, eng, gated_gather, 2, "two parts' copies in flight", after, in_flight)


async def test_a_part_that_does_not_fit_keeps_the_prefix(tmp_path, parts_of):
    parts_of(2)
    cfg = small_config(tmp_path, disk_blocks=0, host_capacity_bytes=8 * BLOCK)
    async with started_cache(cfg) as cache:
        async with engine_on(cache, 32) as eng:
            assert {r.status for r in await eng.store(list(range(100, 108)))} == {StoreStatus.STORED}
            old = list(cache.tiers.host.entries_oldest_first())
            cache.tiers.life.pin(old[3:])  # 5 of the 8 resident blocks pinned: 3 evictable
            try:
                rs = await eng.store(list(range(8)))
            finally:
                cache.tiers.life.unpin(old[3:])
            assert [r.status for r in rs] == [StoreStatus.STORED] * 3 + [StoreStatus.NOT_STORED] * 5
            assert "room for 3 of 8" in rs[3].message
            rs = await eng.load(list(range(3)))
            assert [r.status for r in rs] == [LoadStatus.LOADED] * 3
            assert cache.audit() == []


async def _hold_a_store_in_its_first_part(cache, eng, gate, numbers):
    """Start eng.store(numbers) in parts of 2 and hold it while its first part copies: its later
    hashes are reserved (RESERVED entries, not ready) but not placed yet."""
    gate.open.clear()
    task = asyncio.ensure_future(eng.store(numbers))
    await until(lambda: gate.inside >= 1, "the first part's copy")
    d = cache.tiers.index.namespace(cache._sessions.get(eng.sid).namespace)
    held = d[h(numbers[-1])]
    assert not held.ready and held.slot < 0, "the last hash should be reserved by the Store, not placed yet"
    return task


async def test_a_hash_held_by_a_store_not_yet_built_waits_for_it(tmp_path, parts_of, gated_gather):  # noqa: F811
    """Scenario: Store A of blocks 0-7 (parts of 2) copies its first part; its hash 7 is reserved,
    its entry not built. Lookup stops before it, Load says MISSING, and Store B of block 7 (another
    session of the namespace) waits for A, then answers ALREADY_STORED; the bytes are A's."""
    if pipeline_mod.STORE_FIRST_BYTES:  # the head-first fixture parameter
        pytest.skip("head-first: a later part's hashes are held only from its plan on, never while an earlier part "
                    "copies (test_a_rest_hash_another_store_took_first_waits_for_it is that case)")
    parts_of(2, depth=1)
    cfg = small_config(tmp_path, disk_blocks=0, host_capacity_bytes=16 * BLOCK)
    async with started_cache(cfg) as cache:
        async with engine_on(cache, 32) as a, engine_on(cache, 32) as b:
            try:
                task = await _hold_a_store_in_its_first_part(cache, a, gated_gather, list(range(8)))
                assert cache.lookup(b.sid, [h(7)]) == []
                assert [r.status for r in await b.load([7])] == [LoadStatus.MISSING]
                other = asyncio.ensure_future(b.store([7]))
                await asyncio.sleep(0.05)
                assert not other.done(), "B answered before A's outcome"
                assert cache.audit(idle=False) == []
                gated_gather.open.set()
                assert [r.status for r in await task] == [StoreStatus.STORED] * 8
                assert [r.status for r in await other] == [StoreStatus.ALREADY_STORED]
                assert [r.status for r in await b.load(list(range(8)))] == [LoadStatus.LOADED] * 8  # bytes checked
                assert cache.audit() == []
            finally:
                gated_gather.open.set()


async def test_a_hash_held_by_a_cancelled_store_is_not_acknowledged(tmp_path, parts_of, gated_gather):  # noqa: F811
    """Scenario: as above, but Store A is cancelled in its first part: B's Store of block 7 answers
    NOT_STORED (never an acknowledgement of bytes nobody kept), nothing of A is left in the index,
    and block 7 stores again."""
    if pipeline_mod.STORE_FIRST_BYTES:  # the head-first fixture parameter
        pytest.skip("head-first: a later part's hashes are held only from its plan on, never while an earlier part "
                    "copies (test_a_rest_hash_another_store_took_first_waits_for_it is that case)")
    parts_of(2, depth=1)
    cfg = small_config(tmp_path, disk_blocks=0, host_capacity_bytes=16 * BLOCK)
    async with started_cache(cfg) as cache:
        async with engine_on(cache, 32) as a, engine_on(cache, 32) as b:
            try:
                task = await _hold_a_store_in_its_first_part(cache, a, gated_gather, list(range(8)))
                other = asyncio.ensure_future(b.store([7]))
                await asyncio.sleep(0.05)
                await cancelled(task)
                rs = await other
                assert [r.status for r in rs] == [StoreStatus.NOT_STORED] and "did not complete" in rs[0].message
                assert not list(cache.tiers.index.values()), "the cancelled Store left entries"
                gated_gather.open.set()
                await until(lambda: gated_gather.inside == 0, "the copy to end")
                await asyncio.sleep(0.05)
                assert cache.audit() == []
                await restore_works(b, [7])
            finally:
                gated_gather.open.set()


async def test_a_hash_twice_in_a_store_in_parts_is_stored_once(tmp_path, parts_of):
    """Scenario: a Store of 0-5 with block 1 again at the end, in parts of 2: the first place
    stores it, the second answers ALREADY_STORED, and every block loads byte-exact."""
    parts_of(2)
    cfg = small_config(tmp_path, disk_blocks=0, host_capacity_bytes=16 * BLOCK)
    async with started_cache(cfg) as cache:
        async with engine_on(cache, 32) as eng:
            rs = await eng.store([0, 1, 2, 3, 4, 5, 1])
            assert [r.status for r in rs] == [StoreStatus.STORED] * 6 + [StoreStatus.ALREADY_STORED]
            assert [r.status for r in await eng.load(list(range(6)))] == [LoadStatus.LOADED] * 6
            assert cache.audit() == []


@pytest.fixture
def head_first(monkeypatch):
    """Parts by bytes with a first part of two blocks (parts of 2): a Store of more than two blocks
    reserves blocks 0-1, starts their copy, then reserves the rest (StorePath._store_head_first).
    Returns the calls of that path and how many blocks each answered."""
    import kvservice.core.store_path as store_path_mod
    monkeypatch.setattr(pipeline_mod, "PIPELINE_BLOCKS", 2)
    monkeypatch.setattr(pipeline_mod, "STORE_FIRST_BYTES", 2 * BLOCK)
    monkeypatch.setattr(pipeline_mod, "STORE_GROW", 2)
    monkeypatch.setattr(pipeline_mod, "ENQUEUE_FIRST", True)
    taken: list[int] = []
    real = store_path_mod.StorePath._store_head_first

    async def spied(self, *args):
        out = await real(self, *args)
        taken.append(out[1])
        return out
    monkeypatch.setattr(store_path_mod.StorePath, "_store_head_first", spied)
    return taken


async def test_a_large_all_new_store_reserves_its_rest_beside_the_first_copy(tmp_path, head_first):
    cfg = small_config(tmp_path, disk_blocks=0, host_capacity_bytes=16 * BLOCK)
    async with started_cache(cfg) as cache:
        async with engine_on(cache, 32) as eng:
            rs = await eng.store(list(range(8)))
            assert [r.status for r in rs] == [StoreStatus.STORED] * 8
            assert head_first == [8], "the whole batch should go in the head-first pass"
            order = [e.key.hash for e in cache.tiers.host.entries_oldest_first()]
            assert order == [h(i) for i in reversed(range(8))]  # head newest, as one chain
            assert [r.status for r in await eng.load(list(range(8)))] == [LoadStatus.LOADED] * 8
            assert cache.audit() == []


async def test_a_hit_in_the_rest_stores_the_rest_apart_with_the_chain_order_kept(tmp_path, head_first):
    """Block 5 is stored; a Store of 0-7 (parts of 2): the part of 4-5 holds a hit, so blocks 4-7 go
    as a Store of their own once 0-3 are in. Answers and LRU order are those of one Store."""
    cfg = small_config(tmp_path, disk_blocks=0, host_capacity_bytes=16 * BLOCK)
    async with started_cache(cfg) as cache:
        async with engine_on(cache, 32) as eng:
            assert [r.status for r in await eng.store([5])] == [StoreStatus.STORED]
            rs = await eng.store(list(range(8)))
            assert [r.status for r in rs] == [StoreStatus.STORED] * 5 + [StoreStatus.ALREADY_STORED] + \
                [StoreStatus.STORED] * 2
            assert head_first == [4]  # parts 0-1 and 2-3 in one pass; 4-5 holds the hit: from 4 apart
            order = [e.key.hash for e in cache.tiers.host.entries_oldest_first()]
            assert order == [h(i) for i in (5, 7, 6, 4, 3, 2, 1, 0)]  # the hit first, then the chain head newest
            assert [r.status for r in await eng.load(list(range(8)))] == [LoadStatus.LOADED] * 8
            assert cache.audit() == []


async def test_a_hit_in_the_head_goes_the_general_way_from_its_reservation(tmp_path, head_first):
    cfg = small_config(tmp_path, disk_blocks=0, host_capacity_bytes=16 * BLOCK)
    async with started_cache(cfg) as cache:
        async with engine_on(cache, 32) as eng:
            assert [r.status for r in await eng.store([1])] == [StoreStatus.STORED]
            rs = await eng.store([0, 1, 2, 3, 4, 0])
            assert [r.status for r in rs] == [StoreStatus.STORED, StoreStatus.ALREADY_STORED] + \
                [StoreStatus.STORED] * 3 + [StoreStatus.ALREADY_STORED]
            assert head_first == [0]
            assert [r.status for r in await eng.load([0, 1, 2, 3, 4])] == [LoadStatus.LOADED] * 5
            assert cache.audit() == []


async def test_a_rest_hash_another_store_took_first_waits_for_it(tmp_path, head_first, gated_gather):  # noqa: F811
    """Store A of 0-7 reserves its head and waits for its copy to be queued; meanwhile Store B
    (another session) takes block 6. A's part of 6-7 is then not all new: it goes apart, and its
    block 6 waits for B's outcome: ALREADY_STORED once B committed. Every block loads byte-exact."""
    cfg = small_config(tmp_path, disk_blocks=0, host_capacity_bytes=16 * BLOCK)
    async with started_cache(cfg) as cache:
        async with engine_on(cache, 32) as a, engine_on(cache, 32) as b:
            try:
                gated_gather.open.clear()
                ta = asyncio.ensure_future(a.store(list(range(8))))
                tb = asyncio.ensure_future(b.store([6]))
                await until(lambda: gated_gather.inside >= 2, "both copies")
                assert cache.audit(idle=False) == []
                gated_gather.open.set()
                ra, rb = await ta, await tb
                assert [r.status for r in rb] == [StoreStatus.STORED]
                assert [r.status for r in ra] == [StoreStatus.STORED] * 6 + [StoreStatus.ALREADY_STORED] + \
                    [StoreStatus.STORED]
                assert head_first == [6]  # the part of 6-7 holds B's block: from 6 apart
                assert [r.status for r in await a.load(list(range(8)))] == [LoadStatus.LOADED] * 8
                assert cache.audit() == []
            finally:
                gated_gather.open.set()


async def test_a_head_first_store_cancelled_before_its_rest_leaves_nothing(tmp_path, head_first, gated_gather):  # noqa: F811
    """Cancelled while its first part copies (the rest reserved or not): no entry, room or pin
    is left once the copy thread is done, and the same blocks store again."""
    cfg = small_config(tmp_path, disk_blocks=0, host_capacity_bytes=16 * BLOCK)
    async with started_cache(cfg) as cache:
        async with engine_on(cache, 32) as eng:
            def after() -> None:
                assert not list(cache.tiers.index.values()), "the cancelled Store left entries"
            await _cancel_a_gated_store(cache, eng, gated_gather, 1, "the first part's copy", after)
