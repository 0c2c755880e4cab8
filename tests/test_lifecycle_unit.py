"""kvservice.core.lifecycle driven directly (no cache, no loop thread, no I/O): each transition of
the state diagram and the books it moves, with `now` passed in."""

from __future__ import annotations

from kvservice.core.lifecycle import Lifecycle
from kvservice.core.types import NamespaceId, SessionId
from kvservice.disk.disk_tier import DiskTier
from kvservice.memory.host_arena import HostArena
from kvservice.memory.host_tier import HostTier
from kvservice.ops.stats import CounterSet
from kvservice.placement.index import BlockIndex, DiskState, Entry
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


def make_with_disk(blocks: int = 8, cap_bytes: int = 0) -> Lifecycle:
    arena = HostArena(blocks * BB, segment_bytes=blocks * BB)
    return Lifecycle(BlockIndex(), HostTier(arena, blocks * BB), Retention(3600.0, cap_bytes), CounterSet(),
                     DiskTier("", 4 * blocks * BB))


def ready_block(life: Lifecycle, n: int) -> Entry:
    d = life.index.namespace(NS)
    (e,) = life.reserve(d, NS, hashes(n), BB, now=0.0)
    life.place([e], life.host.alloc(BB, 1))
    life.commit([e], [n])
    return e


def test_the_disk_copy_goes_queued_on_disk_and_released_with_the_disk_books_in_step():
    """Scenario: a ready block's spill gets disk room and a segment slot (QUEUED), is written
    (ON_DISK, in the unmarked LRU, with the deadline its metadata carries), later evicted from disk
    (NONE, slot and path cleared); another spill is abandoned (QUEUED -> NONE, room given back, twice
    harmless). The disk tier's used bytes follow every step."""
    life = make_with_disk()
    disk = life.disk
    e, f = ready_block(life, 1), ready_block(life, 2)
    life.disk_queue(e)
    life.disk_slot(e, 77)
    assert (e.disk, e.disk_loc, disk.used_bytes) == (DiskState.QUEUED, 77, BB)
    life.disk_commit(e, deadline=0.0)
    assert e.disk == DiskState.ON_DISK and e in disk.unmarked and len(disk) == 1
    life.disk_queue(f)
    life.disk_unqueue(f)
    life.disk_unqueue(f)
    assert f.disk == DiskState.NONE and disk.used_bytes == BB
    life.disk_release(e)
    assert (e.disk, e.disk_loc, e.disk_path, disk.used_bytes, len(disk)) == (DiskState.NONE, -1, "", 0, 0)
    assert e not in disk.unmarked
    life.disk_release(e)  # not on disk: nothing to do
    assert disk.used_bytes == 0


def test_retain_only_extends_moves_an_on_disk_block_to_the_retained_order_and_respects_the_cap():
    """Scenario (clock passed in): retain(ttl 10) at t=0 sets deadline 10 and moves the on-disk
    block out of the unmarked LRU into the retained order; retain(ttl 5) at t=1 keeps 10 (deadlines
    only extend); with a 1-block cap a second block is refused (None, nothing changes) until the
    first one's deadline has passed."""
    life = make_with_disk(cap_bytes=BB)
    e, f = ready_block(life, 1), ready_block(life, 2)
    life.disk_queue(e)
    life.disk_commit(e, deadline=0.0)
    assert life.retain(e, 10.0, now=0.0) == 10.0 and e.deadline == 10.0
    assert e not in life.disk.unmarked and id(e) in life.disk.retained
    assert life.retain(e, 5.0, now=1.0) == 10.0 and e.deadline == 10.0
    assert life.retain(f, 100.0, now=2.0) is None and f.deadline == 0.0
    assert life.retain(f, 100.0, now=11.0) == 111.0 and f.deadline == 111.0


def test_blocks_found_on_disk_are_adopted_into_the_index_the_disk_books_and_retention():
    """Scenario: two blocks recovered at restart (ON_DISK, one with a deadline): adopt puts both in
    the index, counts their bytes on disk, orders the retained one by deadline and the other in the
    unmarked LRU, and the retained one's bytes count against the namespace's retained sum."""
    life = make_with_disk()
    a = Entry(NS, hashes(1)[0], BB, 1, 0.0, deadline=50.0, disk=DiskState.ON_DISK, disk_loc=3, disk_deadline=50.0)
    b = Entry(NS, hashes(2)[0], BB, 2, 1.0, disk=DiskState.ON_DISK, disk_loc=4)
    life.adopt([a, b])
    assert life.index.namespace(NS) == {a.hash: a, b.hash: b}
    assert life.disk.used_bytes == 2 * BB and len(life.disk) == 2
    assert id(a) in life.disk.retained and b in life.disk.unmarked
    assert life.retention.retained_bytes(NS, now=10.0) == BB and life.retention.retained_bytes(NS, now=60.0) == 0
