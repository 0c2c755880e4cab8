"""Retention bookkeeping: per-block TTL deadlines that only ever extend, and the per-namespace
cap on retained bytes. Pure bookkeeping; the caller supplies `now`.

Expired blocks are not deleted: they simply stop counting as retained (DESIGN §5).
"""

from __future__ import annotations

import math

from kvservice.index import Entry
from kvservice.types import BlockKey, CacheError, ErrorCode, NamespaceId


class Retention:
    def __init__(self, max_ttl_seconds: float, cap_bytes: int) -> None:
        self.max_ttl = max_ttl_seconds
        self.cap_bytes = cap_bytes  # per namespace; 0: no cap
        self._by_ns: dict[NamespaceId, dict[BlockKey, Entry]] = {}

    def clamp_ttl(self, ttl_seconds: float) -> float:
        if not math.isfinite(ttl_seconds) or ttl_seconds < 0:
            raise CacheError(ErrorCode.INVALID_ARGUMENT, f"ttl_seconds must be a finite number >= 0, got {ttl_seconds}")
        return min(ttl_seconds, self.max_ttl)

    def retained_bytes(self, ns: NamespaceId, now: float) -> int:
        return sum(e.size for e in self._by_ns.get(ns, {}).values() if e.deadline > now)

    def extend(self, entry: Entry, ttl: float, now: float) -> float | None:
        """Move the deadline to now + ttl if later. Returns the deadline, or None if the cap refuses."""
        new = now + ttl
        if new <= entry.deadline:
            return entry.deadline
        if self.cap_bytes and not entry.retained(now):
            if self.retained_bytes(entry.namespace, now) + entry.size > self.cap_bytes:
                return None
        entry.deadline = new
        self._by_ns.setdefault(entry.namespace, {})[entry.key] = entry
        return new

    def track(self, entry: Entry) -> None:
        """Account an entry whose deadline came from disk at recovery."""
        if entry.deadline > 0:
            self._by_ns.setdefault(entry.namespace, {})[entry.key] = entry

    def forget(self, entry: Entry) -> None:
        ns = self._by_ns.get(entry.namespace)
        if ns is not None and ns.get(entry.key) is entry:
            del ns[entry.key]
