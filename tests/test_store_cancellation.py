"""A Store cancelled at any await point rolls back what it reserved (DESIGN §5, "Lifecycle").

Core-level: the cache driven directly, with the one slow thing of each await point made slow at
its boundary (the engine pool's gather, the disk writer, a header rewrite) so the cancel lands
exactly there; plus a sweep that cancels after every possible number of event-loop steps.
After each: nothing half-made, nothing pinned, each tier's room equals its blocks' bytes
(BlockCache.audit), and storing the same hashes again stores them byte-exact.

Daemon-level: a real daemon whose one disk writer is throttled, so a Store that evicts waits for
the write queue; the engine storing is SIGKILLed there, or its client's deadline runs out there.
Afterwards Admin.Stats shows the host tier's used bytes equal to the bytes of its blocks,
nothing pinned, and another engine's Stores are all stored.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvservice.memory.engine_memory import ShmEngineMemory
from kvservice.disk.io_backend import PosixIO
from kvservice.core.types import LoadStatus, StoreStatus, Tier
from tests.corekit import Engine, Pool, small_config, started_cache
from tests.daemon_kit import Daemon
from tests.engine_kit import EngineProc
from harness.wait import wait_until

STORED = 1

class Gate:
    """A threading gate a copy or an I/O call waits at; `entered` says one is waiting."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.entered = threading.Event()
        self.inside = 0

    def wait(self) -> None:
        self.inside += 1
        self.entered.set()
        self.open.wait(10)
        self.inside -= 1


