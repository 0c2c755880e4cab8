"""Prefetch leases cannot starve other tenants (DESIGN §5, "Leases ... are bounded per session").

A session's prefetch leases hold at most prefetch_share of the host tier, and the leases of all
sessions together prefetch_total_share (so many sessions cannot pin it all); a prefetch beyond that
is refused with PREFETCH_FAILED and a reason. A block already in host memory is leased once: a
prefetch while its lease runs does not renew it, so repeated prefetches cannot pin it for ever.
"""

from __future__ import annotations

from kvservice.api import convert
from kvservice.core.types import PrefetchStatus, StoreStatus
from tests.corekit import BLOCK, Engine, Pool, h, ns_spec, small_config, started_cache
from tests.daemon_kit import Daemon
from tests.engine_kit import EngineProc

STORED, FAILED = 1, 4


async def test_one_session_prefetching_more_than_the_host_tier_holds_leaves_room_for_others(tmp_path):
    """Scenario: the host tier holds 16 blocks; session A has blocks 0-47 stored (most on disk)
    and prefetches all 48. Its leases stop at a quarter of the host tier (4 blocks); the rest is
    PREFETCH_FAILED, saying it hit the session's cap. Session B, in another namespace, then
    stores 24 blocks in batches of 8: every one is STORED; the audit is clean."""
    cfg = small_config(tmp_path, host_capacity_bytes=16 * BLOCK, disk_blocks=64)
    async with started_cache(cfg) as cache:
        pool_a, pool_b = Pool(num_blocks=64), Pool(num_blocks=64)
        a = Engine(cache, pool_a)
        for lo in range(0, 48, 16):
            assert all(r.status == StoreStatus.STORED for r in await a.store(list(range(lo, lo + 16))))
        await cache.tiers.drain()
        out = await cache.prefetch(a.sid, [h(i) for i in range(48)])
        leased = [r for r in out if r.status in (PrefetchStatus.STAGED, PrefetchStatus.ALREADY_IN_HOST)]
        refused = [r for r in out if r.status == PrefetchStatus.FAILED]
        assert sum(1 for r in out if r.status == PrefetchStatus.STAGED) <= 4
        assert len(leased) >= 4 and len(leased) + len(refused) == 48
        assert refused and all("cap" in r.message and "prefetch_share 0.25" in r.message for r in refused)
        assert sum(e.size for e in cache.tiers.index.values() if e.lease_until > cache.clock.now()) <= 4 * BLOCK

        b = Engine(cache, pool_b, ns_spec(model="other"))
        for lo in (100, 108, 116):  # batches of half the host tier, while A's leases run
            rs = await b.store(list(range(lo, lo + 8)))
            assert [r.status for r in rs] == [StoreStatus.STORED] * 8, [r.message for r in rs]
        await cache.tiers.drain()
        assert cache.audit() == []

        reply = convert.prefetch_reply(out)  # the reason travels beside the status
        assert {m.index for m in reply.messages} == {i for i, r in enumerate(out) if r.status == PrefetchStatus.FAILED}
        pool_a.close()
        pool_b.close()


async def test_many_sessions_prefetching_together_leave_room_for_others(tmp_path):
    """Scenario: the host tier holds 16 blocks; four sessions in four namespaces each have 16
    blocks stored (most on disk) and each prefetches all 16. Each session's cap (a quarter, 4
    blocks) would let the four pin the whole tier between them; all leases together stop at
    half of it (8 blocks), and the sessions refused for that are told it is the total cap. A
    fifth namespace then stores 8 blocks (half the tier): every one is STORED; the audit is clean."""
    cfg = small_config(tmp_path, host_capacity_bytes=16 * BLOCK, disk_blocks=96)
    async with started_cache(cfg) as cache:
        pools = [Pool(num_blocks=32) for _ in range(5)]
        engines = [Engine(cache, p, ns_spec(model=f"m{k}")) for k, p in enumerate(pools)]
        for eng in engines[:4]:
            assert all(r.status == StoreStatus.STORED for r in await eng.store(list(range(16))))
        await cache.tiers.drain()
        outs = [await cache.prefetch(eng.sid, [h(i) for i in range(16)]) for eng in engines[:4]]
        now = cache.clock.now()
        assert sum(e.size for e in cache.tiers.index.values() if e.lease_until > now) <= 8 * BLOCK
        refused = [r for out in outs for r in out if r.status == PrefetchStatus.FAILED]
        assert any("all sessions" in r.message and "prefetch_total_share 0.5" in r.message for r in refused)
        assert all(len([r for r in out if r.status == PrefetchStatus.FAILED]) >= 12 for out in outs)

        rs = await engines[4].store(list(range(100, 108)))
        assert [r.status for r in rs] == [StoreStatus.STORED] * 8, [r.message for r in rs]
        await cache.tiers.drain()
        assert cache.audit() == []
        for p in pools:
            p.close()


