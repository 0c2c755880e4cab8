"""Host tier: blocks in slots of the host arena, LRU ordered.

Primitives:
  placeable(block_bytes) -> n          blocks of that size the arena can take now without evicting
  alloc(block_bytes, n) -> offsets     take free slots for a Store's copy (None: they do not fit)
  free(offsets, block_bytes)           give back slots a Store took and never committed
  add(chain, offsets)                  commit entries (head first) into the slots they were copied to
  touch(chain)                         refresh LRU order on a hit
  entries_oldest_first()               LRU order, for the eviction plan (tiers.Tiers)
  evict(entry, keep_slot)              out of the LRU; the slot goes now, or (keep_slot) stays until
                                       the block's spill is written (release)
  restore(entry)                       a victim whose spill failed goes back into the LRU, slot and all
  release(entry)                       the slot goes back to the arena (once no copy pins it)
  unpin(entries)                       a copy or read is done with them (a deferred release happens)
  freed(entries) -> future | None      resolves when their bytes are off the tier's capacity (slot
                                       freed, or moved to the staging budget): the room a Store waits for
used_bytes is the bytes of slots blocks hold in the tier (in the LRU, or being copied in), at most
capacity_bytes. A victim being spilled keeps its slot until the write ends: its bytes move to the
spill staging budget (staging_bytes, part of the arena beside the tier's capacity), so the Store
that evicted it need not wait for the disk; a victim that finds the staging budget full keeps
its bytes in used_bytes, and the Store waits for its write (freed()). Which entries are victims, and
whether a victim spills to disk or is dropped, is decided in tiers.Tiers with eviction's policies.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch

from kvservice.placement.index import Entry
from kvservice.placement.lru import ChainLRU
from kvservice.memory.host_arena import HostArena


class HostTier:
    name = "host"

    def __init__(self, arena: HostArena, capacity_bytes: int) -> None:
        self.arena = arena
        self.capacity_bytes = capacity_bytes
        self.staging_bytes = arena.capacity_bytes - capacity_bytes
        self.used_bytes = 0
        self.staged_bytes = 0  # bytes of victims whose spill is queued or being written, on the staging budget
        self._lru = ChainLRU()
        self._spilling: dict[int, Entry] = {}  # evicted, slot held until the spill is written; by id()
        self._waiters: dict[int, asyncio.Future[None]] = {}  # id(entry) -> resolved when its slot is free

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def __len__(self) -> int:
        return len(self._lru)

    def entries(self):
        """Every block on the tier's capacity: the LRU, then victims whose spill is being written
        that found the staging budget full (staged ones count on the staging budget instead)."""
        yield from self._lru.values()
        yield from (e for e in self._spilling.values() if not e.staged)

    def holders(self) -> int:
        return len(self._lru) + len(self._spilling)

    def entries_oldest_first(self):
        return self._lru.oldest_first()

    def placeable(self, block_bytes: int) -> int:
        """Blocks of that size the tier can take now: arena slots free and within capacity_bytes."""
        return min(self.arena.placeable(block_bytes), self.free_bytes // block_bytes)

    def alloc(self, block_bytes: int, n: int) -> list[int] | None:
        if n * block_bytes > self.free_bytes:
            return None
        offsets = self.arena.alloc(block_bytes, n)
        if offsets is not None:
            self.used_bytes += n * block_bytes
        return offsets

    def free(self, offsets: Sequence[int], block_bytes: int) -> None:
        self.arena.free(offsets, block_bytes)
        self.used_bytes -= len(offsets) * block_bytes

    def add(self, chain: Sequence[Entry], offsets: Sequence[int]) -> None:
        for e, off in zip(chain, offsets):
            assert e.slot < 0
            e.slot = off
        self._lru.touch(chain)

    def touch(self, chain: Sequence[Entry]) -> None:
        self._lru.touch([e for e in chain if e in self._lru])

    def evict(self, entry: Entry, keep_slot: bool) -> None:
        self._lru.discard(entry)
        if keep_slot:
            entry.spilling = True
            self._spilling[id(entry)] = entry
            if self.staged_bytes + entry.size <= self.staging_bytes:
                entry.staged = True  # off the tier's capacity now; the slot itself goes after the write
                self.staged_bytes += entry.size
                self.used_bytes -= entry.size
        else:
            self.release(entry)

    def restore(self, entry: Entry) -> bool:
        """A victim whose spill failed goes back into the LRU with the slot it kept (no copy), if
        the tier has room for it again; False: it does not fit."""
        if entry.staged:
            if entry.size > self.free_bytes:
                return False
            self.staged_bytes -= entry.size
            self.used_bytes += entry.size
            entry.staged = False
        self._spilling.pop(id(entry), None)
        entry.spilling = False
        self._lru.touch([entry])
        return True

    def release(self, entry: Entry) -> None:
        """Free the entry's slot; deferred (release_pending) while a copy or read pins it."""
        if entry.slot < 0:
            return
        self._lru.discard(entry)
        self._spilling.pop(id(entry), None)
        entry.spilling = False
        if entry.pins:
            entry.release_pending = True
            return
        self.arena.free([entry.slot], entry.size)
        if entry.staged:
            self.staged_bytes -= entry.size
            entry.staged = False
        else:
            self.used_bytes -= entry.size
        entry.slot = -1
        entry.release_pending = False
        self._wake(entry)
        self._promote()

    def _promote(self) -> None:
        """Victims still on the tier's capacity move to the staging budget as it frees up, oldest
        first: the Stores waiting for their room go on without waiting for their writes."""
        for e in list(self._spilling.values()):
            if e.staged:
                continue
            if self.staged_bytes + e.size > self.staging_bytes:
                return
            e.staged = True
            self.staged_bytes += e.size
            self.used_bytes -= e.size
            self._wake(e)

    def _wake(self, entry: Entry) -> None:
        w = self._waiters.pop(id(entry), None)
        if w is not None and not w.done():
            w.set_result(None)

    def freed(self, entries: Sequence[Entry], staged_too: bool = False) -> asyncio.Future | None:
        """Resolves once every one of entries that still holds tier capacity (not staged; with
        staged_too, every one that still holds an arena slot) has given its slot back (spill written
        or abandoned)."""
        loop = asyncio.get_running_loop()
        waits = []
        for e in entries:
            if e.slot >= 0 and (staged_too or not e.staged):
                w = self._waiters.get(id(e))
                if w is None:
                    w = self._waiters[id(e)] = loop.create_future()
                waits.append(w)
        return asyncio.gather(*waits) if waits else None

    def unpin(self, entries: Sequence[Entry]) -> None:
        """Drop one pin of each; a slot whose release waited for its last pin goes now."""
        for e in entries:
            e.pins -= 1
            if e.pins == 0 and e.release_pending:
                self.release(e)

    def row(self, entry: Entry) -> torch.Tensor:
        return self.arena.row(entry.slot, entry.size)

    def rows(self, entries: Sequence[Entry]) -> list[torch.Tensor]:
        base = self.arena.base
        return [base[e.slot:e.slot + e.size] for e in entries]
