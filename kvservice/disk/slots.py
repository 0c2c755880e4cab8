"""Slot allocation over segment files: pure bookkeeping, no I/O.

A location is one int, `loc = segment << 32 | slot` (`make_loc`, `split_loc`). Every segment
holds slots of one size (its class: the block length rounded up to ALIGN bytes).

Primitives:
  allocate(slot_bytes, n) -> locs | None   n free slots of the class, lowest first (adjacent slots
                                           coalesce into one request); may plan new segments
                                           within the budget; None (nothing changed) if they
                                           do not fit
  release(locs)                            slots of writes that never committed: free at once
  retire(locs) / settle(locs)              a committed block leaves: its slot is quarantined until
                                           the metadata delete has committed, then free again
  allocate_retired(slot_bytes, n)          like allocate, falling back on quarantined slots, handed
                                           out as pending (their delete not committed yet): the
                                           writer commits the deletes before writing (pending(loc))
  planned() / created(seg) / drop(seg)     segments chosen but not yet on disk; a segment file
                                           that could not be made, or became unusable
  reclaimable()                            empty segments whose files may be removed

A slot is never written while its old metadata row may still be on disk (the quarantine; a
pending slot is reserved but its writer commits the delete first), so a crash can never pair a
surviving row with bytes a later block wrote into the same slot.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

ALIGN = 4096  # O_DIRECT granularity used for offsets, lengths and buffer addresses
_SLOT_BITS = 32


def make_loc(seg: int, slot: int) -> int:
    return seg << _SLOT_BITS | slot


def split_loc(loc: int) -> tuple[int, int]:
    return loc >> _SLOT_BITS, loc & ((1 << _SLOT_BITS) - 1)


def slot_class(length: int) -> int:
    """The slot size a block of `length` bytes occupies."""
    if length <= 0:
        raise ValueError(f"block length must be positive, got {length}")
    return -(-length // ALIGN) * ALIGN


@dataclass(slots=True)
class Segment:
    id: int
    slot_bytes: int
    slots: int
    used: int = 0
    on_disk: bool = False  # False: planned, its file is made by the first write into it

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * self.slots


@dataclass(slots=True)
class _Class:
    free: list[int] = field(default_factory=list)  # heap of locs


class SlotAllocator:
    """`budget(total_slots_after, segment_bytes_after) -> bool` says whether a new segment may be
    planned (the store charges metadata per slot there); `segment_target` is the preferred file
    size. Not thread-safe: the store calls it under its lock."""

    def __init__(self, budget: Callable[[int, int], bool], segment_target: int) -> None:
        self._budget = budget
        self.segment_target = segment_target
        self.segments: dict[int, Segment] = {}  # change only through _add / _remove (running totals)
        self._nbytes = 0
        self._nslots = 0
        self._empty: set[int] = set()  # ids of segments with no used (or quarantined) slot
        self._classes: dict[int, _Class] = {}
        self._quarantine: set[int] = set()
        self._pending: set[int] = set()  # quarantined slots reserved already (allocate_retired)
        self._retired: dict[int, list[int]] = {}  # per class: heap of quarantined locs (stale entries skipped)
        self._next_id = 1

    # --- state
    @property
    def segment_bytes(self) -> int:
        return self._nbytes

    @property
    def total_slots(self) -> int:
        return self._nslots

    def _add(self, seg: Segment) -> None:
        self.segments[seg.id] = seg
        self._nbytes += seg.nbytes
        self._nslots += seg.slots
        if seg.used == 0:
            self._empty.add(seg.id)

    def _remove(self, seg_id: int) -> Segment | None:
        seg = self.segments.pop(seg_id, None)
        self._empty.discard(seg_id)
        if seg is not None:
            self._nbytes -= seg.nbytes
            self._nslots -= seg.slots
        return seg

    @property
    def used_bytes(self) -> int:
        return sum(s.used * s.slot_bytes for s in self.segments.values())

    def free_slots(self, slot_bytes: int) -> int:
        c = self._classes.get(slot_bytes)
        return len(c.free) if c else 0

    def quarantined(self) -> int:
        """Quarantined slots no reservation holds yet."""
        return len(self._quarantine) - len(self._pending)

    def pending(self, loc: int) -> bool:
        """A reserved slot whose previous block's delete has not committed: commit before writing."""
        return loc in self._pending

    def can_grow(self, slot_bytes: int) -> bool:
        """Whether the budget admits at least one more slot of this class, reclaiming nothing."""
        return self._budget(self.total_slots + 1, self.segment_bytes + slot_bytes)

    # --- building from metadata at open
    def add_segment(self, seg_id: int, slot_bytes: int, slots: int, used: Iterable[int] | np.ndarray) -> None:
        """A segment that exists on disk; `used` are its occupied slots."""
        seg = Segment(seg_id, slot_bytes, slots, on_disk=True)
        taken = np.zeros(slots, dtype=bool)
        taken[np.asarray(used, dtype=np.int64)] = True
        seg.used = int(taken.sum())
        self._add(seg)
        c = self._classes.setdefault(slot_bytes, _Class())
        c.free.extend((np.flatnonzero(~taken) + (seg_id << _SLOT_BITS)).tolist())
        heapq.heapify(c.free)
        self._next_id = max(self._next_id, seg_id + 1)

    # --- allocation
    def allocate(self, slot_bytes: int, n: int) -> list[int] | None:
        if n <= 0:
            return []
        c = self._classes.setdefault(slot_bytes, _Class())
        short = n - len(c.free)
        if short > 0 and not self._plan(slot_bytes, short):
            return None
        locs = [heapq.heappop(c.free) for _ in range(n)]
        self._take(locs)
        return locs

    def _take(self, locs: list[int]) -> None:
        for loc in locs:
            sid = loc >> _SLOT_BITS
            self.segments[sid].used += 1
            self._empty.discard(sid)

    def allocate_retired(self, slot_bytes: int, n: int) -> list[int] | None:
        """Free slots of the class, then quarantined ones (lowest first, marked pending), then
        allocate() (new segments); None (nothing changed) if none of that adds up. Reusing a
        slot before growing keeps a full tier's spills in the slots its evictions free, with no
        metadata commit before the reservation (the write commits the deletes, once a batch)."""
        c = self._classes.setdefault(slot_bytes, _Class())
        short = n - len(c.free)
        if short <= 0:
            return self.allocate(slot_bytes, n)
        heap = self._retired.get(slot_bytes, [])
        while heap and (heap[0] not in self._quarantine or heap[0] in self._pending):
            heapq.heappop(heap)  # stale: settled, dropped or pending since
        if short > 1:  # the heap may hold stale and repeated entries below its top: count exactly
            if len({loc for loc in heap if loc in self._quarantine and loc not in self._pending}) < short:
                return self.allocate(slot_bytes, n)
        elif not heap:  # a non-empty heap's top is live (cleaned above)
            return self.allocate(slot_bytes, n)
        locs = [heapq.heappop(c.free) for _ in range(min(n, len(c.free)))]
        self._take(locs)
        while len(locs) < n:
            loc = heapq.heappop(heap)
            if loc in self._quarantine and loc not in self._pending:
                self._pending.add(loc)  # still counted in its segment's used slots
                locs.append(loc)
        return locs

    def _plan(self, slot_bytes: int, need: int) -> bool:
        """Plan new segments of this class for `need` slots; all or nothing."""
        planned: list[Segment] = []
        total, nbytes = self.total_slots, self.segment_bytes
        per_file = max(1, self.segment_target // slot_bytes)
        while need > 0:
            slots = per_file if self._budget(total + 1, nbytes + slot_bytes) else 0  # a full tier: at once
            while slots > 0 and not self._budget(total + slots, nbytes + slots * slot_bytes):
                slots //= 2  # the last file may be smaller than the target
            if slots == 0:
                if not self._reclaim_one(exclude=slot_bytes):
                    for seg in planned:  # undo: nothing changed
                        self._remove(seg.id)
                    return False
                total, nbytes = self.total_slots, self.segment_bytes
                continue
            seg = Segment(self._next_id, slot_bytes, slots)
            self._next_id += 1
            self._add(seg)
            planned.append(seg)
            total, nbytes = total + slots, nbytes + seg.nbytes
            need -= slots
        c = self._classes[slot_bytes]
        for seg in planned:
            for s in range(seg.slots):
                heapq.heappush(c.free, make_loc(seg.id, s))
        return True

    def _reclaim_one(self, exclude: int) -> bool:
        """Forget one empty, still-planned segment of another class (its budget is reusable at
        once). Empty segments already on disk are removed by the store (reclaimable())."""
        for sid in self._empty:
            seg = self.segments[sid]
            if seg.slot_bytes != exclude and not seg.on_disk:
                self.drop(seg.id)
                return True
        return False

    def release(self, locs: Iterable[int]) -> None:
        """Slots whose writes never committed: no row can name them, free at once (a pending
        one goes back to the quarantine: its old row may still be on disk)."""
        for loc in locs:
            seg = self.segments.get(split_loc(loc)[0])
            if seg is None:
                continue
            if loc in self._pending:
                self._pending.discard(loc)
                heapq.heappush(self._retired.setdefault(seg.slot_bytes, []), loc)
                continue
            seg.used -= 1
            if not seg.used:
                self._empty.add(seg.id)
            heapq.heappush(self._classes[seg.slot_bytes].free, loc)

    def retire(self, locs: Iterable[int]) -> None:
        """Committed blocks leaving: quarantined until their delete commits (settle)."""
        for loc in locs:
            seg = self.segments.get(split_loc(loc)[0])
            if seg is not None and loc not in self._quarantine:
                self._quarantine.add(loc)
                heapq.heappush(self._retired.setdefault(seg.slot_bytes, []), loc)

    def settle(self, locs: Iterable[int]) -> None:
        """Their deletes committed: quarantined slots are free again, pending ones plain reservations."""
        locs = [loc for loc in locs if loc in self._quarantine]
        self._quarantine.difference_update(locs)
        if self._pending:
            held = {loc for loc in locs if loc in self._pending}
            if held:
                self._pending.difference_update(held)
                locs = [loc for loc in locs if loc not in held]
        self.release(locs)

    # --- segment files
    def planned(self) -> list[Segment]:
        return [s for s in self.segments.values() if not s.on_disk]

    def created(self, seg_id: int) -> None:
        self.segments[seg_id].on_disk = True

    def drop(self, seg_id: int) -> Segment | None:
        """Forget a segment and its free slots (file not made, removed, or unusable). The caller
        must no longer hold any of its locs."""
        seg = self._remove(seg_id)
        if seg is None:
            return None
        c = self._classes[seg.slot_bytes]
        c.free = [loc for loc in c.free if split_loc(loc)[0] != seg_id]
        heapq.heapify(c.free)
        self._quarantine = {loc for loc in self._quarantine if split_loc(loc)[0] != seg_id}
        self._pending = {loc for loc in self._pending if split_loc(loc)[0] != seg_id}
        if seg.slot_bytes in self._retired:
            heap = [loc for loc in self._retired[seg.slot_bytes] if split_loc(loc)[0] != seg_id]
            heapq.heapify(heap)
            self._retired[seg.slot_bytes] = heap
        return seg

    def reclaimable(self, keep_class: int | None = None) -> list[Segment]:
        """Empty segment files on disk (no used or quarantined slot), other than of keep_class."""
        empty = [s for s in map(self.segments.__getitem__, self._empty) if s.on_disk and s.slot_bytes != keep_class]
        if not empty:  # the usual case: quarantined slots count as used, so a full tier has no empty segment
            return []
        busy = {split_loc(loc)[0] for loc in self._quarantine}
        return [s for s in empty if s.id not in busy]
