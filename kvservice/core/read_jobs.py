"""Disk reads (a mixin of tiers.Tiers: it runs on the Tiers' state).

  read_batch(entries, scratch, block_bytes, on_part)  one coalesced, verified read: blocks land in
                                                host slots where there is room (then they are the host
                                                copy), the rest in scratch; a bad block is discarded
  read_from_disk(e)                             one block (the files format)
"""

from __future__ import annotations

import asyncio
import functools
import logging

import numpy as np
import torch

from kvservice.disk import FaultKind, aligned_buffer, block_file
from kvservice.disk.batch_io import HostSlots
from kvservice.disk.io_backend import BlockIOError
from kvservice.disk.store import READ_FANOUT
from kvservice.disk.tier_io import DiskFault
from kvservice.placement.index import DiskState, Entry

log = logging.getLogger(__name__)

READ_PARTS = 4  # a large Load's disk read: parts settled one by one (read_batch's on_part)
READ_PART_BYTES = 8 << 20  # at least this much per part


class ReadJobs:
    """Disk reads; mixed into Tiers, whose state it uses:
    self.segments, self.disk, self.host, self.life, self.index, self.stats, self.io, self.reader_pool,
    self.reads_in_flight, self.now, HostRoom's _clean_room, SpillJobs' _host_slots and _drop_disk_copy, Tiers._meta."""

    async def read_from_disk(self, e: Entry, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read e's payload into `out` (a host buffer of e.size bytes; default a new one),
        checksum-verified. Caller holds a pin on e.
        Raises BlockIOError after discarding the block and counting the failure."""
        loop = asyncio.get_running_loop()
        out = torch.empty(e.size, dtype=torch.uint8) if out is None else out
        if self.segments is not None:
            return await self._read_segment(e, out)
        self.reads_in_flight += 1
        try:
            await loop.run_in_executor(self.reader_pool, block_file.read_payload, self.io, e.disk_path, self._meta(e), out)
        except (OSError, BlockIOError) as err:
            counter = "checksum_failures" if isinstance(err, block_file.ChecksumMismatchError) else "io_errors"
            self.stats.bump(e.namespace, counter)
            log.warning("disk block %s discarded: %s", e.key.hash.hex()[:16], err)
            if e.disk == DiskState.ON_DISK:
                self._drop_disk_copy(e)
            raise BlockIOError(str(err)) from err
        finally:
            self.reads_in_flight -= 1
        return out

    async def _read_segment(self, e: Entry, out: torch.Tensor) -> torch.Tensor:
        """Disk tier v2: read e's slot (batched with the other reads of this turn), CRC-verified."""
        assert self.segments is not None
        self.reads_in_flight += 1
        try:
            fault = await self.segments.read(e.disk_loc, out)
        finally:
            self.reads_in_flight -= 1
        if fault is not None:
            raise self._read_failed(e, fault)
        return out

    def _read_failed(self, e: Entry, fault: DiskFault) -> BlockIOError:
        """A disk block that cannot be served is counted and discarded; the error says why."""
        bad_bytes = fault.kind in (FaultKind.CHECKSUM, FaultKind.WRONG_SIZE)
        self.stats.bump(e.namespace, "checksum_failures" if bad_bytes else "io_errors")
        log.warning("disk block %s discarded: %s", e.key.hash.hex()[:16], fault.message)
        if e.disk == DiskState.ON_DISK:
            self._drop_disk_copy(e)
        return BlockIOError(fault.message)

    async def read_batch(self, entries: list[Entry], scratch, block_bytes: int = 0,
                         on_part=None) -> list[tuple[torch.Tensor | BaseException, bool]]:
        """Read disk blocks (the caller pins them) as one coalesced DiskStore read. A block lands
        in a host slot where the host tier has room - free slots, or the slots of LRU blocks that
        have a disk copy, evicted for it (nothing to write) - and that slot becomes its host copy:
        (row, True), onboarded with no second copy. The rest land in scratch(k) buffers (None:
        page-aligned ones of our own): (buffer, False). A block that fails is counted and
        discarded, (BlockIOError, False), as with read_from_disk. The read settles in its done
        callback: a caller cancelled meanwhile leaves no slot taken and no pin held. With
        block_bytes (the caller's pool block size), a block of another size - a row recovered from
        a damaged or crafted disk - fails as wrong_size and is discarded, never handed over.
        on_part(first, results): a Load of at least 2 x READ_PART_BYTES that lands wholly in host
        slots, with no other disk read in flight, is read as up to READ_PARTS parts issued at once
        (the same bytes in flight, larger requests split fewer ways), each settled as it lands and
        announced through on_part (on the loop, before its pins go: pin what you copy from), so the
        caller copies one part to the engine while the rest is still read.
        Files format: read_from_disk per block, in parallel."""
        if block_bytes:
            wrong = {i for i, e in enumerate(entries) if e.size != block_bytes}
            if wrong:
                good = await self.read_batch([e for i, e in enumerate(entries) if i not in wrong], scratch)
                it = iter(good)
                return [(self._read_failed(e, DiskFault(
                    FaultKind.WRONG_SIZE, f"disk block of {e.size} bytes, the namespace's blocks are {block_bytes} "
                    "bytes")), False) if i in wrong else next(it) for i, e in enumerate(entries)]
        if not entries:
            return []
        if self.segments is None:
            bufs = scratch(len(entries))
            res = await asyncio.gather(*(self.read_from_disk(e, b) for e, b in zip(entries, bufs)),
                                       return_exceptions=True)
            return [(r, False) for r in res]
        n, now = len(entries), self.now()
        offsets: list[int | None] = [None] * n
        by_size: dict[int, list[int]] = {}
        for i, e in enumerate(entries):
            by_size.setdefault(e.size, []).append(i)
        for size, idxs in by_size.items():
            if self.host.placeable(size) < len(idxs):
                self._clean_room(size, len(idxs), now)
            k = min(len(idxs), self.host.placeable(size))
            for i, off in zip(idxs, (self.host.alloc(size, k) or ()) if k else ()):
                offsets[i] = off
        rest = [i for i in range(n) if offsets[i] is None]
        outs: list | HostSlots
        parts = [(0, n)]
        if not rest:  # every block lands in a host slot: one planned, coalesced read into the arena
            outs = self._host_slots(entries, offsets)  # type: ignore[arg-type]
            total = int(outs.lengths.sum())
            # parts read at once, each settled as it lands; only for a read alone: the reader pool's
            # threads each wait on one call, so parts of concurrent Loads would cut the bytes in flight
            if on_part is not None and total >= 2 * READ_PART_BYTES and not self.reads_in_flight:
                k = min(READ_PARTS, total // READ_PART_BYTES)
                parts = [(n * j // k, n * (j + 1) // k) for j in range(k)]
        else:
            outs = [self.host.arena.row(off, e.size) if off is not None else None for e, off in zip(entries, offsets)]
            for i, b in zip(rest, scratch(len(rest))):
                outs[i] = b
            own = [i for i in rest if outs[i] is None]
            if own:
                room = torch.from_numpy(aligned_buffer(sum(entries[i].size for i in own)))
                at = 0
                for i in own:
                    outs[i] = room[at:at + entries[i].size]
                    at += entries[i].size
        self.life.pin(entries)  # until the read is done, also if the caller is cancelled
        self.reads_in_flight += n
        loop = asyncio.get_running_loop()
        results: list = [None] * n
        left = [len(parts)]
        settled: asyncio.Future = loop.create_future()
        for a, b in parts:
            if len(parts) == 1:
                job = self.segments.read_many([e.disk_loc for e in entries], outs)
            else:
                job = self.segments.read_many([e.disk_loc for e in entries[a:b]], outs.subset(np.arange(a, b)),
                                              fanout=max(1, READ_FANOUT // len(parts)))
            job.add_done_callback(functools.partial(self._settle_read, entries, offsets, outs, a, b, results, left,
                                                    settled, on_part if len(parts) > 1 else None))
        return await asyncio.shield(settled)

    def _settle_read(self, entries: list[Entry], offsets: list, outs, a: int, b: int, results: list, left: list[int],
                     settled: asyncio.Future, on_part, j: asyncio.Future) -> None:
        """read_batch: blocks a..b of a read have landed (or failed): onboard, count, unpin; on_part
        hears of them at once; the batch's future resolves when its last part has settled."""
        n = b - a
        self.reads_in_flight -= n
        err = j.exception() if not j.cancelled() else asyncio.CancelledError()
        faults = j.result() if err is None else [DiskFault(FaultKind.IO_ERROR, f"disk read failed: {err!r}")] * n
        adds: list[Entry] = []  # onboarded: their slots become their host copies, added at once
        add_offs: list[int] = []
        adding: set[int] = set()
        onboards: dict[str, int] = {}
        part = entries[a:b]
        holds = self.index.holds  # (not e.key: a property that builds a key per block)
        for k, (e, off, fault) in enumerate(zip(part, offsets[a:b], faults), start=a):
            if id(e) in adding:  # the same block twice in one batch: its first copy goes in first
                self.life.add(adds, add_offs)
                adds, add_offs, adding = [], [], set()
            if fault is not None:
                if off is not None:
                    self.host.free([off], e.size)
                results[k] = (self._read_failed(e, fault), False)
            elif off is None:
                results[k] = (outs[k], False)
            elif holds(e) and not e.in_memory:
                adds.append(e)
                add_offs.append(off)
                adding.add(id(e))
                onboards[e.namespace] = onboards.get(e.namespace, 0) + 1
                results[k] = (self.host.arena.row(off, e.size), True)
            elif e.in_memory:  # another call put it back in memory meanwhile: serve that copy
                self.host.free([off], e.size)
                results[k] = (self.host.row(e), True)
            else:  # forgotten meanwhile: these verified bytes are still served, from a copy
                own_copy = self.host.arena.row(off, e.size).clone()
                self.host.free([off], e.size)
                results[k] = (own_copy, False)
        if adds:
            self.life.add(adds, add_offs)
        for ns, c in onboards.items():
            self.stats.bump(ns, "disk_onboards", c)
        if on_part is not None and not settled.done():
            try:
                on_part(a, results[a:b])
            except Exception:  # the caller's hook must not leave this part's pins held
                log.exception("read_batch part hook failed")
        self.life.unpin(part)
        left[0] -= 1
        if not left[0] and not settled.done():
            settled.set_result(results)
