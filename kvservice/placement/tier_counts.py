"""The figures Admin.Stats and the /metrics scrape report, kept incrementally: a Stats call costs
O(namespaces + sessions + tiers), never a walk of the index or of a tier (with 65k host blocks that
walk held the event loop ~45 ms a scrape, every engine's Store / Load / Lookup waiting behind it).

  TierCounts        one per tier (HostTier.counts, DiskTier.counts), over the tier's members (the
                    host tier: its LRU and its unstaged spills; the disk tier: its ON_DISK blocks):
                    pinned_blocks(now) (pins > 0 or a lease running), retained_blocks(now) (deadline > now)
  NamespaceCounts   per namespace, over indexed entries: host blocks / bytes (slots on the host
                    tier's capacity: entry.host_buf), disk blocks / bytes (ON_DISK)
Time-dependent counts (a lease's end, a retention deadline) are ExpiringCounts: the members whose
time is after `now`, settled lazily when read, as retention.Retention keeps retained bytes. Pure
bookkeeping: kvservice.core.lifecycle calls these where a block changes state, and
BlockCache.audit checks them against the walk they replace.
`now` must not go back between reads: an entry that expired at one read is not counted again.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from operator import attrgetter

from kvservice.placement.index import Entry
from kvservice.core.types import NamespaceId

_lease_until = attrgetter("lease_until")
_deadline = attrgetter("deadline")


class ExpiringCount:
    """Entries counted while a time of theirs (time_of(e): a deadline, a lease's end) is after now.
    `live` holds the entries added and not discarded whose time had not passed at the last count();
    a heap of (time, seq, entries) drops entries once their time passes (one whose time moved since
    is skipped: a later item has it). The caller add()s an entry when it becomes a member and
    whenever its time changes while it is one, and discard()s it when it stops being one."""

    __slots__ = ("live", "_heap", "_seq", "_time_of")

    def __init__(self, time_of) -> None:
        self.live: dict[int, Entry] = {}  # id(entry) -> entry
        self._heap: list[tuple[float, int, Sequence[Entry]]] = []
        self._seq = 0
        self._time_of = time_of

    def add(self, e: Entry) -> None:
        t = self._time_of(e)
        if t > 0:  # (0: no deadline, no lease)
            self.live[id(e)] = e
            self._push(t, (e,))

    def add_batch(self, entries: list[Entry], t: float) -> None:
        """add() for entries whose time is t (a batch leased together): one heap item."""
        if entries and t > 0:
            self.live.update(zip(map(id, entries), entries))
            self._push(t, entries)

    def add_many(self, entries: Sequence[Entry]) -> None:
        """add() for many of various times (a restart's adopted blocks): one heapify."""
        time_of, heap, live = self._time_of, self._heap, self.live
        for e in entries:
            t = time_of(e)
            if t > 0:
                live[id(e)] = e
                self._seq += 1
                heap.append((t, self._seq, (e,)))
        heapq.heapify(heap)

    def _push(self, t: float, entries: Sequence[Entry]) -> None:
        self._seq += 1
        heap = self._heap
        heapq.heappush(heap, (t, self._seq, entries))
        if len(heap) > 2 * len(self.live) + 1024:  # stale items of moved times and discarded entries
            self._rebuild()

    def discard(self, e: Entry) -> None:
        self.live.pop(id(e), None)

    def count(self, now: float) -> int:
        """How many live entries' time is after now."""
        heap, live, time_of = self._heap, self.live, self._time_of
        while heap and heap[0][0] <= now:
            t, _, entries = heapq.heappop(heap)
            for e in entries:
                if time_of(e) == t:  # its time now (an item of a later time is still in the heap)
                    live.pop(id(e), None)
        return len(live)

    def _rebuild(self) -> None:
        time_of = self._time_of
        self._heap = [(time_of(e), k, (e,)) for k, e in enumerate(self.live.values(), start=self._seq + 1)]
        self._seq += len(self._heap)
        heapq.heapify(self._heap)


class TierCounts:
    """A tier's pinned and retained members. pinned = members with pins > 0 (`pins`, exact) plus
    members without pins whose lease runs (`leased`); retained = members whose deadline is after
    now. The tier's block count and bytes are its own books' (len, used_bytes)."""

    __slots__ = ("pins", "leased", "retained")

    def __init__(self) -> None:
        self.pins = 0
        self.leased = ExpiringCount(_lease_until)
        self.retained = ExpiringCount(_deadline)

    def join(self, e: Entry) -> None:
        """e became a member."""
        if e.pins:
            self.pins += 1
        elif e.lease_until:
            self.leased.add(e)
        if e.deadline:
            self.retained.add(e)

    def leave(self, e: Entry) -> None:
        """e stopped being a member (its pins, lease and deadline as they were while it was)."""
        if e.pins:
            self.pins -= 1
        else:
            self.leased.discard(e)
        if e.deadline:
            self.retained.discard(e)

    def pinned(self, e: Entry) -> None:
        """A member's pins went 0 -> 1."""
        self.pins += 1
        if e.lease_until:
            self.leased.discard(e)

    def unpinned(self, e: Entry) -> None:
        """A member's pins went 1 -> 0."""
        self.pins -= 1
        if e.lease_until:
            self.leased.add(e)

    def pinned_blocks(self, now: float) -> int:
        return self.pins + self.leased.count(now)

    def retained_blocks(self, now: float) -> int:
        return self.retained.count(now)


class NamespaceCounts:
    """Per namespace, over indexed entries: [host blocks, host bytes, disk blocks, disk bytes]
    (host: a slot on the host tier's capacity, entry.host_buf; disk: a complete disk copy)."""

    __slots__ = ("rows",)

    def __init__(self) -> None:
        self.rows: dict[NamespaceId, list[int]] = {}

    def row(self, ns: NamespaceId) -> list[int]:
        r = self.rows.get(ns)
        if r is None:
            r = self.rows[ns] = [0, 0, 0, 0]
        return r

    def host(self, ns: NamespaceId, blocks: int, nbytes: int) -> None:
        r = self.row(ns)
        r[0] += blocks
        r[1] += nbytes

    def disk(self, ns: NamespaceId, blocks: int, nbytes: int) -> None:
        r = self.row(ns)
        r[2] += blocks
        r[3] += nbytes

    def get(self, ns: NamespaceId) -> tuple[int, int, int, int]:
        r = self.rows.get(ns)
        return (r[0], r[1], r[2], r[3]) if r is not None else (0, 0, 0, 0)
