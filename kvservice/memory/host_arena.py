"""Host arena: the host tier's memory, allocated once at start and addressed by slot.

Primitives:
  HostArena(capacity_bytes, pin)        one anonymous mapping, pre-faulted (MAP_POPULATE); on GPU hosts
                                        registered with CUDA (cudaHostRegister), so every slot is pinned
  alloc(block_bytes, n) -> [offset] | None    n slots, lowest offsets first (a batch stays in few runs);
                                        None, with nothing taken, when they do not fit
  free(offsets, block_bytes)            give slots back
  rows(offsets, block_bytes)            uint8 views of slots (for copies; they keep no slot alive)
  placeable(block_bytes) -> n           how many blocks of that size alloc could place now
  slot_freeing(offset, block_bytes) -> n    how many more blocks of that size would fit once that slot is free
  holds_only(block_bytes) -> bool       every slot taken is of that size (each eviction frees one slot of it)
  close()

The capacity is cut into segments (segment_size: capacity/16 within 8-64 MiB; the last may be shorter). A segment serves one
block size from its first slot taken until its last slot is freed, then it is free for any size:
namespaces with different block sizes share the capacity without a copy. The arena is the
daemon's host tier memory, all of it: its RSS is the capacity plus a fixed overhead, whatever the
traffic, and the first Store writes into memory that is already faulted in (and pinned).
Bookkeeping only here; which blocks live in the slots is the host tier's business.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

log = logging.getLogger(__name__)

SEGMENT_BYTES = 64 << 20  # the largest segment; small arenas get smaller ones (segment_size)
MIN_SEGMENT_BYTES = 8 << 20


def segment_size(capacity_bytes: int, largest: int = SEGMENT_BYTES) -> int:
    """Segments of capacity/16 between 8 and 64 MiB (4 KiB multiples): a small arena still has
    enough segments for several block sizes at once (a 64 MiB arena of one 64 MiB segment let
    the first block size to arrive take all of it), a large one keeps per-segment lists short."""
    size = min(largest, max(MIN_SEGMENT_BYTES, capacity_bytes // 16)) // 4096 * 4096
    return min(size, capacity_bytes)


@dataclass(slots=True)
class _Segment:
    offset: int
    nbytes: int
    block_bytes: int = 0  # 0: free for any size
    slots: int = 0  # slots of block_bytes it holds
    free: list[int] = field(default_factory=list)  # free slot numbers, ascending

    @property
    def used(self) -> int:
        return self.slots - len(self.free)


class HostArena:
    def __init__(self, capacity_bytes: int, pin: bool = False, segment_bytes: int = 0) -> None:
        if capacity_bytes <= 0:
            raise ValueError("host arena capacity must be > 0")
        t0 = time.monotonic()
        self.capacity_bytes = capacity_bytes
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        self._mm = mmap.mmap(-1, capacity_bytes, flags=flags)
        self.base = torch.frombuffer(self._mm, dtype=torch.uint8)
        if not getattr(mmap, "MAP_POPULATE", 0):  # touch every page once: the first Store must not fault
            self.base[::mmap.PAGESIZE].zero_()
        self.pinned = False
        if pin:
            self._pin()
        self.segment_bytes = min(segment_bytes, capacity_bytes) if segment_bytes else segment_size(capacity_bytes)
        self._segments = [_Segment(o, min(self.segment_bytes, capacity_bytes - o))
                          for o in range(0, capacity_bytes, self.segment_bytes)]
        self._free_segments = list(range(len(self._segments)))  # ascending
        self._by_size: dict[int, list[int]] = {}  # block size -> its segments, ascending
        # kept incrementally so that placeable() costs O(1), not a walk of every segment (a 64 GiB
        # arena has 1024 of them, and a Store asks several times): free slots per block size, and
        # the bytes of the last segment when it is shorter than the others (0: it is not)
        self._free_slots: dict[int, int] = {}
        last = self._segments[-1].nbytes
        self._short = last if last < self.segment_bytes else 0
        self.start_seconds = time.monotonic() - t0
        log.info("host arena: %d bytes in %d segments of %d, %s, ready in %.2f s", capacity_bytes,
                 len(self._segments), self.segment_bytes, "pinned" if self.pinned else "pageable", self.start_seconds)

    def _pin(self) -> None:
        if not torch.cuda.is_available():
            log.warning("host arena: no CUDA device, so the arena is not pinned")
            return
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(self.base.data_ptr(), self.capacity_bytes, 0)
        if int(err) != 0:
            log.warning("host arena: cudaHostRegister of %d bytes failed (%s); copies will be staged", self.capacity_bytes, err)
            return
        self.pinned = True

    # --- slots
    def alloc(self, block_bytes: int, n: int) -> list[int] | None:
        if n <= 0:
            return []
        if self.placeable(block_bytes) < n:
            return None
        out: list[int] = []
        for s in self._by_size.get(block_bytes, []):
            seg = self._segments[s]
            take = min(n - len(out), len(seg.free))
            if take:
                base = seg.offset
                out += [base + k * block_bytes for k in seg.free[:take]]
                del seg.free[:take]
                self._free_slots[block_bytes] -= take
                if len(out) == n:
                    return out
        while len(out) < n:
            seg = self._claim_segment(block_bytes)
            take = min(n - len(out), len(seg.free))
            base = seg.offset
            out += [base + k * block_bytes for k in seg.free[:take]]
            del seg.free[:take]
            self._free_slots[block_bytes] -= take
        return out

    def free(self, offsets: Sequence[int], block_bytes: int) -> None:
        """Give slots back. A batch is split by segment with numpy and merged into each segment's
        free list with one sort (an insort per slot cost ~0.2 us a block on an evicting Store)."""
        if len(offsets) <= 64:  # numpy's fixed cost (~20 us) is more than a short loop's
            sb = self.segment_bytes
            by_seg: dict[int, list[int]] = {}
            for off in offsets:
                s = off // sb
                part = by_seg.get(s)
                if part is None:
                    by_seg[s] = [off]
                else:
                    part.append(off)
            for s, part in by_seg.items():
                seg = self._segments[s]
                assert seg.block_bytes == block_bytes, "slot freed with another block size than it was taken with"
                base = seg.offset
                free = seg.free
                free += [(off - base) // block_bytes for off in part]
                free.sort()
                self._free_slots[block_bytes] += len(part)
                self._release_if_empty(s)
            return
        o = np.asarray(offsets, dtype=np.int64)
        segs = o // self.segment_bytes
        first, last = int(segs.min()), int(segs.max())
        if first == last:
            groups: list[tuple[int, np.ndarray]] = [(first, o)]
        else:
            order = np.argsort(segs, kind="stable")
            o, segs = o[order], segs[order]
            cuts = np.flatnonzero(np.diff(segs)) + 1
            groups = list(zip(segs[np.concatenate(([0], cuts))].tolist(), np.split(o, cuts)))
        for s, part in groups:
            seg = self._segments[s]
            assert seg.block_bytes == block_bytes, "slot freed with another block size than it was taken with"
            free = seg.free
            free += ((part - seg.offset) // block_bytes).tolist()
            free.sort()
            self._free_slots[block_bytes] += len(part)
            self._release_if_empty(s)

    def _release_if_empty(self, s: int) -> None:
        seg = self._segments[s]
        if seg.used == 0:  # the segment is free for any size again
            block_bytes = seg.block_bytes
            self._by_size[block_bytes].remove(s)
            if not self._by_size[block_bytes]:
                del self._by_size[block_bytes]
            self._free_slots[block_bytes] -= seg.slots  # a size's count stays (at 0) once it had a segment
            seg.block_bytes, seg.slots, seg.free = 0, 0, []
            bisect.insort(self._free_segments, s)

    def holds_only(self, block_bytes: int) -> bool:
        """Every slot taken holds a block of block_bytes (or none is taken): each block evicted
        then frees exactly one slot of that size (the eviction plan's fast path)."""
        by_size = self._by_size
        return not by_size or (len(by_size) == 1 and block_bytes in by_size)

    def _claim_segment(self, block_bytes: int) -> _Segment:
        for i, s in enumerate(self._free_segments):
            seg = self._segments[s]
            if seg.nbytes >= block_bytes:
                del self._free_segments[i]
                seg.block_bytes, seg.slots = block_bytes, seg.nbytes // block_bytes
                seg.free = list(range(seg.slots))
                bisect.insort(self._by_size.setdefault(block_bytes, []), s)
                self._free_slots[block_bytes] = self._free_slots.get(block_bytes, 0) + seg.slots
                return seg
        raise AssertionError("no free segment: alloc checked placeable first")

    def placeable(self, block_bytes: int) -> int:
        n = self._free_slots.get(block_bytes, 0)
        free = self._free_segments
        if free:
            if self._short and free[-1] == len(self._segments) - 1:  # the short last segment is free
                return n + (len(free) - 1) * (self.segment_bytes // block_bytes) + self._short // block_bytes
            n += len(free) * (self.segment_bytes // block_bytes)
        return n

    def placeable_walk(self, block_bytes: int) -> int:
        """placeable() counted segment by segment (tests check the incremental count against it)."""
        n = sum(len(self._segments[s].free) for s in self._by_size.get(block_bytes, []))
        return n + sum(self._segments[s].nbytes // block_bytes for s in self._free_segments)

    def audit(self) -> list[str]:
        """The incremental free-slot counts against the segments' free lists (empty: they agree)."""
        out = []
        for size in set(self._by_size) | set(self._free_slots):
            walked = sum(len(self._segments[s].free) for s in self._by_size.get(size, []))
            if walked != self._free_slots.get(size, 0):
                out.append(f"arena counts {self._free_slots.get(size, 0)} free slots of {size} bytes, "
                           f"its segments have {walked}")
        return out

    def max_slots(self, block_bytes: int) -> int:
        """Blocks of that size the whole arena holds when it holds nothing else."""
        full = len(self._segments) - (1 if self._short else 0)
        return full * (self.segment_bytes // block_bytes) + self._short // block_bytes

    def slot_freeing(self, offset: int, block_bytes_of_slot: int, want_bytes: int, freed_in: dict[int, int]) -> int:
        """Blocks of want_bytes that become placeable once the slot at offset (holding a block of
        block_bytes_of_slot) is freed, given the slots already counted as freed per segment in
        freed_in (updated). For planning evictions without freeing anything."""
        s = offset // self.segment_bytes
        seg = self._segments[s]
        if block_bytes_of_slot == want_bytes:
            return 1
        freed_in[s] = freed_in.get(s, 0) + 1
        if freed_in[s] == seg.used:  # the whole segment frees up
            return seg.nbytes // want_bytes
        return 0

    def rows(self, offsets: Sequence[int], block_bytes: int) -> list[torch.Tensor]:
        base = self.base
        return [base[o:o + block_bytes] for o in offsets]

    def row(self, offset: int, block_bytes: int) -> torch.Tensor:
        return self.base[offset:offset + block_bytes]

    @property
    def used_bytes(self) -> int:
        """Bytes of slots taken (segment tails too short for a slot are not counted)."""
        return sum(seg.used * seg.block_bytes for seg in self._segments)

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.base.data_ptr())
            self.pinned = False
        self.base = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:  # a view still exists somewhere; the mapping goes with the process
            pass


def runs(offsets: Sequence[int] | np.ndarray, block_bytes: int) -> list[tuple[int, int, int]]:
    """(first position, count, first offset) of each run of slots that are back to back, in order.
    Long inputs (thousands of small blocks in one batch) are split with numpy, not a Python loop."""
    if len(offsets) > 64:
        o = np.asarray(offsets, dtype=np.int64)
        starts = np.flatnonzero(np.diff(o) != block_bytes) + 1
        starts = np.concatenate(([0], starts))
        counts = np.diff(np.append(starts, len(o)))
        return list(zip(starts.tolist(), counts.tolist(), o[starts].tolist()))
    if isinstance(offsets, np.ndarray):
        offsets = offsets.tolist()
    out: list[tuple[int, int, int]] = []
    first = 0
    for i in range(1, len(offsets) + 1):
        if i == len(offsets) or offsets[i] != offsets[i - 1] + block_bytes:
            out.append((first, i - first, offsets[first]))
            first = i
    return out

