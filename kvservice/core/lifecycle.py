"""Block lifecycle: the states a block goes through, and the transitions between them, in one place.

    (absent) ──reserve──> RESERVED ──place──> RESERVED+slot ──commit──> READY ──forget──> (absent)
                              │                     │
                              └───────rollback──────┴──> ABORTED ──last unpin──> (absent)
    rollback: a Store cancelled at any await, a dead client, a failed copy, no room. An ABORTED entry is
    out of the index at once (the hash can be stored again); its slot stays taken, on the host tier's
    room, until the copy thread that writes into it is done (its pin), then goes back to the arena.
    A Store holds all its new hashes from the start (reserve_found: each maps to a RESERVED entry of
    its own, taken from the blank entries built ahead, BlankEntries) and hands them their slots part
    by part (build), each part's beside the copy of the part before; finish() rolls back the ones
    never placed. A large Store holds its first part's hashes first and each later part's just
    before that part's plan (reserve_more, checked with no await between; unreserve if that part is
    not all new).

  A READY block has two separate facts, a hold count and at most one lease:
    host copy:  NONE ─add (Store commit, disk onboard)─> RESIDENT (in the host LRU)
                RESIDENT ─evict(keep_slot)─> SPILLING (out of the LRU; slot kept until its spill is written;
                    its bytes move to the spill staging budget as soon as it has room: `staged`)
                RESIDENT ─evict / release─> NONE;  SPILLING ─release (written, abandoned)─> NONE
                SPILLING ─restore (its spill failed, retained)─> RESIDENT
                a release while pinned waits for the last unpin (release_pending)
    disk copy:  NONE ─disk_queue─> QUEUED (+ disk_slot: its segment slot) ─disk_commit─> ON_DISK
                ─disk_release─> NONE;  QUEUED ─disk_unqueue (abandoned, failed, no slot)─> NONE;
                (absent) ─adopt (found at restart)─> ON_DISK; disk_deadline: what its metadata says
                (kvservice.disk.disk_tier.DiskTier is their room and order book; tiers.Tiers runs the I/O)
    retention:  retain: the deadline moves to now + ttl if later, never earlier, unless the namespace's
                retained-bytes cap refuses (kvservice.placement.retention decides and keeps the sums)
    pinned(n):  copies, disk reads and spill writes in flight that need the slot; each one unpins from its
                own completion (a done callback or the copy thread's end), so a cancelled caller leaves none
    leased:     one prefetch lease (owner session, until); ends at `until`, when its owner loads the block,
                or when its owner's session closes. Never renewed by another prefetch while it runs.
  An entry stays indexed while RESERVED, or READY with a host or a disk copy; with neither it is forgotten.

Invariants (audit(), checked by tests/test_lifecycle_properties.py after every step, and the first
two at every await point of a Store or Load):
  - host tier used bytes == slots of RESERVED+slot, ABORTED and READY blocks whose bytes count on it
    (not staged); staging bytes == slots of staged spills; arena slots taken == all of them
  - a lease is owned by an open session; the lease bytes per session and in total add up
  - when no call is in flight: nothing RESERVED or ABORTED, nothing pinned
Who decides which block is a victim is tiers.Tiers with the pure policies of kvservice.placement;
this module only moves blocks between states and keeps the counters they change, those Admin.Stats
reports included (kvservice.placement.tier_counts: per tier in host.counts / disk.counts, per namespace
in ns_counts; BlockCache.audit checks them against the walks they replace).
"""

from __future__ import annotations

import asyncio
import heapq
from collections import Counter
from operator import attrgetter, countOf
from collections.abc import Iterable, Mapping, Sequence

from kvservice.disk.disk_tier import DiskTier
from kvservice.memory.host_tier import HostTier
from kvservice.placement.index import DiskState
from kvservice.ops.stats import CounterSet
from kvservice.placement.index import BlankEntries, BlockIndex, Entry, reserved_entries
from kvservice.placement.retention import Retention
from kvservice.placement.tier_counts import NamespaceCounts, TierCounts
from kvservice.core.types import NamespaceId, SessionId


_ENTRY_FIELDS = ("namespace", "hash", "size", "checksum", "stored_at", "deadline", "reuse", "slot", "spilling", "staged",
                 "release_pending", "disk", "disk_path", "disk_loc", "disk_deadline", "pins", "lease_until",
                 "lease_owner", "ready", "lru_pos")
assert tuple(Entry.__dataclass_fields__) == _ENTRY_FIELDS, "index.reserved_entries / _blank_entries set every field of Entry"


def in_host_tier(e: Entry) -> bool:
    """e is one of the host tier's members (HostTier.entries(): its LRU, and its spills still on
    its capacity), told by e's state: a slot, ready, not staged, no release pending."""
    return e.slot >= 0 and e.ready and not e.staged and not e.release_pending


_namespace_of = attrgetter("namespace")
_size_of = attrgetter("size")


TIDY_BLOCKS = 2048  # blank entries a tidy_step builds (~1 ms of the GPU host's loop)


