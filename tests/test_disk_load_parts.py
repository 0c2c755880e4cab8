"""A large Load from disk is read in parts issued at once, each copied to the engine as it lands
(Tiers.read_batch's on_part; BlockCache._collect_bytes copies the part's host slots while the rest
is still read). Core-level: the cache driven directly on real segment files, the part size made
small (READ_PART_BYTES) so a 16-block Load is four parts. Faults are injected at the segment I/O
boundary (os_preadv) where a real disk cannot be made to fail one request."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import threading

from kvservice.core import read_jobs as read_jobs_mod
from kvservice.core.types import LoadStatus, Tier
from kvservice.disk import segment
from tests.corekit import BLOCK, Engine, Pool, h, small_config, started_cache

N = 16  # blocks of the measured Load; the host tier holds as many


async def _settled(cache) -> None:
    while cache._background:
        await asyncio.gather(*list(cache._background), return_exceptions=True)
    await cache.tiers.drain()


async def _on_disk_with_clean_room(cache, eng: Engine) -> None:
    """Blocks 16..31 on disk only, the host tier full of blocks 0..15 that have a disk copy (so a
    Load of 16..31 lands wholly in host slots: the parts path)."""
    await eng.store(list(range(0, N)))
    await eng.store(list(range(N, 2 * N)))  # 0..15 spill
    await _settled(cache)
    res = await eng.load(list(range(0, N)))  # from disk; onboarded after the reply, evicting 16..31 (spilled)
    assert all(r.status == LoadStatus.LOADED for r in res)
    await _settled(cache)
    assert all(_get(cache, i).slot < 0 for i in range(N, 2 * N))


def _get(cache, i: int):
    """The index entry of block i (the tests' one namespace)."""
    hsh = h(i)
    found = [e for e in cache.tiers.index.values() if e.key.hash == hsh]
    assert len(found) == 1
    return found[0]


@contextlib.asynccontextmanager
async def _parts_setup(tmp_path, monkeypatch):
    """A cache whose 16-block Loads are read in four parts, with blocks 16..31 on disk only and a
    clean host tier to land them in: (cache, engine)."""
    monkeypatch.setattr(read_jobs_mod, "READ_PART_BYTES", 2 * BLOCK)
    cfg = small_config(tmp_path, disk_blocks=4 * N, host_capacity_bytes=N * BLOCK)
    async with started_cache(cfg) as cache:
        pool = Pool(num_blocks=4 * N)
        try:
            eng = Engine(cache, pool)
            await _on_disk_with_clean_room(cache, eng)
            yield cache, eng
        finally:
            pool.close()


def _reads_block(cache, i: int):
    """A predicate on (fd, bufs, offset) of segment.os_preadv: the request reads block i's slot."""
    e = _get(cache, i)
    seg_id, slot = e.disk_loc >> 32, e.disk_loc & 0xFFFFFFFF
    f = cache.tiers.segments.store._files[seg_id]
    fds, at = (f.dfd, f.fd), f.offset(slot)
    return lambda fd, bufs, off: fd in fds and off <= at < off + sum(b.nbytes for b in bufs)


def _count_reads(cache, monkeypatch) -> list[int]:
    calls: list[int] = []
    real = cache.tiers.segments.read_many

    def counted(locs, outs, fanout=0):
        calls.append(len(locs))
        return real(locs, outs, fanout)

    monkeypatch.setattr(cache.tiers.segments, "read_many", counted)
    return calls


async def test_a_large_disk_load_is_read_in_parts_each_copied_as_it_lands(tmp_path, monkeypatch):
    """Scenario: a 16-block Load of disk blocks with room in the host tier: four reads of four
    blocks are issued at once, every block is LOADED from the disk tier byte-exact (Engine.load
    compares), each onboarded once, and nothing is left pinned or half-made."""
    async with _parts_setup(tmp_path, monkeypatch) as (cache, eng):
        calls = _count_reads(cache, monkeypatch)
        onboards = cache.stats.total.disk_onboards
        res = await eng.load(list(range(N, 2 * N)))
        assert [r.status for r in res] == [LoadStatus.LOADED] * N
        assert [r.tier for r in res] == [Tier.DISK] * N
        assert calls == [N // 4] * 4
        await _settled(cache)
        assert all(_get(cache, i).slot >= 0 for i in range(N, 2 * N))  # onboarded: the read's host slots
        assert cache.stats.total.disk_onboards == onboards + N
        assert cache.audit() == []
        res = await eng.load(list(range(N, 2 * N)))  # host hits now, the same bytes
        assert [r.tier for r in res] == [Tier.HOST] * N


async def test_one_failing_part_fails_only_its_blocks(tmp_path, monkeypatch):
    """Scenario: EIO on the request of the part holding the Load's first block: that block is
    FAILED with an I/O message and discarded; the other parts' blocks are LOADED byte-exact;
    nothing pinned or half-made."""
    async with _parts_setup(tmp_path, monkeypatch) as (cache, eng):
        reads_first = _reads_block(cache, N)
        real = segment.os_preadv

        def eio(fd, bufs, off):
            if reads_first(fd, bufs, off):
                raise OSError(errno.EIO, "injected EIO")
            return real(fd, bufs, off)

        monkeypatch.setattr(segment, "os_preadv", eio)
        res = await eng.load(list(range(N, 2 * N)))
        monkeypatch.setattr(segment, "os_preadv", real)
        assert res[0].status == LoadStatus.FAILED and "injected EIO" in res[0].message, res[0]
        failed = [i for i in range(N) if res[i].status != LoadStatus.LOADED]
        assert failed and max(failed) < N // 4  # only the first part's blocks
        assert all(res[i].status == LoadStatus.LOADED for i in range(N // 4, N))
        await _settled(cache)
        assert cache.audit() == []


async def test_a_load_cancelled_while_its_parts_land_leaves_nothing_pinned(tmp_path, monkeypatch):
    """Scenario: the Load is cancelled after its first part landed and while the last part's
    read is held at the I/O boundary; once the read is let go, nothing is pinned or half-made
    and the blocks load again byte-exact."""
    gate, entered = threading.Event(), threading.Event()
    try:
        async with _parts_setup(tmp_path, monkeypatch) as (cache, eng):
            reads_last = _reads_block(cache, 2 * N - 1)
            real = segment.os_preadv

            def held(fd, bufs, off):
                if reads_last(fd, bufs, off):
                    entered.set()
                    gate.wait(10)
                return real(fd, bufs, off)

            monkeypatch.setattr(segment, "os_preadv", held)
            task = asyncio.ensure_future(eng.load(list(range(N, 2 * N))))
            while not entered.is_set():
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.05)  # the other parts land and are copied meanwhile
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            gate.set()
            monkeypatch.setattr(segment, "os_preadv", real)
            await asyncio.sleep(0.05)
            await _settled(cache)
            assert cache.audit() == []
            res = await eng.load(list(range(N, 2 * N)))
            assert all(r.status == LoadStatus.LOADED for r in res)
    finally:
        gate.set()
