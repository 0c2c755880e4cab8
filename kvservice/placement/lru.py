"""An LRU order over entries where the tail of a chain is evicted before its head.

Callers pass a batch in chain order (head first); `touch` makes the head the most recent,
so when a whole chain ages out its last block goes first and the prefix survives longest.
Keyed by the entry itself (identity hash: no key tuple hashed per block).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from itertools import repeat

from kvservice.placement.index import Entry


class ChainLRU:
    """A plain dict in insertion order (oldest first): inserting and popping a batch cost about half
    of an OrderedDict's, which a Store pays per new block and per victim. A refresh moves entries
    to the end by popping and re-inserting them as one batch; the holes popped entries leave at the
    front are skipped by C code when the oldest are walked, and dropped when the dict resizes."""

    def __init__(self) -> None:
        self._order: dict[Entry, Entry] = {}

    def touch(self, chain: Sequence[Entry]) -> None:
        """Insert or refresh entries given head first; the head ends up most recent."""
        self._to_end(chain[::-1])

    def _to_end(self, rev: Sequence[Entry]) -> None:
        """Move (or add) entries to the newest end, in the order given: the last one newest."""
        order = self._order
        pop = order.pop
        deque(map(pop, rev, repeat(None)), 0)  # the pops called from C: no bytecode a block
        before = len(order)
        order.update(zip(rev, rev))
        if len(order) - before < len(rev):  # an entry twice: each occurrence moves it to the end in turn
            for e in rev:
                pop(e, None)
                order[e] = e

    def add_new(self, chain: Sequence[Entry]) -> None:
        """touch() for entries not in the order (a Store's new blocks), head first: one update."""
        rev = chain[::-1]
        self._order.update(zip(rev, rev))

    def touch_present(self, chain: Sequence[Entry]) -> None:
        """Refresh those of the entries (head first) that are in the order; others are left out."""
        self._to_end(list(filter(self._order.__contains__, reversed(chain))))

    def append_newest(self, entries: Sequence[Entry]) -> None:
        """Add entries not yet in the order, oldest first, as the most recent (restart, in one pass)."""
        self._order.update((e, e) for e in entries)

    def discard(self, entry: Entry) -> None:
        self._order.pop(entry, None)

    def discard_many(self, entries: Iterable[Entry]) -> None:
        deque(map(self._order.pop, entries, repeat(None)), 0)

    def __contains__(self, entry: Entry) -> bool:
        return entry in self._order

    def __len__(self) -> int:
        return len(self._order)

    def oldest_first(self) -> Iterator[Entry]:
        # no copy: callers plan first and evict after (mutating while iterating raises, loudly)
        return iter(self._order.values())

    def values(self) -> Iterable[Entry]:
        return self._order.values()


class _Gone:
    """Stands in a StampLRU group for a reference trimmed off its front: never a valid position."""

    __slots__ = ()
    lru_pos = -1


_GONE = _Gone()


def _gone(n: int) -> list:
    return [_GONE] * n


# StampLRU rebuilds its groups once they hold more than STALE_RATIO references a member: a rebuild walks
# every member, so it runs once per (STALE_RATIO - 1) x members refreshes. At 2 it took 8.5% of a Load's
# bookkeeping (64 KiB x 32768, three such batches loaded in turn, CPU box); at 4 a third of that, for at
# most 4 list slots (32 bytes) a member.
STALE_RATIO = 4


class StampLRU:
    """ChainLRU's order and interface with no dict: each member carries its own position, an int
    field of the entry (`lru_pos`, 0: not a member), and the order is a deque of groups - one per
    touch / add, the entries in the order they were appended (oldest first) - whose members are
    valid where entry.lru_pos still names their place (base of the group + index). A refresh writes
    one int per entry and appends one group; what it leaves behind in older groups is stale and
    skipped. Why: a dict keyed by entry costs a hashed insert (and a pop, on refresh) per block on
    a ~100k-entry table that misses the CPU caches; this writes the entry the caller just touched.
    Stale references are dropped from the front as the oldest go (trim, amortised O(1)) and by a
    rebuild once they outnumber the members (compact, amortised O(1) a refresh).
    One entry belongs to at most one StampLRU (the host tier's); the disk tier keeps a ChainLRU."""

    __slots__ = ("_groups", "_next", "_count", "_refs", "_version")

    def __init__(self) -> None:
        self._groups: deque[list] = deque()  # [base, members, first index not known stale]
        self._next = 1  # the next position handed out (0 means "not a member")
        self._count = 0
        self._refs = 0  # references held by the groups, stale ones included
        self._version = 0  # bumped by every change: an iteration across one raises, as a dict's would

    def _append(self, members: list[Entry]) -> None:
        """Append members (oldest first, each at most once as a valid position: a later occurrence
        overrides an earlier one, as moving it to the end again would)."""
        if not members:
            return
        base = self._next
        added = 0
        for i, e in enumerate(members, base):
            if not e.lru_pos:
                added += 1
            e.lru_pos = i
        self._next = base + len(members)
        self._count += added
        self._groups.append([base, members, 0])
        self._refs += len(members)
        self._version += 1
        if self._refs > STALE_RATIO * self._count + 4096:
            self._compact()

    def touch(self, chain: Sequence[Entry]) -> None:
        """Insert or refresh entries given head first; the head ends up most recent."""
        self._append(chain[::-1])

    add_new = touch  # ChainLRU's shortcut for entries not in the order: here the same append

    def touch_present(self, chain: Sequence[Entry]) -> None:
        """Refresh those of the entries (head first) that are in the order; others are left out."""
        self._append([e for e in reversed(chain) if e.lru_pos])

    def append_newest(self, entries: Sequence[Entry]) -> None:
        """Add entries not yet in the order, oldest first, as the most recent."""
        self._append(list(entries))

    def discard(self, entry: Entry) -> None:
        if entry.lru_pos:
            entry.lru_pos = 0
            self._count -= 1
            self._version += 1
            self._trim()

    def discard_many(self, entries: Iterable[Entry]) -> None:
        gone = 0
        for e in entries:
            if e.lru_pos:
                e.lru_pos = 0
                gone += 1
        if gone:
            self._count -= gone
            self._version += 1
            self._trim()

    def take_oldest(self, want: int, now: float) -> list[Entry]:
        """Up to `want` of the oldest members that may be evicted now (no pin, no lease running at
        `now`: Entry.pinned), taken out of the order in the same walk, oldest first. What a walk of
        oldest_first() filtered, then discard_many() of the result and its _trim, do with three
        passes over the victims: here each victim is read and written once, and the groups' fronts
        move past the taken ones as the walk goes. CPU box (bench/lru_evict_probe.py: 2048 victims
        at a time from two 32768-member batches that a Load refreshed, each member's older reference
        stale): 710-1231 ns a victim for the three passes, 444-752 for this walk and its trim (the
        trim still steps over the stale references once). Members skipped (pinned) keep their places."""
        out: list[Entry] = []
        if want <= 0 or not self._count:
            return out
        add = out.append
        groups = self._groups
        gi = 0
        taken = 0
        front = True  # no member kept (skipped) before this point of the walk: the fronts may move
        while gi < len(groups) and taken < want:
            g = groups[gi]
            base, members, start = g
            n = len(members)
            i = start
            while i < n:
                e = members[i]
                if e.lru_pos == base + i:
                    if e.pins or e.lease_until > now:
                        if front:  # the group's front stops at its first kept member
                            front = False
                            self._refs -= i - g[2]
                            members[g[2]:i] = _gone(i - g[2])
                            g[2] = i
                    else:
                        e.lru_pos = 0
                        add(e)
                        taken += 1
                        if taken == want:
                            i += 1
                            break
                i += 1
            if front:
                if i < n:
                    self._refs -= i - g[2]
                    members[g[2]:i] = _gone(i - g[2])
                    g[2] = i
                else:  # the whole group went
                    groups.popleft()
                    self._refs -= n - g[2]
                    continue  # (gi stays 0: the next group is at the front now)
            gi += 1
        if taken:
            self._count -= taken
            self._version += 1
            self._trim()  # (from the front: stale references the walk's fronts left, e.g. behind a kept member)
        return out

    def _trim(self) -> None:
        """Drop the stale references at the front (the oldest went first: eviction's usual case)."""
        groups = self._groups
        while groups:
            g = groups[0]
            base, members, i = g
            n = len(members)
            while i < n and members[i].lru_pos != base + i:
                i += 1
            if i < n:
                if i > g[2]:
                    self._refs -= i - g[2]
                    # the stale front lets go of its entries now, not when the whole group has gone:
                    # an evicted block's entry is freed as it leaves (its memory reused by the next
                    # Store's entries), not with the rest of its Store's batch in one burst
                    members[g[2]:i] = _gone(i - g[2])
                    g[2] = i
                break
            groups.popleft()
            self._refs -= n - g[2]
        if self._refs > STALE_RATIO * self._count + 4096:  # stale ones left in the middle (refreshed entries)
            self._compact()

    def _compact(self) -> None:
        """One group of the members in order, at fresh positions."""
        live = list(self._members())
        self._groups.clear()
        self._refs = 0
        self._count = 0
        for e in live:
            e.lru_pos = 0
        self._append(live)

    def _members(self, version: int | None = None) -> Iterator[Entry]:
        """The members, oldest first; with `version` (the order's at the call), a change of the
        order meanwhile raises RuntimeError when the walk goes on."""
        for base, members, start in self._groups:
            if version is not None and self._version != version:
                raise RuntimeError("StampLRU changed during iteration")
            for i in range(start, len(members)):
                e = members[i]
                if e.lru_pos == base + i:
                    yield e
        if version is not None and self._version != version:
            raise RuntimeError("StampLRU changed during iteration")

    def __contains__(self, entry: Entry) -> bool:
        return entry.lru_pos != 0

    def __len__(self) -> int:
        return self._count

    def oldest_first(self) -> Iterator[Entry]:
        """Members, oldest first. Callers plan first and change the order after: a change while
        this runs raises RuntimeError (as iterating a dict that changed size does)."""
        return self._members(self._version)

    def values(self) -> Iterable[Entry]:
        return self._members()