class LeaseBook:
    """Prefetch leases, kept incrementally: per-owner and total bytes, and a heap of expiries
    (stale items skipped). Pure bookkeeping; `now` comes from the caller."""

    def __init__(self) -> None:
        self.entries: dict[int, tuple[Entry, bool]] = {}  # id(entry) -> (entry, staged from disk)
        self.by_owner: dict[SessionId, dict[int, Entry]] = {}
        self.bytes_by_owner: dict[SessionId, int] = {}
        self.total_bytes = 0
        self._expiry: list[tuple[float, int, list[Entry]]] = []  # (until, seq, the entries leased until then)
        self._seq = 0

    def owned_bytes(self, owner: SessionId) -> int:
        return self.bytes_by_owner.get(owner, 0)

    def count(self, owner: SessionId) -> int:
        return len(self.by_owner.get(owner, ()))

    def __len__(self) -> int:
        return len(self.entries)


class Reservation:
    """A Store's new blocks, RESERVED in the index from the moment their hashes are reserved
    (Lifecycle.reserve_found / reserve_more: an entry each, not ready, one pin, no slot) - a
    concurrent Store of one of them waits for its outcome, Lookup / Load / Prefetch see it not
    ready - and handed their slots part by part (Lifecycle.build), each part's beside the copy of
    the part before. entries[i] is hashes[i]'s, for as many hashes as are reserved so far."""

    __slots__ = ("blocks", "ns", "hashes", "size", "now", "entries", "placed", "committed")

    def __init__(self, blocks: dict[bytes, Entry], ns: NamespaceId, hashes: Sequence[bytes], size: int,
                 now: float) -> None:
        self.blocks, self.ns, self.hashes, self.size, self.now = blocks, ns, hashes, size, now
        self.entries: list[Entry] = []  # reserved so far, for hashes[:len(entries)]
        self.placed = 0  # entries[:placed] were handed out by build() (their slots placed)
        self.committed = 0  # entries[:committed] are committed (commit(..., r)): finish() skips their walk

    def __len__(self) -> int:
        return len(self.hashes)


