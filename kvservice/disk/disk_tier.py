"""Disk tier bookkeeping: bytes used, and the two orders eviction reads (an LRU of unmarked
blocks, and retained blocks by deadline). A book: it never changes an entry; the disk-copy state
transitions (entry.disk NONE -> QUEUED -> ON_DISK -> NONE) are kvservice.core.lifecycle's, which
keep this book in step.

Primitives:
  reserve(entry) / unreserve(entry)   account bytes of a spill queued for writing
  commit(entry)                       its bytes are written: counted on disk, in an eviction order
  adopt_many(entries)                 complete blocks found at restart
  release(entry)                      its disk copy is gone (evicted, corrupt, admin)
  touch(chain) / mark_retained(e)     refresh LRU order; move an entry to the retained order
The bytes themselves are written and read by kvservice.core.tiers through the disk store.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvservice.placement.index import DiskState, Entry
from kvservice.placement.lru import ChainLRU
from kvservice.placement.tier_counts import TierCounts


class DiskTier:
    name = "disk"

    def __init__(self, root: str, capacity_bytes: int) -> None:
        self.root = root
        self.capacity_bytes = capacity_bytes  # what the operator configured (reported in Stats)
        # what blocks may occupy: the capacity less what the tier's own metadata may take (disk
        # tier v2 lowers it at open; its per-slot share is met by evicting a little more)
        self.budget_bytes = capacity_bytes
        self.used_bytes = 0  # complete files plus reserved in-flight writes
        self.unmarked = ChainLRU()  # on disk, never retained
        self.retained: dict[int, Entry] = {}  # on disk with a deadline (expired or not), by id()
        self.queued: dict[int, Entry] = {}  # reserved spills not yet written, in spill order
        self._on_disk = 0
        self.counts = TierCounts()  # pinned and retained members, for Stats (kept by kvservice.core.lifecycle)

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes

    def __len__(self) -> int:
        return self._on_disk

    def entries(self):
        yield from self.unmarked.values()
        yield from self.retained.values()

    def reserve(self, entry: Entry) -> None:
        self.used_bytes += entry.size
        assert self.used_bytes <= self.budget_bytes, "disk tier over capacity"
        self.queued[id(entry)] = entry

    def unreserve(self, entry: Entry) -> bool:
        """False when entry's room was not reserved (given back already)."""
        if self.queued.pop(id(entry), None) is None:
            return False
        self.used_bytes -= entry.size
        return True

    def adopt_many(self, entries: Sequence[Entry]) -> None:
        """Complete blocks found at restart, oldest first, made with disk=ON_DISK, in a few
        comprehensions (a 1M-block restart spends its time in loops like these)."""
        assert not entries or entries[0].disk == DiskState.ON_DISK, "adopt_many takes ON_DISK entries"
        self.used_bytes += sum([e.size for e in entries])
        self.retained.update({id(e): e for e in entries if e.deadline > 0})
        self._on_disk += len(entries)
        self.unmarked.append_newest([e for e in entries if e.deadline <= 0])

    def commit(self, entry: Entry) -> None:
        del self.queued[id(entry)]
        self._on_disk += 1
        if entry.deadline > 0:
            self.retained[id(entry)] = entry
        else:
            self.unmarked.touch([entry])

    def commit_many(self, entries: Sequence[Entry]) -> None:
        """commit() for each, in order (the unmarked ones newest in that order), as batch passes."""
        queued = self.queued
        for e in entries:
            del queued[id(e)]
        self._on_disk += len(entries)
        self.retained.update({id(e): e for e in entries if e.deadline > 0})
        plain = [e for e in entries if e.deadline <= 0]
        if plain:
            self.unmarked.touch(plain[::-1])  # touch() makes its chain's head newest: the last one here

    def release(self, entry: Entry) -> None:
        self._on_disk -= 1
        self.used_bytes -= entry.size
        self.unmarked.discard(entry)
        self.retained.pop(id(entry), None)

    def touch(self, chain: Sequence[Entry]) -> None:
        self.unmarked.touch([e for e in chain if e in self.unmarked])

    def mark_retained(self, entry: Entry) -> None:
        if entry.disk == DiskState.ON_DISK and entry in self.unmarked:
            self.unmarked.discard(entry)
            self.retained[id(entry)] = entry
