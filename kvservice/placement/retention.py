"""Retention bookkeeping: per-block TTL deadlines that only ever extend, and the per-namespace
cap on retained bytes. Pure bookkeeping; the caller supplies `now`.

Expired blocks are not deleted: they simply stop counting as retained (DESIGN §5).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence

from kvservice.placement.index import Entry
from kvservice.core.types import BlockKey, CacheError, ErrorCode, NamespaceId


class Retention:
    """Deadlines and the per-namespace retained-bytes cap, kept incrementally: each namespace has
    the bytes of its blocks whose deadline had not passed at the last look, and a heap of
    (deadline, seq, entry) that drops a block's bytes once its deadline passes. A Store of n
    retained blocks under a cap costs O(n log n), never a walk of the namespace per block."""

    def __init__(self, max_ttl_seconds: float, cap_bytes: int) -> None:
        self.max_ttl = max_ttl_seconds
        self.cap_bytes = cap_bytes  # per namespace; 0: no cap
        self._by_ns: dict[NamespaceId, dict[BlockKey, Entry]] = {}
        self._counted: dict[NamespaceId, dict[int, Entry]] = {}  # id(entry) -> entry, while its bytes count
        self._bytes: dict[NamespaceId, int] = {}
        self._heap: dict[NamespaceId, list[tuple[float, int, Entry]]] = {}
        self._seq = itertools.count()

    def clamp_ttl(self, ttl_seconds: float) -> float:
        if not math.isfinite(ttl_seconds) or ttl_seconds < 0:
            raise CacheError(ErrorCode.INVALID_ARGUMENT, f"ttl_seconds must be a finite number >= 0, got {ttl_seconds}")
        return min(ttl_seconds, self.max_ttl)

    def retained_bytes(self, ns: NamespaceId, now: float) -> int:
        """Bytes of the namespace's blocks whose deadline is after now."""
        heap = self._heap.get(ns)
        if heap:
            counted = self._counted[ns]
            while heap and heap[0][0] <= now:
                deadline, _, e = heapq.heappop(heap)
                # a deadline that moved later has a newer heap item; a forgotten entry no longer counts
                if e.deadline == deadline and counted.pop(id(e), None) is not None:
                    self._bytes[ns] -= e.size
        return self._bytes.get(ns, 0)

    def extend_to(self, entry: Entry, new: float, now: float) -> float | None:
        """The deadline entry gets when asked to be retained until `new`: `new` if later than its
        own, else its own; None when the namespace's cap refuses it. Changes nothing: the caller
        (kvservice.core.lifecycle.Lifecycle.retain) moves the deadline, then calls counted()."""
        if new <= entry.deadline:
            return entry.deadline
        if self.cap_bytes and not entry.retained(now):
            if self.retained_bytes(entry.namespace, now) + entry.size > self.cap_bytes:
                return None
        return new

    def counted(self, entry: Entry, now: float) -> None:
        """entry.deadline was just moved later: its bytes count until it passes."""
        self._by_ns.setdefault(entry.namespace, {})[entry.key] = entry
        self._count(entry, now)

    def track(self, entry: Entry) -> None:
        """Account an entry whose deadline came from disk at recovery."""
        if entry.deadline > 0:
            self._by_ns.setdefault(entry.namespace, {})[entry.key] = entry
            self._count(entry, -math.inf)

    def track_many(self, entries: list[Entry]) -> None:
        """track() for many entries found on disk at recovery: one heapify per namespace instead
        of a push per entry (a 1M-block restart has ~150k retained ones)."""
        for e in entries:
            if e.deadline > 0:
                ns = e.namespace
                self._by_ns.setdefault(ns, {})[e.key] = e
                counted = self._counted.setdefault(ns, {})
                if id(e) not in counted:
                    counted[id(e)] = e
                    self._bytes[ns] = self._bytes.get(ns, 0) + e.size
                self._heap.setdefault(ns, []).append((e.deadline, next(self._seq), e))
        for heap in self._heap.values():
            heapq.heapify(heap)

    def forget(self, entry: Entry) -> None:
        ns = self._by_ns.get(entry.namespace)
        if ns is not None and ns.get(entry.key) is entry:
            del ns[entry.key]
        counted = self._counted.get(entry.namespace)
        if counted is not None and counted.pop(id(entry), None) is not None:
            self._bytes[entry.namespace] -= entry.size

    def forget_many(self, entries: Sequence[Entry]) -> None:
        """forget() for each; entries never retained (deadline 0) cost one comparison."""
        for e in entries:
            if e.deadline:
                self.forget(e)

    def _count(self, entry: Entry, now: float) -> None:
        """entry.deadline was just set (later than before): its bytes count until it passes."""
        ns = entry.namespace
        counted = self._counted.setdefault(ns, {})
        if entry.deadline > now and id(entry) not in counted:
            counted[id(entry)] = entry
            self._bytes[ns] = self._bytes.get(ns, 0) + entry.size
        heap = self._heap.setdefault(ns, [])
        heapq.heappush(heap, (entry.deadline, next(self._seq), entry))
        if len(heap) > 2 * len(counted) + 1024:  # superseded items of re-retained blocks: rebuild
            heap[:] = [(e.deadline, next(self._seq), e) for e in counted.values()]
            heapq.heapify(heap)