class Lifecycle:
    """The one place where a block changes state. tiers.Tiers and cache.BlockCache call these
    transitions; HostTier and DiskTier are the room and order books they update."""

    def __init__(self, index: BlockIndex, host: HostTier, retention: Retention, stats: CounterSet,
                 disk: DiskTier | None = None, blank_limit: int = 0) -> None:
        self.index = index
        self.blanks = BlankEntries(blank_limit)  # new entries built ahead of the Stores (tidy_step)
        self._dropped: list[Sequence[Entry]] = []  # batches drop_plain let go of: freed by tidy_step
        self.host = host
        self.disk = disk  # the disk copy's room and order book (None: no disk tier)
        self.retention = retention
        self.stats = stats
        self.leases = LeaseBook()
        self.aborted: dict[int, Entry] = {}  # rolled back, slot held until the copy writing into it ends
        self.releasing: dict[int, Entry] = {}  # released while pinned: the slot goes at the last unpin
        self._outcome: dict[int, asyncio.Future[None]] = {}  # id(reserved entry) -> resolved at commit / rollback
        # what Admin.Stats reports, kept where blocks change state (kvservice.placement.tier_counts):
        # per namespace over indexed entries here, per tier in host.counts / disk.counts
        self.ns_counts = NamespaceCounts()
        self._disk_counts = disk.counts if disk is not None else TierCounts()  # (no disk tier: never joined)
        self._leased = (host.counts.leased.live, self._disk_counts.leased.live)

    # --- reservations (Store)
    def reserve(self, blocks: dict[bytes, Entry], ns: NamespaceId, hashes: Sequence[bytes], size: int,
                now: float) -> list[Entry] | None:
        """New RESERVED entries for hashes, none of them in `blocks` (reserve_found with no
        Reservation to follow: the caller places, commits or rolls them back itself). None, and
        nothing reserved, when one of them is there already or twice in hashes."""
        r, _, added = self.reserve_found(blocks, ns, hashes, size, now)
        if added < len(hashes):
            self.unreserve(r, added)
            return None
        return r.entries

    def reserve_found(self, blocks: dict[bytes, Entry], ns: NamespaceId, hashes: Sequence[bytes], size: int,
                      now: float) -> tuple[Reservation, list[Entry], int]:
        """The batch's lookup and its new hashes' reservation in one pass over the dict
        (dict.setdefault: the probe and the insert are one): every hash not in `blocks` maps to a
        new RESERVED entry of a new Reservation from now on. Returns (r, found, added): found[i] is
        what hashes[i] maps to - an entry stored or being stored (another Store's included), or
        r's own new entry (also at the later places of a hash twice in the batch) - and added, how
        many hashes r holds (r.entries, in the order of their first places). The caller sets
        r.hashes to those hashes, each once, in that order."""
        r = Reservation(blocks, ns, (), size, now)
        found, added = self.reserve_more(r, hashes)
        return r, found, added

    def reserve_more(self, r: Reservation, hashes: Sequence[bytes]) -> tuple[list[Entry], int]:
        """reserve_found's pass for more hashes of the same Store (the rest of a batch whose head is
        copying already): each one not in the index maps to a new RESERVED entry of r from now on
        (appended to r.entries). Returns (found, added) as reserve_found does."""
        blocks = r.blocks
        entries = reserved_entries(r.ns, hashes, r.size, r.now, self.blanks)
        before = len(blocks)
        found = list(map(blocks.setdefault, hashes, entries))
        added = len(blocks) - before
        r.entries += entries if added == len(hashes) else [c for e, c in zip(found, entries) if e is c]
        return found, added

    def unreserve(self, r: Reservation, k: int) -> None:
        """The last k entries reserve_more gave r leave the index again, with no await since (nobody
        saw them): a later part of a head-first Store that was not all new."""
        if k <= 0:
            return
        blocks = r.blocks
        for e in r.entries[-k:]:
            if blocks.get(e.hash) is e:
                del blocks[e.hash]
            e.pins = 0
        del r.entries[-k:]

    def build(self, r: Reservation, k: int) -> list[Entry]:
        """The entries of the next k hashes of r (RESERVED, one pin each), to be placed."""
        lo = r.placed
        entries = r.entries[lo:lo + k]
        assert len(entries) == k, "build() past the hashes reserved"
        r.placed = lo + k
        return entries

    def release_unbuilt(self, r: Reservation) -> None:
        """r's entries never placed (build) leave the index (they will not be stored)."""
        if r.placed < len(r.entries):  # (all placed, the usual end: no copy of the lists)
            self.rollback(r.entries[r.placed:])
            del r.entries[r.placed:]
        if r.placed < len(r.hashes):
            r.hashes = r.hashes[:r.placed]

    def finish(self, r: Reservation) -> None:
        """r's Store is over: its entries never placed leave the index, its placed entries not
        committed are rolled back, and whoever waited for their outcome (outcome()) hears of it.
        Idempotent."""
        self.release_unbuilt(r)
        if r.committed < len(r.entries):
            for e in r.entries:
                if not e.ready:
                    self.rollback(r.entries)
                    break

    def place(self, entries: Sequence[Entry], offsets: Sequence[int]) -> None:
        """Reserved entries get the slots host.alloc took for them (on the tier's room already)."""
        for e, off in zip(entries, offsets):
            e.slot = off
        if entries:
            self.host.held(len(offsets) * entries[0].size)
            self.ns_counts.host(entries[0].namespace, len(offsets), len(offsets) * entries[0].size)

    def commit(self, entries: Sequence[Entry], checksums: Sequence[int], r: Reservation | None = None) -> None:
        """RESERVED+slot -> READY, RESIDENT: the copy into the slots is done. Head first. r: the
        Reservation whose next entries these are (its count of committed entries follows)."""
        for e, c in zip(entries, checksums):
            e.checksum = c
            e.ready = True
            e.pins = 0
        self.host.lru_add_new(entries)  # reserved entries were never in the LRU
        if r is not None:
            r.committed += len(entries)
        if self._outcome:
            self._settle_outcomes(entries)

    def rollback(self, entries: Iterable[Entry], copy_running: bool = False) -> None:
        """Every entry of `entries` still not ready leaves the index now. One with a slot whose copy
        is still running (copy_running) is ABORTED: its slot goes at release_aborted(), when the copy
        thread is done; otherwise at once. Idempotent."""
        rolled: list[Entry] = []
        for e in entries:
            if e.ready or id(e) in self.aborted or not self.index.holds(e):
                continue
            self.index.remove(e)
            rolled.append(e)
            if e.slot >= 0:  # out of the index: its slot no longer counts for the namespace
                self.ns_counts.host(e.namespace, -1, -e.size)
            if e.slot < 0:
                e.pins = 0
            elif copy_running:
                self.aborted[id(e)] = e
            else:
                self._free_reserved(e)
        if self._outcome:
            self._settle_outcomes(rolled)

    def outcome(self, entries: Sequence[Entry]) -> list[asyncio.Future[None]]:
        """Futures resolved when each of these reserved entries (another call's, or this Store's own
        for a hash twice) is committed or rolled back; await them with asyncio.wait (a cancelled
        waiter must not cancel them). Then entry.ready says which. An entry settled already has none."""
        loop = asyncio.get_running_loop()
        out = []
        for e in entries:
            if e.ready or not self.index.holds(e):
                continue
            f = self._outcome.get(id(e))
            if f is None:
                f = self._outcome[id(e)] = loop.create_future()
            out.append(f)
        return out

    def _settle_outcomes(self, entries: Iterable[Entry]) -> None:
        for e in entries:
            f = self._outcome.pop(id(e), None)
            if f is not None and not f.done():
                f.set_result(None)

    def release_aborted(self, entries: Iterable[Entry]) -> None:
        """The copy into ABORTED entries' slots ended: the slots go back to the arena."""
        for e in entries:
            if self.aborted.pop(id(e), None) is not None:
                self._free_reserved(e)

    def _free_reserved(self, e: Entry) -> None:
        self.host.arena.free([e.slot], e.size)
        self.host.used_bytes -= e.size
        e.slot = -1
        e.pins = 0

    # --- holds
    def pin(self, entries: Iterable[Entry]) -> None:
        """One more pin on each; a host or disk tier member's first one counts it as pinned there
        (TierCounts.pinned, inlined: this loop runs per block of every Load). in_host_tier(e) is
        `slot >= 0 and not staged` here: an entry with no pin has no release pending (it is set
        only on a pinned one), and one with a slot and no pin is ready (a reserved or rolled-back
        entry holds its reserving pin while it has a slot). audit() checks the counts."""
        host_leased, disk_leased = self._leased
        has_disk, on_disk = self.disk is not None, DiskState.ON_DISK
        hp = dp = 0
        for e in entries:
            if e.pins:
                e.pins += 1
                continue
            e.pins = 1
            if e.slot >= 0 and not e.staged:
                hp += 1
                if e.lease_until:
                    host_leased.pop(id(e), None)
            if has_disk and e.disk is on_disk:  # (disk is always a DiskState member)
                dp += 1
                if e.lease_until:
                    disk_leased.pop(id(e), None)
        self.host.counts.pins += hp
        self._disk_counts.pins += dp

    def unpin(self, entries: Iterable[Entry]) -> None:
        """Drop one pin of each; a slot whose release waited for its last pin goes now. A tier
        member's last one counts it as unpinned there (TierCounts.unpinned, inlined; in_host_tier(e)
        is `slot >= 0 and not staged` once no release is pending: an entry whose last pin goes here
        is ready, a reserved one's goes at commit or rollback)."""
        hc, dc = self.host.counts, self._disk_counts
        has_disk, on_disk = self.disk is not None, DiskState.ON_DISK
        hp = dp = 0
        for e in entries:
            e.pins -= 1
            if e.pins:
                continue
            if e.release_pending:  # (set only with an entry in self.releasing): not in the host tier
                if has_disk and e.disk is on_disk:
                    dp += 1
                    if e.lease_until:
                        dc.leased.add(e)
                self.release(e)
                continue
            if e.slot >= 0 and not e.staged:
                hp += 1
                if e.lease_until:
                    hc.leased.add(e)
            if has_disk and e.disk is on_disk:
                dp += 1
                if e.lease_until:
                    dc.leased.add(e)
        hc.pins -= hp
        dc.pins -= dp

    # --- host copy
    def add(self, chain: Sequence[Entry], offsets: Sequence[int]) -> None:
        """NONE -> RESIDENT: ready entries (head first) get the slots their bytes were put in."""
        for e, off in zip(chain, offsets):
            assert e.slot < 0
            was = self._where(e)
            e.slot = off
            self.host.held(e.size)
            self._moved(e, was)
        self.host.lru_touch(chain)

    def evict(self, e: Entry, keep_slot: bool) -> None:
        """RESIDENT -> SPILLING (keep_slot: its spill is queued) or -> NONE."""
        host = self.host
        host.lru_discard(e)
        if keep_slot:
            was = self._where(e)
            e.spilling = True
            host.spilling[id(e)] = e
            if host.staged_bytes + e.size <= host.staging_bytes:
                e.staged = True  # off the tier's capacity now; the slot itself goes after the write
                host.staged_bytes += e.size
                host.used_bytes -= e.size
            else:  # staged in spill order, as the budget frees up (_promote)
                host.unstaged[id(e)] = e
            self._moved(e, was)
        else:
            self.release(e)

    def evict_to_spill_many(self, entries: Sequence[Entry]) -> None:
        """evict(e, keep_slot=True) for each, in order (RESIDENT -> SPILLING: their spills are queued),
        as batch passes: the staging budget goes to them in order, the figures of the ones staged
        (off the tier's capacity now) summed per namespace. For a Store's victims of a full tier,
        one walk of the state per block was ~10% of the loop's cost of a spilled 64 KiB block."""
        if not entries:
            return
        host = self.host
        host.lru_discard_many(entries)
        spilling, unstaged = host.spilling, host.unstaged
        room = host.staging_bytes - host.staged_bytes
        stage: list[Entry] = []
        for e in entries:
            e.spilling = True
            spilling[id(e)] = e
            size = e.size
            if size > room:  # staged in spill order, as the budget frees up (_promote)
                unstaged[id(e)] = e
                continue
            room -= size
            stage.append(e)
        self._stage(stage)

    def _stage(self, entries: Sequence[Entry]) -> None:
        """Spilling blocks, not staged yet, move to the spill staging budget (off the tier's capacity),
        in passes: the host tier's members that leave it, the namespaces' figures summed. The caller
        checked the budget has room for them."""
        host = self.host
        leave, holds = host.counts.leave, self.index.holds
        staged = 0
        by_ns: dict[NamespaceId, list[int]] = {}
        for e in entries:
            size = e.size
            staged += size
            if in_host_tier(e):
                leave(e)
            if e.slot >= 0 and not e.staged and holds(e):  # its host_buf leaves the namespace's figures
                r = by_ns.get(e.namespace)
                if r is None:
                    r = by_ns[e.namespace] = [0, 0]
                r[0] += 1
                r[1] += size
            e.staged = True
        host.staged_bytes += staged
        host.used_bytes -= staged
        for ns, (k, nbytes) in by_ns.items():
            self.ns_counts.host(ns, -k, -nbytes)

    def evict_many(self, entries: Sequence[Entry], plain: bool = False) -> None:
        """RESIDENT -> NONE for a batch of victims (one arena call per block size); a pinned one
        waits for its last unpin as with evict(). plain: the caller knows them unpinned, resident
        (in the LRU: a slot, not spilling) and of one size, so they are not checked again."""
        if not entries:
            return
        host = self.host
        host.lru_discard_many(entries)
        size = entries[0].size
        # the usual batch (victims make_host_room chose): unpinned, resident, one size - checked in
        # one pass, the slots gathered in another; anything else goes one by one through release()
        odd = [] if plain else [e for e in entries if e.pins or e.spilling or e.slot < 0 or e.size != size]  # staged implies spilling
        if odd:
            oddset = set(map(id, odd))
            plain = [e for e in entries if id(e) not in oddset]
            for e in odd:
                self.release(e)
        else:
            plain = entries
        if plain:
            free = []
            add = free.append
            for e in plain:  # a plain loop: faster than map(attrgetter) on slotted entries
                add(e.slot)
                e.slot = -1
            host.arena.free(free, size)
            host.used_bytes -= len(free) * size
            self._left_host_plain(plain, size)
            self._wake_and_promote(plain)

    def drop_plain(self, entries: Sequence[Entry], by_ns: Mapping[NamespaceId, int]) -> None:
        """evict_many(entries, plain=True), then forget_many(entries), in one pass over them: RESIDENT
        -> (absent) for victims with no disk copy and no disk tier to spill to (make_host_room's
        usual batch when there is none: unpinned, resident, of one size, taken out of the LRU already
        by HostTier.take_oldest, the walk that chose them). Each entry is touched once (slot, index
        key) where the two calls walk the batch five times (~1 us a block of an evicting 64 KiB Store
        on the CPU box, ~a third of its loop time). by_ns: how many of them each namespace has."""
        if not entries:
            return
        assert self.disk is None, "drop_plain is for a host tier with no disk tier"
        host = self.host
        size = entries[0].size
        free: list[int] = []
        add = free.append
        marked: list[Entry] = []  # retained or once leased: their books, after the pass
        for e in entries:  # a plain loop: faster than map(attrgetter) on slotted entries
            add(e.slot)
            e.slot = -1
            if e.deadline or e.lease_until:
                marked.append(e)
        host.arena.free(free, size)
        host.used_bytes -= len(free) * size
        self._left_host_plain(marked, size, by_ns=by_ns)
        for e in marked:
            if e.deadline:
                self.retention.forget(e)
        self._wake_and_promote(entries)
        self.index.remove_many(entries)
        self._dropped.append(entries)  # their memory is freed after the answer (tidy_step), not before the copy

    def tidy_step(self, blocks: int | None = None) -> bool:
        """One step of the work kept off the answers' way (BlockCache runs it in a task of its own,
        a step between other requests): the entries a batch of evictions let go of are freed (~0.15
        us a block: the entry and its hash), else up to `blocks` blank entries built for the next
        Stores (BlankEntries.refill). True while some is left."""
        if self._dropped:
            self._dropped.pop()
        else:
            self.blanks.refill(TIDY_BLOCKS if blocks is None else blocks)
        return bool(self._dropped) or len(self.blanks) < self.blanks.limit

    def restore(self, e: Entry) -> bool:
        """SPILLING -> RESIDENT with the slot it kept (its spill failed); False: no room for it."""
        host = self.host
        was = self._where(e)
        if e.staged:
            if e.size > host.free_bytes:
                return False
            host.staged_bytes -= e.size
            host.used_bytes += e.size
            e.staged = False
        host.spilling.pop(id(e), None)
        host.unstaged.pop(id(e), None)
        e.spilling = False
        host.lru_touch([e])
        self._moved(e, was)
        return True

    def release(self, e: Entry) -> None:
        """-> host copy NONE: the slot goes back to the arena; deferred (release_pending) while pinned."""
        if e.slot < 0:
            return
        host = self.host
        was = self._where(e)
        host.lru_discard(e)
        host.spilling.pop(id(e), None)
        host.unstaged.pop(id(e), None)
        e.spilling = False
        if e.pins:
            e.release_pending = True
            self.releasing[id(e)] = e
            self._moved(e, was)
            return
        self.releasing.pop(id(e), None)
        host.arena.free([e.slot], e.size)
        if e.staged:
            host.staged_bytes -= e.size
            e.staged = False
        else:
            host.used_bytes -= e.size
        e.slot = -1
        e.release_pending = False
        self._moved(e, was)
        self._wake_and_promote((e,))

    def _wake_and_promote(self, released: Iterable[Entry]) -> None:
        host = self.host
        if host.waiters:
            for e in released:
                host.wake(e)
        if host.unstaged:
            self._promote()

    def _promote(self) -> None:
        """Spills still on the tier's capacity move to the staging budget as it frees up, oldest
        first: the Stores waiting for their room go on without waiting for their writes. Only the
        unstaged ones are looked at (a walk of every spill per released slot cost 40 us a call),
        and the ones that fit move as one batch (_stage; one state walk each was ~1/6 of the
        loop's cost of a spilled 64 KiB block)."""
        host = self.host
        unstaged = host.unstaged
        room = host.staging_bytes - host.staged_bytes
        moved: list[Entry] = []
        for e in unstaged.values():
            if e.size > room:
                break
            room -= e.size
            moved.append(e)
        if not moved:
            return
        for e in moved:
            del unstaged[id(e)]
        self._stage(moved)
        if host.waiters:
            for e in moved:
                host.wake(e)

    def forget(self, e: Entry) -> None:
        """-> (absent): neither copy is left (or an admin evict / a discard)."""
        self._unindexed(e)
        self.retention.forget(e)
        self.index.remove(e)

    def forget_many(self, entries: Sequence[Entry]) -> None:
        has_disk, on_disk = self.disk is not None, DiskState.ON_DISK
        for e in entries:  # (victims dropped: no slot and no disk copy left, one check each)
            if e.slot >= 0 or (has_disk and e.disk == on_disk):
                self._unindexed(e)
        self.retention.forget_many(entries)
        self.index.remove_many(entries)

    # --- disk copy (DiskTier keeps its bytes and eviction orders; kvservice.core.tiers runs the I/O)
    def disk_queue(self, e: Entry) -> None:
        """NONE -> QUEUED: a spill (or a shutdown write) got disk room; its slot comes with disk_slot."""
        assert self.disk is not None and e.disk == DiskState.NONE
        self.disk.reserve(e)
        e.disk = DiskState.QUEUED

    def disk_slot(self, e: Entry, loc: int) -> None:
        """The segment slot a QUEUED spill is written to (disk tier v2); -1: none (given back)."""
        e.disk_loc = loc

    def disk_unqueue(self, e: Entry) -> None:
        """QUEUED -> NONE: the spill will not be written (abandoned, failed, refused a slot). Idempotent."""
        assert self.disk is not None
        if self.disk.unreserve(e):
            e.disk = DiskState.NONE

    def disk_commit(self, e: Entry, deadline: float, path: str = "") -> None:
        """QUEUED -> ON_DISK: its bytes and metadata are written, with `deadline` (the files format: at `path`)."""
        assert self.disk is not None and e.disk == DiskState.QUEUED
        was = self._where(e)
        if path:
            e.disk_path = path
        e.disk_deadline = deadline
        e.disk = DiskState.ON_DISK
        self.disk.commit(e)
        self._moved(e, was)

    def spills_written(self, entries: Sequence[Entry]) -> None:
        """disk_commit(e, e.deadline), then release(e), for each block of a written spill batch that is
        QUEUED, spilling, indexed, unpinned and with no release pending (spill_jobs' usual case), as
        batch passes: one disk-tier commit, one arena call a block size, the namespaces' figures
        summed. The same end state as the per-block calls (audit() checks the counts); per block
        those cost ~30 us of the loop a block spilled (CPU box), which at 64 KiB blocks was the
        spill's limit, not the disk."""
        if not entries:
            return
        assert self.disk is not None
        host, ns_counts = self.host, self.ns_counts
        on_disk = DiskState.ON_DISK
        disk_join = self._disk_counts.join
        # QUEUED -> ON_DISK: each joins the disk tier's members and its namespace's disk figures
        for e in entries:
            e.disk_deadline = e.deadline
            e.disk = on_disk
            disk_join(e)
        self.disk.commit_many(entries)
        # SPILLING -> host copy NONE: a staged one left the tier's figures when it was staged; an
        # unstaged one (still on the tier's capacity) is a host tier member until now
        host.lru_discard_many(entries)
        spilling, unstaged, releasing = host.spilling, host.unstaged, self.releasing
        host_leave = host.counts.leave
        slots: dict[int, list[int]] = {}
        by_ns: dict[NamespaceId, list[int]] = {}  # [disk blocks, disk bytes, host blocks, host bytes]
        staged_bytes = used_bytes = 0
        for e in entries:
            size = e.size
            r = by_ns.get(e.namespace)
            if r is None:
                r = by_ns[e.namespace] = [0, 0, 0, 0]
            r[0] += 1
            r[1] += size
            spilling.pop(id(e), None)
            releasing.pop(id(e), None)
            e.spilling = False
            if e.staged:
                staged_bytes += size
                e.staged = False
            else:
                unstaged.pop(id(e), None)
                used_bytes += size
                if e.ready:  # in_host_tier until now
                    host_leave(e)
                r[2] += 1
                r[3] += size
            part = slots.get(size)
            if part is None:
                slots[size] = [e.slot]
            else:
                part.append(e.slot)
            e.slot = -1
        for size, offsets in slots.items():
            host.arena.free(offsets, size)
        host.staged_bytes -= staged_bytes
        host.used_bytes -= used_bytes
        for ns, (db, dbytes, hb, hbytes) in by_ns.items():
            ns_counts.disk(ns, db, dbytes)
            if hb:
                ns_counts.host(ns, -hb, -hbytes)
        self._wake_and_promote(entries)

    def disk_deadline(self, e: Entry, deadline: float) -> None:
        """The deadline its disk copy now carries (a metadata update or header rewrite was issued)."""
        e.disk_deadline = deadline

    def disk_release(self, e: Entry) -> None:
        """ON_DISK -> NONE: its disk copy is gone (evicted, discarded, admin); the caller frees the slot
        or unlinks the file it read off e first."""
        assert self.disk is not None
        if e.disk != DiskState.ON_DISK:
            return
        was = self._where(e)
        self.disk.release(e)
        e.disk = DiskState.NONE
        e.disk_path = ""
        e.disk_loc = -1
        self._moved(e, was)

    def adopt(self, entries: Sequence[Entry]) -> None:
        """(absent) -> ON_DISK: blocks found on disk at restart (made ON_DISK, oldest first) enter the
        index, the disk tier's books and retention."""
        assert self.disk is not None
        self.retention.track_many([e for e in entries if e.deadline > 0])
        before = len(self.index)
        self.index.add_many(entries)
        self.disk.adopt_many(entries)
        self._adopted(entries, all_indexed=len(self.index) - before == len(entries))

    def retain(self, e: Entry, ttl: float, now: float) -> float | None:
        """Its retention deadline to now + ttl if later (deadlines only extend); None: the namespace's
        retained-bytes cap refuses it (nothing changes)."""
        deadline = self.retention.extend_to(e, now + ttl, now)
        if deadline is None:
            return None
        if deadline != e.deadline:
            e.deadline = deadline
            if self.index.holds(e):  # (a block forgotten since its caller found it keeps no retained bytes)
                self.retention.counted(e, now)
            if in_host_tier(e):  # its tiers' retained counts: a new expiry
                self.host.counts.retained.add(e)
            if e.disk == DiskState.ON_DISK:
                self._disk_counts.retained.add(e)
        if self.disk is not None:  # on disk: into the retained order (evicted by deadline, after the unmarked)
            self.disk.mark_retained(e)
        return deadline

    # --- prefetch leases
    def lease(self, owner: SessionId, e: Entry, now: float, seconds: float, staged: bool) -> int:
        """Lease e to owner until now + seconds; returns the bytes it adds to owner's leases. Only for
        a block whose lease is not running (an ended one not yet reaped is ended first)."""
        return self.lease_many(owner, [e], now, seconds, staged)

    def lease_many(self, owner: SessionId, entries: Sequence[Entry], now: float, seconds: float,
                   staged: bool) -> int:
        """lease() for a batch of distinct entries, with one expiry item for all of them."""
        book = self.leases
        held = book.entries
        until = now + seconds
        mine = book.by_owner.setdefault(owner, {})
        total = 0
        host_leased: list[Entry] = []  # tier members pinned by their lease alone: the tiers' leased counts
        disk_leased: list[Entry] = []
        has_disk, on_disk = self.disk is not None, DiskState.ON_DISK
        for e in entries:
            if id(e) in held:
                self.end_lease(e, used=False)
            e.lease_until = until
            e.lease_owner = owner
            held[id(e)] = (e, staged)
            mine[id(e)] = e
            total += e.size
            if not e.pins:  # (in_host_tier(e) of an entry with no pin: slot >= 0 and not staged, as in pin())
                if e.slot >= 0 and not e.staged:
                    host_leased.append(e)
                if has_disk and e.disk is on_disk:
                    disk_leased.append(e)
        self.host.counts.leased.add_batch(host_leased, until)
        self._disk_counts.leased.add_batch(disk_leased, until)
        if not mine:
            del book.by_owner[owner]
        if entries:
            book.total_bytes += total
            book.bytes_by_owner[owner] = book.bytes_by_owner.get(owner, 0) + total
            book._seq += 1
            heapq.heappush(book._expiry, (until, book._seq, list(entries)))
        return total

    def end_lease(self, e: Entry, used: bool) -> None:
        book = self.leases
        held = book.entries.pop(id(e), None)
        if held is None:
            return
        book.total_bytes -= e.size
        if held[1]:
            self.stats.bump(e.namespace, "prefetch_used" if used else "prefetch_wasted")
        owner = SessionId(e.lease_owner)
        left = book.bytes_by_owner.get(owner, 0) - e.size
        if left > 0:
            book.bytes_by_owner[owner] = left
        else:
            book.bytes_by_owner.pop(owner, None)
        mine = book.by_owner.get(owner)
        if mine is not None:
            mine.pop(id(e), None)
            if not mine:
                del book.by_owner[owner]
        e.lease_until = 0.0
        e.lease_owner = ""
        for leased in self._leased:  # (TierCounts.leased.discard, inlined)
            leased.pop(id(e), None)

    def loaded(self, owner: SessionId, entries: Sequence[Entry]) -> None:
        """A Load by owner served these blocks: reuse counted; the leases it holds on them did their job."""
        for e in entries:
            e.reuse += 1
        mine = self.leases.by_owner.get(owner)
        if not mine:
            return
        for e in entries:
            if id(e) in mine:
                self.end_lease(e, used=True)

    def end_leases_of(self, owner: SessionId) -> None:
        """The owner's session closed: its leases end now."""
        for e in list(self.leases.by_owner.get(owner, {}).values()):
            self.end_lease(e, used=False)

    def end_expired_leases(self, now: float) -> None:
        heap = self.leases._expiry
        entries = self.leases.entries
        while heap and heap[0][0] <= now:
            for e in heapq.heappop(heap)[2]:
                if id(e) in entries and e.lease_until <= now:  # not ended early, not leased again since
                    self.end_lease(e, used=False)

    # --- the Stats counts (kvservice.placement.tier_counts) follow a block's state
    def _where(self, e: Entry) -> int:
        """Which counts e is in: 1 a host tier member, 2 a slot on the host tier's capacity, 4 on disk."""
        return ((in_host_tier(e) and 1) | (e.host_buf is not None and 2) | (e.disk == DiskState.ON_DISK and 4))

    def _moved(self, e: Entry, was: int) -> None:
        """e changed state (was: _where(e) before); its pins, lease and deadline did not."""
        now = self._where(e)
        diff = now ^ was
        if not diff:
            return
        if diff & 1:
            (self.host.counts.join if now & 1 else self.host.counts.leave)(e)
        if diff & 4:
            (self._disk_counts.join if now & 4 else self._disk_counts.leave)(e)
        if diff & 6 and self.index.holds(e):  # the namespace's figures are over indexed entries
            if diff & 2:
                self.ns_counts.host(e.namespace, 1 if now & 2 else -1, e.size if now & 2 else -e.size)
            if diff & 4:
                self.ns_counts.disk(e.namespace, 1 if now & 4 else -1, e.size if now & 4 else -e.size)

    def _unindexed(self, e: Entry) -> None:
        """e is about to leave the index: its slot and disk copy no longer count for its namespace."""
        if not self.index.holds(e):
            return
        if e.host_buf is not None:
            self.ns_counts.host(e.namespace, -1, -e.size)
        if e.disk == DiskState.ON_DISK:
            self.ns_counts.disk(e.namespace, -1, -e.size)

    def _left_host_plain(self, plain: Sequence[Entry], size: int,
                         by_ns: Mapping[NamespaceId, int] | None = None) -> None:
        """evict_many's plain victims (resident, indexed, unpinned, of one size) left the host tier.
        by_ns: the count per namespace of all of them, when the caller has it (drop_plain's: `plain`
        then holds only those with a lease or a deadline)."""
        counts = self.host.counts
        leased, retained = counts.leased.live, counts.retained.live
        if leased or retained:
            for e in plain:
                if e.lease_until:
                    leased.pop(id(e), None)
                if e.deadline:
                    retained.pop(id(e), None)
        if by_ns is not None:
            for ns, k in by_ns.items():
                self.ns_counts.host(ns, -k, -k * size)
            return
        ns = plain[0].namespace
        if countOf(map(_namespace_of, plain), ns) == len(plain):  # (the usual batch: one namespace)
            self.ns_counts.host(ns, -len(plain), -len(plain) * size)
        else:
            for ns, k in Counter(map(_namespace_of, plain)).items():
                self.ns_counts.host(ns, -k, -k * size)

    def _adopted(self, entries: Sequence[Entry], all_indexed: bool) -> None:
        """Blocks found on disk at restart joined the index and the disk tier (no pin, no lease)."""
        self._disk_counts.retained.add_many([e for e in entries if e.deadline > 0])
        if not all_indexed:  # the same key twice: only the one indexed counts for its namespace
            holds = self.index.holds
            for e in entries:
                if e.deadline > 0 and not holds(e):
                    self.retention.forget(e)
            entries = [e for e in entries if holds(e)]
        sizes = set(map(_size_of, entries))
        if len(sizes) == 1:
            size = sizes.pop()
            for ns, k in Counter(map(_namespace_of, entries)).items():
                self.ns_counts.disk(ns, k, k * size)
        else:
            for e in entries:
                self.ns_counts.disk(e.namespace, 1, e.size)

    # --- invariants
    def audit(self, owners: set[SessionId], idle: bool = True) -> list[str]:
        """What is inconsistent, in words (empty: nothing). With idle=False (a call may be in
        flight) only the room and lease books are checked, which hold at every await point."""
        host = self.host
        problems: list[str] = []
        entries = list(self.index.values())
        aborted = list(self.aborted.values())
        if idle:
            half = [e for e in entries if not e.ready]
            if half:
                problems.append(f"{len(half)} entries reserved but never committed")
            if aborted:
                problems.append(f"{len(aborted)} rolled-back reservations still hold their slots")
            pinned = [e for e in entries if e.pins]
            if pinned:
                problems.append(f"{len(pinned)} entries still pinned by copies or reads")
            if self.releasing:
                problems.append(f"{len(self.releasing)} released blocks still wait for an unpin")
            if host.loose_bytes:
                problems.append(f"{host.loose_bytes} bytes of host slots taken for reads that never settled")
        book = self.leases
        orphans = [e for e, _ in book.entries.values() if e.lease_owner not in owners]
        if orphans:
            problems.append(f"{len(orphans)} prefetch leases held by no open session")
        leased = sum(e.size for e, _ in book.entries.values())
        by_owner = sum(e.size for d in book.by_owner.values() for e in d.values())
        if not leased == book.total_bytes == sum(book.bytes_by_owner.values()) == by_owner:
            problems.append(f"prefetch leases account {book.total_bytes} bytes, they hold {leased}")
        # every holder of a slot: indexed blocks, rolled-back reservations, spills and pinned
        # releases of blocks already forgotten
        held = {id(e): e for e in entries}
        for more in (aborted, self.releasing.values(), host.spilling.values()):
            held.update((id(e), e) for e in more)
        on_tier = sum(e.size for e in held.values() if e.host_buf is not None)
        if on_tier + host.loose_bytes != host.used_bytes or host.loose_bytes < 0:
            problems.append(f"host tier accounts {host.used_bytes} bytes, its blocks hold {on_tier} "
                            f"(and reads in flight {host.loose_bytes})")
        staged = sum(e.size for e in held.values() if e.staged)
        if staged != host.staged_bytes or staged > host.staging_bytes:
            problems.append(f"spill staging accounts {host.staged_bytes} bytes, its spills hold {staged}")
        slots = sum(e.size for e in held.values() if e.slot >= 0) + host.loose_bytes
        if slots != host.arena.used_bytes:
            problems.append(f"arena has {host.arena.used_bytes} bytes of slots taken, blocks hold {slots}")
        problems += host.arena.audit()
        return problems

