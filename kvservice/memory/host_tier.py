"""Host tier: the room and order books of the blocks in host arena slots.

Primitives (bookkeeping only; a block changes state through kvservice.core.lifecycle, which
updates these books):
  placeable(block_bytes) -> n          blocks of that size the arena can take now without evicting
  alloc(block_bytes, n) -> offsets     take free slots (a Store's reservation, a disk read); None: no room
  free(offsets, block_bytes)           give back slots taken that no block came to hold
  lru_touch(chain) / lru_discard(e)    LRU order of the resident blocks (head of a chain newest)
  lru_add_new(chain)                   the same for blocks not in the LRU yet (a Store's commit, one update)
  touch(chain)                         refresh the LRU order of those resident (a hit)
  entries_oldest_first()               LRU order, for the eviction plan (tiers.Tiers)
  freed(entries) -> future | None      resolves when their bytes are off the tier's capacity (slot
                                       freed, or moved to the staging budget): the room a Store waits for
  row(entry) / rows(entries)           uint8 views of slots
  counts                               pinned / retained members for Stats (placement.tier_counts), kept
                                       by the lifecycle; len(self) + len(unstaged) is the block count
used_bytes is the bytes of slots on the tier's capacity (resident blocks, reserved and rolled-back
Stores' slots, reads landing in slots), at most capacity_bytes once every Store's evictions ran (a
Store that took headroom_bytes past it evicts once its copy is queued). A victim being spilled keeps its
slot until the write ends (`spilling`): its bytes move to the spill staging budget (staging_bytes,
part of the arena beside the tier's capacity) when it has room, so the Store that evicted it need
not wait for the disk; a victim that finds the staging budget full keeps its bytes in used_bytes,
and the Store waits for its write (freed()).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence

import torch

from kvservice.placement.index import Entry
from kvservice.placement.lru import StampLRU
from kvservice.placement.tier_counts import TierCounts
from kvservice.memory.host_arena import HostArena


class HostTier:
    name = "host"

    def __init__(self, arena: HostArena, capacity_bytes: int, headroom_bytes: int = 0) -> None:
        self.arena = arena
        self.capacity_bytes = capacity_bytes
        # arena bytes past the capacity that a Store may take for a moment (kvservice.core.store_path: its
        # evictions run once its copy is queued, and bring used_bytes back within capacity_bytes)
        self.headroom_bytes = headroom_bytes
        self.staging_bytes = arena.capacity_bytes - capacity_bytes - headroom_bytes
        self.used_bytes = 0
        self.staged_bytes = 0  # bytes of victims whose spill is queued or being written, on the staging budget
        self.loose_bytes = 0  # of used_bytes: slots alloc() took that no block holds yet (disk reads in flight)
        self._lru = StampLRU()
        self.spilling: dict[int, Entry] = {}  # evicted, slot held until the spill is written; by id(), oldest first
        # those of them still on the tier's capacity (not staged), oldest first; an OrderedDict: the
        # oldest is taken from the front, O(1) (a dict's front would be a run of deleted slots)
        self.unstaged: OrderedDict[int, Entry] = OrderedDict()
        # id(entry) -> the freed() calls waiting for its slot to be off the tier (each counts it down once)
        self.waiters: dict[int, list[_Countdown]] = {}
        self.counts = TierCounts()  # pinned and retained members, for Stats (kept by kvservice.core.lifecycle)

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def __len__(self) -> int:
        return len(self._lru)

    def entries(self):
        """Every block on the tier's capacity: the LRU, then victims whose spill is being written
        that found the staging budget full (staged ones count on the staging budget instead)."""
        yield from self._lru.values()
        yield from self.unstaged.values()

    def holders(self) -> int:
        return len(self._lru) + len(self.spilling)

    def entries_oldest_first(self):
        return self._lru.oldest_first()

    def placeable(self, block_bytes: int) -> int:
        """Blocks of that size the tier can take now: arena slots free and within capacity_bytes."""
        return min(self.arena.placeable(block_bytes), self.free_bytes // block_bytes)

    def placeable_over(self, block_bytes: int) -> int:
        """Blocks of that size a Store may take now into the headroom: arena slots free and within
        capacity_bytes + headroom_bytes."""
        return min(self.arena.placeable(block_bytes), (self.free_bytes + self.headroom_bytes) // block_bytes)

    def alloc(self, block_bytes: int, n: int, over: bool = False) -> list[int] | None:
        """n slots within the capacity (over: within capacity + headroom); None: no room."""
        if n * block_bytes > self.free_bytes + (self.headroom_bytes if over else 0):
            return None
        offsets = self.arena.alloc(block_bytes, n)
        if offsets is not None:
            self.used_bytes += n * block_bytes
            self.loose_bytes += n * block_bytes
        return offsets

    def free(self, offsets: Sequence[int], block_bytes: int) -> None:
        """Give back slots alloc() took that no block came to hold."""
        self.arena.free(offsets, block_bytes)
        self.used_bytes -= len(offsets) * block_bytes
        self.loose_bytes -= len(offsets) * block_bytes

    def held(self, nbytes: int) -> None:
        """Slots alloc() took now belong to blocks (lifecycle: place, add)."""
        self.loose_bytes -= nbytes

    def lru_touch(self, chain: Sequence[Entry]) -> None:
        self._lru.touch(chain)

    def lru_add_new(self, chain: Sequence[Entry]) -> None:
        """lru_touch for entries known not to be in the LRU (a Store's commit), head first."""
        self._lru.add_new(chain)

    def lru_discard(self, entry: Entry) -> None:
        self._lru.discard(entry)

    def lru_discard_many(self, entries: Sequence[Entry]) -> None:
        self._lru.discard_many(entries)

    def take_oldest(self, want: int, now: float) -> list[Entry]:
        """Up to `want` of the oldest unpinned, unleased resident blocks, out of the LRU already
        (StampLRU.take_oldest): the caller evicts every one of them before it awaits."""
        return self._lru.take_oldest(want, now)

    def touch(self, chain: Sequence[Entry]) -> None:
        self._lru.touch_present(chain)

    def wake(self, entry: Entry) -> None:
        ws = self.waiters.pop(id(entry), None)
        if ws is not None:
            for w in ws:
                w.left -= 1
                if not w.left and not w.done.done():
                    w.done.set_result(None)

    def freed(self, entries: Sequence[Entry], staged_too: bool = False) -> asyncio.Future | None:
        """Resolves once every one of entries that still holds tier capacity (not staged; with
        staged_too, every one that still holds an arena slot) has given its slot back (spill written
        or abandoned), or moved to the staging budget (wake). One future and one countdown for the
        call (a future per entry and their gather cost ~2 us of the loop a spilled block)."""
        need = [e for e in entries if e.slot >= 0 and (staged_too or not e.staged)]
        if not need:
            return None
        w = _Countdown(len(need), asyncio.get_running_loop().create_future())
        waiters = self.waiters
        for e in need:
            ws = waiters.get(id(e))
            if ws is None:
                waiters[id(e)] = [w]
            else:
                ws.append(w)
        return w.done

    def row(self, entry: Entry) -> torch.Tensor:
        return self.arena.row(entry.slot, entry.size)

    def rows(self, entries: Sequence[Entry]) -> list[torch.Tensor]:
        base = self.arena.base
        return [base[e.slot:e.slot + e.size] for e in entries]


class _Countdown:
    """One freed() call: its future resolves when `left` (its entries not woken yet) reaches 0."""

    __slots__ = ("left", "done")

    def __init__(self, left: int, done: asyncio.Future[None]) -> None:
        self.left = left
        self.done = done