async def test_prefetching_a_host_block_again_does_not_renew_its_lease(tmp_path):
    """Scenario: blocks 0-3 fill a 4-block host tier. Block 0 is prefetched (leased for the 10 s
    pin lease) and prefetched again at 3, 6 and 9 s. Its lease is not renewed: at 13 s it is
    evictable, and a Store of 4-7 stores all four. Then a fresh prefetch leases it again."""
    async with started_cache(small_config(tmp_path, pin_lease_seconds=10.0, lease_seconds=1e6)) as cache:
        pool = Pool()
        eng = Engine(cache, pool)
        await eng.store([0, 1, 2, 3])
        for _ in range(4):  # at 0, 3, 6 and 9 s
            (r,) = await cache.prefetch(eng.sid, [h(0)])
            assert r.status == PrefetchStatus.ALREADY_IN_HOST
            cache.clock.advance(3.0)
        cache.clock.advance(1.0)
        cache.reap_sessions()
        rs = await eng.store([4, 5, 6, 7])
        assert [r.status for r in rs] == [StoreStatus.STORED] * 4, [r.message for r in rs]
        await cache.tiers.drain()
        (r,) = await cache.prefetch(eng.sid, [h(0)])  # 0 went to disk: staged back, under a new lease
        assert r.status == PrefetchStatus.STAGED
        e = next(e for e in cache.tiers.index.values() if e.key.hash == h(0))
        assert e.lease_until == cache.clock.now() + 10.0
        await cache.tiers.drain()
        assert cache.audit() == []
        pool.close()


async def test_leases_of_a_closed_session_are_released_and_no_longer_count(tmp_path):
    """Scenario: a session leases blocks, then closes; its leases end at once (the blocks are
    evictable, ListSessions has nothing pinned for it) and the bytes stop counting."""
    cfg = small_config(tmp_path, host_capacity_bytes=16 * BLOCK, disk_blocks=64)
    async with started_cache(cfg) as cache:
        pool = Pool(num_blocks=32)
        eng = Engine(cache, pool)
        await eng.store(list(range(16)))
        out = await cache.prefetch(eng.sid, [h(i) for i in range(16)])
        assert sum(r.status == PrefetchStatus.ALREADY_IN_HOST for r in out) == 4
        assert [s.pinned_blocks for s in cache.sessions()] == [4]
        await cache.close_session(eng.sid)
        assert cache.tiers.life.leases.bytes_by_owner == {}
        assert all(e.lease_until == 0.0 for e in cache.tiers.index.values())
        assert cache.audit() == []
        pool.close()


def test_a_daemon_serves_another_namespace_while_one_engine_prefetches_everything():
    """Scenario: a real daemon with a 16-block host tier; engine A stores 64 blocks (most spill
    to disk) and prefetches all 64. Engine B, of another model, stores 24 blocks in batches of 8:
    all STORED, and loads the last 8 byte-exact; A's prefetches beyond its share are
    PREFETCH_FAILED."""
    with Daemon(host_capacity="64KiB", disk_capacity="1MiB") as d:
        with EngineProc(d.target) as a, EngineProc(d.target, "--model", "other") as b:
            assert a.call("store", numbers=list(range(64)))["status"] == [STORED] * 64
            d.settle()
            status = a.call("prefetch", numbers=list(range(64)))["status"]
            assert status.count(FAILED) >= 64 - 4
            for lo in (100, 108, 116):
                r = b.call("store", numbers=list(range(lo, lo + 8)))
                assert r["status"] == [STORED] * 8, r["message"]
            assert all(b.call("load", numbers=list(range(116, 124)))["exact"])
        assert "Traceback" not in d.log()