class GatedIO(PosixIO):
    """Disk writes (block files, header rewrites) wait at a gate."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = Gate()
        self.writes.open.set()

    def write_file(self, path, chunks) -> None:
        self.writes.wait()
        super().write_file(path, chunks)

    def pwrite(self, path, offset, data) -> None:
        self.writes.wait()
        super().pwrite(path, offset, data)


@pytest.fixture
def gated_gather(monkeypatch):
    """Engine-pool gathers (the Store's copy) wait at a gate, in their copy thread."""
    gate = Gate()
    gate.open.set()
    real = ShmEngineMemory.gather_into

    def slow(self, block_ids, arena, offsets, enqueued=None):
        if enqueued is not None:  # as a device copy: queued at once, its end waits (KVTUNE_COPY_ENQUEUE_FIRST)
            enqueued()
        gate.wait()
        return real(self, block_ids, arena, offsets)

    monkeypatch.setattr(ShmEngineMemory, "gather_into", slow)
    return gate


async def until(predicate, what: str, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


async def cancelled(task: asyncio.Task) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def cancel_after_steps(aw, steps: int) -> bool:
    """Run aw as a task for `steps` event-loop steps, then cancel it and wait for it; returns
    whether it had finished before the cancel (then its outcome stands)."""
    task = asyncio.ensure_future(aw)
    for _ in range(steps):
        await asyncio.sleep(0)
    finished = task.done()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return finished


async def restore_works(eng: Engine, numbers: list[int]) -> None:
    rs = await eng.store(numbers)
    assert [r.status for r in rs] == [StoreStatus.STORED] * len(numbers), [r.message for r in rs]
    rs = await eng.load(numbers)  # Engine.load checks the bytes of every LOADED block
    assert [r.status for r in rs] == [LoadStatus.LOADED] * len(numbers)


async def test_a_store_cancelled_during_its_copy_leaves_no_room_entry_or_pin(tmp_path, gated_gather):
    """Scenario: a Store of blocks 0-1 is cancelled while its gather is copying out of the pool.
    Once the copy thread is done nothing of the Store is left (no entry, no room, no pin), the
    hashes are not stored, and storing them again works byte-exact."""
    async with started_cache(small_config(tmp_path)) as cache:
        pool = Pool()
        eng = Engine(cache, pool)
        gated_gather.open.clear()
        task = asyncio.ensure_future(eng.store([0, 1]))
        await until(gated_gather.entered.is_set, "the gather to start")
        await cancelled(task)
        gated_gather.open.set()
        await until(lambda: gated_gather.inside == 0, "the copy thread to finish")
        assert cache.audit() == []
        assert cache.lookup(eng.sid, [eng_hash(0)]) == []
        assert {t["name"]: t["used_bytes"] for t in cache.tier_stats()}["host"] == 0
        await restore_works(eng, [0, 1])
        assert cache.audit() == []
        pool.close()


async def test_a_store_of_blocks_another_store_is_copying_answers_by_that_stores_outcome(tmp_path, monkeypatch):
    """Scenario: Store A of blocks 0-1 is copying them in (its gather held at a gate) when Store B
    of blocks 0-2, from another engine of the namespace, arrives. B stores 2 and waits for A's
    outcome for 0-1. First A commits: B answers ALREADY_STORED for 0-1, retained as B asked.
    Then, the same with A cancelled during its copy: B answers NOT_STORED for 0-1 (never an
    acknowledgement of bytes nobody kept) and 0-1 store again byte-exact."""
    gate = Gate()
    real = ShmEngineMemory.gather_into
    async with started_cache(small_config(tmp_path, host_capacity_bytes=8 * 4096)) as cache:
        pool_a, pool_b = Pool(), Pool()
        a, b = Engine(cache, pool_a), Engine(cache, pool_b)
        mem_a = cache._sessions.get(a.sid).memory

        def gather_a_waits(self, block_ids, arena, offsets, enqueued=None):
            if enqueued is not None:  # as slow() in gated_gather
                enqueued()
            if self is mem_a:
                gate.wait()
            return real(self, block_ids, arena, offsets)

        monkeypatch.setattr(ShmEngineMemory, "gather_into", gather_a_waits)
        for first, cancel_a in (([0, 1], False), ([10, 11], True)):
            gate.open.clear()
            gate.entered.clear()
            task_a = asyncio.ensure_future(a.store(first))
            await until(gate.entered.is_set, "A's gather to start")
            task_b = asyncio.ensure_future(b.store(first + [first[1] + 1], ttl=60.0))
            await asyncio.sleep(0.05)
            assert not task_b.done(), "B answers 0-1 once A's outcome is known"
            if cancel_a:
                await cancelled(task_a)
                gate.open.set()
            else:
                gate.open.set()
                assert [r.status for r in await task_a] == [StoreStatus.STORED] * 2
            rs = await task_b
            want = StoreStatus.NOT_STORED if cancel_a else StoreStatus.ALREADY_STORED
            assert [r.status for r in rs] == [want, want, StoreStatus.STORED], [r.message for r in rs]
            if cancel_a:
                assert "did not complete" in rs[0].message
            else:
                assert rs[0].deadline > 0 and rs[1].deadline > 0
            # A's slots go back once its copy thread is done (a done callback on the loop)
            await until(lambda: gate.inside == 0 and not cache.tiers.life.aborted, "A's copy to end")
            assert cache.audit() == []
            if cancel_a:
                await restore_works(a, first)
        assert cache.audit() == []
        pool_a.close()
        pool_b.close()


async def test_a_store_waiting_for_another_stores_copy_answers_not_stored_if_that_block_is_evicted_meanwhile(
        tmp_path, monkeypatch):
    """Scenario: Store B of blocks 0-1 (retain 60 s) waits for Store A, which is copying them in.
    A commits, and before B wakes up the blocks are evicted (an admin Evict here; any eviction in
    that window does the same; no disk tier, so nothing of them is left). B must not answer
    ALREADY_STORED with a retention deadline for bytes nobody keeps: NOT_STORED, store again.
    No retained bytes are counted for them, and 0-1 store again byte-exact."""
    gate = Gate()
    real = ShmEngineMemory.gather_into
    async with started_cache(small_config(tmp_path, disk_blocks=0, host_capacity_bytes=8 * 4096)) as cache:
        pool_a, pool_b = Pool(), Pool()
        a, b = Engine(cache, pool_a), Engine(cache, pool_b)
        mem_a = cache._sessions.get(a.sid).memory
        life = cache.tiers.life
        b_may_go = asyncio.get_running_loop().create_future()
        outcome = life.outcome
        monkeypatch.setattr(life, "outcome", lambda entries: [*outcome(entries), b_may_go])

        def gather_a_waits(self, block_ids, arena, offsets, enqueued=None):
            if enqueued is not None:
                enqueued()
            if self is mem_a:
                gate.wait()
            return real(self, block_ids, arena, offsets)

        monkeypatch.setattr(ShmEngineMemory, "gather_into", gather_a_waits)
        gate.open.clear()
        task_a = asyncio.ensure_future(a.store([0, 1]))
        await until(gate.entered.is_set, "A's gather to start")
        task_b = asyncio.ensure_future(b.store([0, 1], ttl=60.0))
        await asyncio.sleep(0.05)
        assert not task_b.done(), "B answers 0-1 once A's outcome is known"
        gate.open.set()
        assert [r.status for r in await task_a] == [StoreStatus.STORED] * 2
        assert await cache.evict(all=True) == 2
        b_may_go.set_result(None)
        rs = await task_b
        assert [r.status for r in rs] == [StoreStatus.NOT_STORED] * 2, [r.message for r in rs]
        assert all("evicted before this Store could answer" in r.message for r in rs)
        assert all(r.deadline == 0 for r in rs)
        assert cache.audit() == []
        ns = {n["namespace_id"]: n for n in cache.namespace_stats()}
        assert all(n["retained_bytes"] == 0 for n in ns.values())
        await restore_works(b, [0, 1])
        assert cache.audit() == []
        pool_a.close()
        pool_b.close()


async def test_a_store_cancelled_while_waiting_for_the_write_queue_rolls_back_and_spills_go_on(tmp_path):
    """Scenario: the host tier (4 blocks) is full of blocks 0-3; the one writer is stuck in a
    slow disk write and the queue (depth 1) is full, so a Store of 4-6, which evicts 1-3 (a
    chain's tail goes first), waits to queue its third spill. It is cancelled there. Its room and
    entries are rolled back at once; the spills it started are not abandoned: once the disk
    moves, 1-3 land on disk and
    load byte-exact, and 4-6 store again."""
    io = GatedIO()  # gates the BlockIO backend: the one-file-per-block format's writes
    cfg = small_config(tmp_path, write_queue_depth=1, writer_threads=1, disk_format="files")
    async with started_cache(cfg, io=io) as cache:
        pool = Pool()
        eng = Engine(cache, pool)
        assert [r.status for r in await eng.store([0, 1, 2, 3])] == [StoreStatus.STORED] * 4
        io.writes.open.clear()
        task = asyncio.ensure_future(eng.store([4, 5, 6]))
        await until(io.writes.entered.is_set, "the writer to be stuck")
        await until(lambda: cache.tiers.writes.depth >= 2, "the queue to fill")
        await asyncio.sleep(0.05)
        assert not task.done(), "the Store must be waiting for the write queue"
        await cancelled(task)
        t = cache.tiers
        assert not [e for e in t.index.values() if not e.ready], "half-made entries after the cancel"
        assert t.host.used_bytes == sum(e.size for e in t.index.values() if e.host_buf is not None)
        io.writes.open.set()
        await t.drain()
        assert cache.audit() == []
        # the chain's tail goes first: 1-3 were the victims, 0 stayed in host memory
        assert [cache.lookup(eng.sid, [eng_hash(i)]) for i in (0, 1, 2, 3)] == [[Tier.HOST]] + [[Tier.DISK]] * 3
        assert [r.status for r in await eng.load([0, 1, 2, 3])] == [LoadStatus.LOADED] * 4
        await restore_works(eng, [4, 5, 6])
        await t.drain()
        assert cache.audit() == []
        pool.close()


async def test_a_store_cancelled_during_a_deadline_rewrite_keeps_what_it_committed(tmp_path):
    """Scenario: block 0 is on disk; a Store of [0, 9] with a TTL first retains the hit 0, which
    rewrites its disk header with the new deadline, and is cancelled during that write, before
    9 was copied. 9 is not stored and nothing of it is left; 0 still loads byte-exact; 9 stores
    again."""
    io = GatedIO()  # gates the BlockIO backend: the one-file-per-block format's header rewrites
    async with started_cache(small_config(tmp_path, disk_format="files"), io=io) as cache:
        pool = Pool()
        eng = Engine(cache, pool)
        await eng.store([0])
        await eng.store([1, 2, 3, 4])  # pushes 0 to disk
        await cache.tiers.drain()
        assert cache.lookup(eng.sid, [eng_hash(0)]) == [Tier.DISK]
        io.writes.entered.clear()
        io.writes.open.clear()
        task = asyncio.ensure_future(eng.store([0, 9], ttl=60.0))
        await until(io.writes.entered.is_set, "the header rewrite to start")
        await cancelled(task)
        io.writes.open.set()
        await cache.tiers.drain()
        assert cache.audit() == []
        assert cache.lookup(eng.sid, [eng_hash(9)]) == []
        assert [r.status for r in await eng.load([0])] == [LoadStatus.LOADED]
        await restore_works(eng, [9])
        pool.close()


@pytest.mark.parametrize("policy", ["wait", "shed"])
async def test_cancelling_a_store_after_any_number_of_loop_steps_leaves_nothing_half_made(tmp_path, policy):
    """Scenario: a Store of four new blocks into a full host tier (so it evicts, spills and
    copies) is cancelled after k event-loop steps, for every k until one finishes uncancelled.
    After each: audit is clean once the copy threads and spills are done, and the four blocks
    store again byte-exact (or are stored already, when the cancel came after the commit)."""
    cfg = small_config(tmp_path, write_queue_depth=1, writer_threads=1, write_queue_policy=policy)
    async with started_cache(cfg) as cache:
        pool = Pool(num_blocks=16)
        eng = Engine(cache, pool)
        base = 0
        # every step count up to 64 (each await point of the store path), then doubling: the copy
        # and the spills run in threads, so how many loop steps the Store needs depends on the machine
        for k in [*range(64), *(64 << i for i in range(10))]:
            await eng.store([1000 + base + j for j in range(4)])  # host full of other blocks
            batch = [base + j for j in range(4)]
            finished = await cancel_after_steps(eng.store(batch), k)
            await cache.tiers.drain()
            await asyncio.get_running_loop().run_in_executor(cache._copy_pool, lambda: None)
            await until(lambda: cache.audit() == [], f"a clean audit after a cancel at step {k}: {cache.audit()}")
            rs = await eng.store(batch)
            assert all(r.status in (StoreStatus.STORED, StoreStatus.ALREADY_STORED) for r in rs), [r.message for r in rs]
            rs = await eng.load(batch)
            assert [r.status for r in rs] == [LoadStatus.LOADED] * 4
            await cache.tiers.drain()
            assert cache.audit() == []
            base += 4
            if finished:
                break
        else:
            raise AssertionError("the Store never finished within 32768 loop steps")
        pool.close()


def eng_hash(i: int) -> bytes:
    from tests.corekit import h

    return h(i)


def wait_for(predicate, what: str, timeout: float = 10.0):
    return wait_until(predicate, timeout, what)


def host_row(d: Daemon):
    return {t.name: t for t in d.stats().tiers}["host"]


def slow_disk_daemon() -> Daemon:
    """16 host blocks; retained blocks spill through one writer at 20 kB/s (0.2 s a block), queue
    depth 1; best-effort victims are dropped, so other engines' Stores never wait for the disk."""
    return Daemon(host_capacity="64KiB", disk_capacity="1MiB",
                  extra=["--write-queue-depth", "1", "--writer-threads", "1", "--admission-gate", "retained-only",
                         "--disk-write-bytes-per-second", "20000"])


def assert_nothing_left_and_others_store(d: Daemon, other: EngineProc, first: int) -> None:
    """The cancelled Store of 16-31 left nothing: not stored, no room, no pin; then `other`
    stores 32 new blocks and the cancelled hashes themselves."""
    host = wait_for(lambda: (r := host_row(d)).pinned_blocks == 0 and r, "pins to be released")
    assert host.used_bytes == host.blocks * 4096, f"host accounts {host.used_bytes} bytes for {host.blocks} blocks"
    assert other.call("lookup", numbers=list(range(16, 32)))["prefix"] == 0, "the cancelled Store was not rolled back"
    for lo in range(first, first + 32, 16):
        r = other.call("store", numbers=list(range(lo, lo + 16)))
        assert r["status"] == [STORED] * 16, r["message"]
    assert d.stats().counters.spills < 32, "the other engine's stores must not have waited for A's spills"
    r = other.call("load", numbers=list(range(first + 16, first + 32)))
    assert all(r["exact"])
    host = host_row(d)
    assert host.used_bytes == host.blocks * 4096
    s = d.settle(30)  # the spills finish
    assert s.write_queue_depth == 0 and s.writes_in_progress == 0
    assert other.call("store", numbers=list(range(16, 32)))["status"] == [STORED] * 16
    host = host_row(d)
    assert host.used_bytes == host.blocks * 4096 and host.pinned_blocks == 0


def test_an_engine_killed_while_its_store_waits_for_the_disk_leaks_nothing():
    """Scenario: engine A fills the 16-block host tier with retained blocks 0-15, then stores
    16-31, which must spill 0-15 through a slow disk; while that Store waits for the write
    queue, A is SIGKILLed. Its Store is rolled back: the host tier's used bytes equal the bytes
    of the blocks it holds, nothing is pinned, 16-31 are not stored, and engine B stores 32 new
    blocks, every one STORED, loads them byte-exact, and stores 16-31 itself. A's spills go on:
    blocks 0-15 reach the disk."""
    d = slow_disk_daemon()
    try:
        d.start()
        with EngineProc(d.target) as b:
            a = EngineProc(d.target)
            try:
                assert a.call("store", numbers=list(range(16)), ttl=600)["status"] == [STORED] * 16
                a.send("store", numbers=list(range(16, 32)))
                wait_for(lambda: (s := d.stats()).write_queue_depth + s.writes_in_progress >= 2,
                         "A's Store to wait for the write queue")
                a.kill9()
            finally:
                a.close()
            assert_nothing_left_and_others_store(d, b, 100)
            assert d.stats().counters.spills == 16
            r = b.call("load", numbers=list(range(16)))
            assert all(r["exact"]) and set(r["tier"]) == {3}  # DISK
        assert d.proc.poll() is None and "Traceback" not in d.log()
    finally:
        d.close()


def test_a_store_whose_deadline_runs_out_while_it_waits_for_the_disk_leaks_nothing():
    """Scenario: as above, but engine A stays alive and its client gives each call 0.5 s: the
    Store of 16-31 runs past its deadline while it waits for the write queue, and the daemon
    cancels it there. Same checks."""
    from engine_client import KVClient, Namespace, ShmKVPool
    from tests.corekit import content, h

    d = slow_disk_daemon()
    try:
        d.start()
        with EngineProc(d.target) as b:
            pool = ShmKVPool(32, 4096)
            client = KVClient(d.target, Namespace("m", "float32", 16, "block-contiguous", 0, 1, ""), pool,
                              client_name="deadline test", timeout=0.5)
            try:
                client.connect(required=True)
                for i in range(32):
                    pool.write_block(i, content(i))
                rs = client.store([h(i) for i in range(16)], list(range(16)), 600)
                assert [r.status for r in rs] == [STORED] * 16
                rs = client.store([h(i) for i in range(16, 32)], list(range(16, 32)))
                assert STORED not in [r.status for r in rs]  # ran out of time; the client answers for it
                wait_for(lambda: d.stats().counters.spills >= 4, "some of A's spills to finish")
                assert_nothing_left_and_others_store(d, b, 200)
            finally:
                client.close()
                pool.close()
                pool.unlink()
        assert d.proc.poll() is None and "Traceback" not in d.log()
    finally:
        d.close()
