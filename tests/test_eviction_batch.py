"""The batch eviction plan (tiers.Tiers.make_host_room's fast path, one block size in the arena)
chooses exactly the victims of the one-by-one candidate walk it replaces: random pins, prefetch
leases (running and ended), retained blocks and, under protect-unexpired, a disk room that admits
only some of the retained ones."""

from __future__ import annotations

import itertools
import random

import pytest

from kvservice.placement.eviction import DiskRoom
from tests.corekit import BLOCK, Engine, Pool, small_config, started_cache

HOST_BLOCKS = 48


@pytest.mark.parametrize("protect", [False, True])
async def test_batch_victims_are_the_first_candidates_of_the_walk(tmp_path, protect):
    cfg = small_config(tmp_path, disk_blocks=8, host_capacity_bytes=HOST_BLOCKS * BLOCK, protect_unexpired=protect)
    async with started_cache(cfg) as cache:
        pool = Pool(num_blocks=HOST_BLOCKS)
        try:
            eng = Engine(cache, pool)
            for lo in range(0, HOST_BLOCKS, 16):
                res = await eng.store(list(range(lo, lo + 16)), ttl=0.0 if lo else 60.0)  # the first 16 retained
                assert {r.status for r in res} == {1}
            t = cache.tiers
            assert t.host.arena.holds_only(BLOCK)
            now = cache.clock.now()
            rng = random.Random(3)
            lru = list(t.host.entries_oldest_first())
            assert len(lru) == HOST_BLOCKS
            held_back = 0  # candidates the disk room kept out (protect-unexpired only)
            for trial in range(40):
                for e in lru:  # a fresh mix of holds each trial
                    e.pins = 1 if rng.random() < 0.2 else 0
                    e.lease_until = rng.choice((0.0, now - 1.0, now + 5.0)) if rng.random() < 0.3 else 0.0
                room = rng.randrange(0, 20) * BLOCK  # what the disk admits of the retained blocks
                t._disk_room = lambda now, room=room: DiskRoom(room, iter(()))
                want = rng.randrange(0, HOST_BLOCKS + 4)
                walked = list(itertools.islice(t._host_candidates(now), want))
                assert t._host_victims(now, want) == walked, (trial, want)
                free = [e for e in lru if not e.pins and e.lease_until <= now]
                held_back += min(want, len(free)) - len(walked)
            assert (held_back > 0) == protect  # the protect branch was exercised, and only there
            for e in lru:
                e.pins, e.lease_until = 0, 0.0
            assert cache.audit() == []
        finally:
            await cache.close_session(eng.sid)
            pool.close()


async def test_young_collections_wait_for_twice_the_largest_batch(tmp_path):
    """A Store builds an entry per new block before the batch it evicts is freed: the daemon's young
    GC threshold is at least twice the largest batch, so a steady stream of the largest Stores does
    not walk its new entries in young collections that free nothing (cache._tune_gc)."""
    import gc

    before = gc.get_threshold()
    try:
        async with started_cache(small_config(tmp_path, max_batch_blocks=100_000)):
            assert gc.get_threshold()[0] >= 2 * 100_000
    finally:
        gc.set_threshold(*before)
