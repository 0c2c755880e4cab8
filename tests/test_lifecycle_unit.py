"""kvservice.core.lifecycle driven directly (no cache, no loop thread, no I/O): each transition of
the state diagram and the books it moves, with `now` passed in."""

from __future__ import annotations

from kvservice.core.lifecycle import Lifecycle
from kvservice.core.types import NamespaceId, SessionId
from kvservice.memory.host_arena import HostArena
from kvservice.memory.host_tier import HostTier
from kvservice.ops.stats import CounterSet
from kvservice.placement.index import BlockIndex
from kvservice.placement.retention import Retention

BB = 4096
NS = NamespaceId("ns")


def make(blocks: int = 8) -> Lifecycle:
    arena = HostArena(blocks * BB, segment_bytes=blocks * BB)
    return Lifecycle(BlockIndex(), HostTier(arena, blocks * BB), Retention(3600.0, 0), CounterSet())


def hashes(*ns: int) -> list[bytes]:
    return [n.to_bytes(32, "little") for n in ns]


def test_reserve_place_commit_makes_resident_ready_blocks_and_the_books_add_up():
    life = make()
    d = life.index.namespace(NS)
    es = life.reserve(d, NS, hashes(1, 2), BB, now=10.0)
    assert [e.ready for e in es] == [False, False] and [e.pins for e in es] == [1, 1]
    assert life.audit(set(), idle=False) == []
    offs = life.host.alloc(BB, 2)
    life.place(es, offs)
    assert life.audit(set(), idle=False) == [] and life.host.loose_bytes == 0
    life.commit(es, [7, 8])
    assert all(e.ready and e.pins == 0 for e in es) and [e.checksum for e in es] == [7, 8]
    assert list(life.host.entries_oldest_first()) == [es[1], es[0]]  # the head of a chain is newest
    assert life.audit(set()) == []


def test_a_rollback_while_the_copy_runs_keeps_the_slots_until_the_copy_ends():
    life = make()
    d = life.index.namespace(NS)
    es = life.reserve(d, NS, hashes(1, 2, 3), BB, now=0.0)
    life.place(es[:2], life.host.alloc(BB, 2))  # the third did not fit: no slot
    life.rollback(es, copy_running=True)
    assert d == {}  # the hashes can be stored again at once
    assert life.host.used_bytes == 2 * BB and life.audit(set(), idle=False) == []
    assert life.audit(set()) == ["2 rolled-back reservations still hold their slots"]
    life.rollback(es, copy_running=True)  # idempotent
    life.release_aborted(es)
    assert life.host.used_bytes == 0 and life.host.arena.used_bytes == 0
    assert life.audit(set()) == []


def test_a_release_while_pinned_waits_for_the_last_unpin():
    life = make()
    d = life.index.namespace(NS)
    (e,) = life.reserve(d, NS, hashes(1), BB, now=0.0)
    life.place([e], life.host.alloc(BB, 1))
    life.commit([e], [0])
    life.pin([e])
    life.pin([e])
    life.release(e)
    assert e.slot >= 0 and e.release_pending and life.host.used_bytes == BB
    life.unpin([e])
    assert e.slot >= 0
    life.unpin([e])
    assert e.slot < 0 and life.host.used_bytes == 0 and not life.releasing


def test_evict_many_frees_a_batch_and_defers_a_pinned_one():
    life = make()
    d = life.index.namespace(NS)
    es = life.reserve(d, NS, hashes(1, 2, 3, 4), BB, now=0.0)
    life.place(es, life.host.alloc(BB, 4))
    life.commit(es, [0] * 4)
    life.pin([es[2]])
    life.evict_many(es)
    assert [e.slot < 0 for e in es] == [True, True, False, True]
    assert life.host.used_bytes == BB and len(life.host) == 0
    life.forget_many([es[0], es[1], es[3]])
    life.unpin([es[2]])
    life.forget(es[2])
    assert d == {} and life.host.used_bytes == 0 and life.audit(set()) == []


def test_leases_are_counted_per_owner_end_at_their_time_on_a_load_or_when_the_owner_goes():
    life = make()
    d = life.index.namespace(NS)
    es = life.reserve(d, NS, hashes(1, 2, 3), BB, now=0.0)
    life.place(es, life.host.alloc(BB, 3))
    life.commit(es, [0] * 3)
    a, b = SessionId("a"), SessionId("b")
    assert life.lease(a, es[0], now=0.0, seconds=5.0, staged=True) == BB
    life.lease(a, es[1], now=0.0, seconds=10.0, staged=False)
    life.lease(b, es[2], now=0.0, seconds=5.0, staged=False)
    book = life.leases
    assert book.owned_bytes(a) == 2 * BB and book.total_bytes == 3 * BB and book.count(a) == 2
    assert life.audit({a, b}) == [] and life.audit({a}) == ["1 prefetch leases held by no open session"]
    life.end_expired_leases(now=5.0)  # es[0] and es[2] ran out
    assert book.owned_bytes(a) == BB and book.owned_bytes(b) == 0 and book.total_bytes == BB
    assert life.stats.total.prefetch_wasted == 1  # es[0] was staged from disk and never loaded
    life.loaded(b, [es[1]])  # another session's load does not end a's lease
    assert es[1].lease_until == 10.0 and es[1].reuse == 1
    life.end_leases_of(a)
    assert book.total_bytes == 0 and len(book) == 0 and es[1].lease_owner == ""
    assert life.audit(set()) == []
