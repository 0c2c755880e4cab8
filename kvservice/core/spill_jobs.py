"""Spills and disk room (a mixin of tiers.Tiers: it runs on the Tiers' state).

  _reserve_slot(e, now) / _size_budget(size)    a disk slot for a spill, the byte budget per block size
  _write_jobs(batch)                            the write queue's handler: one DiskStore.write a batch
                                                (data, then metadata), settled in a done callback
  _settle_spill / _spill_failed / _abandon_spill  written (ON_DISK), failed (a retained block goes back
                                                to the host tier), or given up (room and slot back)
  _apply_disk_plan(plan) / _drop_disk_copy(e)   the disk eviction policy's victims leave the disk
  persist_deadline(e)                           a deadline moved: the disk copy's metadata follows
State changes go through kvservice.core.lifecycle; DiskTier is the book of disk bytes and orders.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

import numpy as np

from kvservice.disk import FaultKind, block_file
from kvservice.disk.batch_io import HostSlots
from kvservice.disk.io_backend import BlockIOError
from kvservice.disk.slots import slot_class
from kvservice.disk.store import META_PER_SLOT
from kvservice.disk.tier_io import BlockWrite, DiskFault
from kvservice.ops.trace import TRACE
from kvservice.placement.eviction import Victim, plan_disk_eviction
from kvservice.placement.index import DiskState, Entry

log = logging.getLogger(__name__)


class SpillJobs:
    """Spill writes, disk slots and disk evictions; mixed into Tiers, whose state it uses:
    self.disk, self.segments, self.life, self.index, self.host, self.stats, self.config, self.io,
    self.writer_pool, self.now, self._writing, self._budget_sizes, self._arena_bytes, self._header_tasks, and
    Tiers._meta / _forget."""

    def _reserve_slot(self, e: Entry, now: float) -> bool:
        """Disk tier v2: a segment slot for e's spill, after the plan made byte room. The store may
        still say no (its metadata's per-slot share, a full or read-only filesystem): evict a few
        more disk victims; if that does not help, undo e's disk reservation, count a refusal."""
        if self.segments is None:
            return True
        self._size_budget(e.size)
        for _ in range(8):
            loc = self.segments.reserve(e.size)
            if loc is not None:
                self.life.disk_slot(e, loc)
                return True
            if self.segments.store.readonly:
                break
            plan = plan_disk_eviction(self.disk, self.disk.free_bytes + 1, now, self.config.protect_unexpired)
            if not plan:
                break
            self._apply_disk_plan(plan)
        self.life.disk_unqueue(e)
        self.stats.bump(e.namespace, "admission_refusals")
        log.warning("disk tier refused a spill of %s: %s", e.key.hash.hex()[:16], self.segments.store.refusal())
        return False

    def _size_budget(self, size: int) -> None:
        """Lower the disk policy's byte budget to what the store holds in blocks of `size` (each
        slot also costs its slot rounding and metadata share). Without it the policy sees room the
        store has not got, and in a full tier every spill would fail its first reservation and
        evict again (_reserve_slot's fallback, ~15 us a victim on the loop at 64 KiB). Once per size."""
        if size in self._budget_sizes:
            return
        assert self.disk is not None and self.segments is not None
        self._budget_sizes.add(size)
        store = self.segments.store
        blocks = max(0, store.capacity_bytes - store.metadata_fixed_bytes) // (slot_class(size) + META_PER_SLOT)
        self.disk.budget_bytes = min(self.disk.budget_bytes, blocks * size)

    async def _write_jobs(self, batch: list[Entry]) -> None:
        """A batch of spills from the write queue: disk tier v2 writes it with one store call
        (data, then one metadata commit); the files format writes each block on its own."""
        if self.segments is None:
            await asyncio.gather(*(self._write_job(e) for e in batch))
            return
        live = []
        holds = self.index.holds
        for e in batch:
            if not holds(e) or e.disk != DiskState.QUEUED or not e.in_memory:
                self._abandon_spill(e)  # evicted while queued
            else:
                live.append(e)
        if live:
            await self._write_segments(live)

    async def _write_job(self, e: Entry) -> None:
        """Write one spill from its slot; its disk room was reserved when it was queued."""
        assert self.disk is not None
        if self.index.get_any(e.key) is not e or e.disk != DiskState.QUEUED or not e.in_memory:  # evicted while queued
            self._abandon_spill(e)
            return
        if self.segments is not None:
            return await self._write_segments([e])
        meta = self._meta(e)
        loop = asyncio.get_running_loop()
        self.life.pin([e])  # the slot is read by the writer thread: it must not be freed or reused meanwhile
        try:
            path = await loop.run_in_executor(
                self.writer_pool, block_file.write_block, self.io, self.disk.root, meta, self.host.row(e))
        except (OSError, BlockIOError, ValueError) as err:
            log.warning("spill of %s failed: %s", e.key.hash.hex()[:16], err)
            self.stats.bump(e.namespace, "io_errors")
            self.life.unpin([e])
            self._abandon_spill(e)
            return
        self.life.unpin([e])
        if self.index.get_any(e.key) is not e or e.disk != DiskState.QUEUED:  # evicted while it was written
            self.io.remove(path)
            self._abandon_spill(e)
            return
        self.life.disk_commit(e, meta.deadline, path)
        if e.spilling:
            self.life.release(e)
        self.stats.bump(e.namespace, "spills")
        if e.deadline != e.disk_deadline:
            await self.persist_deadline(e)

    async def _write_segments(self, batch: list[Entry]) -> None:
        """Disk tier v2: a batch of spills as one DiskStore.write straight from their host slots;
        data, then metadata. The write settles in its done callback, so a writer cancelled
        meanwhile (stop) leaves no slot pinned and no entry half-spilled."""
        assert self.disk is not None and self.segments is not None
        locs = [e.disk_loc for e in batch]
        blocks = [BlockWrite(e.namespace, e.hash, e.checksum, e.deadline, e.stored_at, e.reuse) for e in batch]
        call = TRACE.begin("spill", len(batch))
        self._writing.update(locs)
        self.life.pin(batch)  # the store reads the blocks' host slots: they must not be freed or reused meanwhile
        job = self.segments.write_many(locs, blocks, self._host_slots(batch, [e.slot for e in batch]))
        settled = asyncio.get_running_loop().create_future()

        def settle(j: asyncio.Future) -> None:
            TRACE.mark(call, "written")
            err = j.exception() if not j.cancelled() else asyncio.CancelledError()
            if err is not None:
                log.error("spill batch of %d blocks failed: %r", len(batch), err)
            faults = j.result() if err is None else [
                DiskFault(FaultKind.IO_ERROR, f"spill failed: {err!r}")] * len(batch)
            self._writing.difference_update(locs)
            self.life.unpin(batch)
            spilled: dict[str, int] = {}
            # the usual block (written, still queued and spilling, nothing else holding it, its deadline the
            # one written) settles in one batch; any other one by one
            holds, queued = self.index.holds, DiskState.QUEUED
            plain: list[Entry] = []
            for e, loc, block, fault in zip(batch, locs, blocks, faults):
                if (fault is None and e.disk == queued and e.spilling and not e.pins and not e.release_pending
                        and e.deadline == block.deadline and holds(e)):
                    plain.append(e)
                elif not self._settle_spill(e, loc, block, fault):
                    continue
                spilled[e.namespace] = spilled.get(e.namespace, 0) + 1
            self.life.spills_written(plain)
            for ns, k in spilled.items():
                self.stats.bump(ns, "spills", k)
            if not settled.done():
                settled.set_result(None)

        job.add_done_callback(settle)
        await asyncio.shield(settled)

    def _host_slots(self, entries: list[Entry], offsets: list[int]) -> HostSlots:
        """The blocks' host slots as the disk store's HostSlots (planned as arrays, one iovec per
        run of slots adjacent in memory and on disk)."""
        if self._arena_bytes is None:
            self._arena_bytes = self.host.arena.base.numpy()
        return HostSlots(self._arena_bytes, np.array(offsets, dtype=np.int64),
                         np.array([e.size for e in entries], dtype=np.int64))

    def _settle_spill(self, e: Entry, loc: int, block: BlockWrite, fault: DiskFault | None) -> bool:
        """One block of a written batch: committed to the disk tier (True: count it as a spill),
        or failed (slot given back)."""
        assert self.disk is not None and self.segments is not None
        if fault is not None:  # the store gave the slot back
            self.life.disk_slot(e, -1)
            self.stats.bump(e.namespace, "io_errors")
            log.warning("spill of %s failed (%s): %s", e.key.hash.hex()[:16], fault.kind.value, fault.message)
            self._spill_failed(e)
            return False
        if not self.index.holds(e) or e.disk != DiskState.QUEUED:  # evicted while written
            self.segments.free(loc)
            self.life.disk_slot(e, -1)
            self._abandon_spill(e)
            return False
        self.life.disk_commit(e, block.deadline)
        if e.spilling:
            self.life.release(e)
        if e.deadline != e.disk_deadline:  # a metadata update, committed in the background
            self.segments.set_deadline(loc, e.deadline)
            self.life.disk_deadline(e, e.deadline)
        return True

    def _spill_failed(self, e: Entry) -> None:
        """A retained block whose spill failed goes back to the host tier when it fits there (it
        still holds its slot: no copy), instead of vanishing; anything else is dropped as before."""
        if e.spilling and e.retained(self.now()) and self.index.get_any(e.key) is e:
            self.life.disk_unqueue(e)
            if self.life.restore(e):
                return
            log.error("retained block %s lost: its spill failed and the host tier has no room for it",
                      e.key.hash.hex()[:16])
        self._abandon_spill(e)

    def _abandon_spill(self, e: Entry) -> None:
        """Give back the disk room of a spill that will not be written; drop the block if it is no
        longer in the host tier. Idempotent: the writer may find it abandoned already."""
        assert self.disk is not None
        if self.segments is not None and e.disk_loc >= 0 and e.disk == DiskState.QUEUED:
            if e.disk_loc not in self._writing:  # a write in flight settles its own slot
                self.segments.cancel(e.disk_loc)
                self.life.disk_slot(e, -1)
        self.life.disk_unqueue(e)
        if e.spilling or not e.in_memory or e.release_pending:
            self.life.release(e)
            if e.disk == DiskState.NONE:
                self._forget(e)

    def _apply_disk_plan(self, plan: list[Victim], batch: bool = False) -> None:
        """batch: the freed slots go back with one store call (and counters per namespace)."""
        if not batch or self.segments is None:
            for v in plan:
                self.stats.bump(v.entry.namespace, v.cls.value)
                self._drop_disk_copy(v.entry)
            return
        for (ns, cls), k in Counter((v.entry.namespace, v.cls.value) for v in plan).items():
            self.stats.bump(ns, cls, k)
        freed: list[int] = []
        for v in plan:
            self._drop_disk_copy(v.entry, freed)
        if freed:
            self.segments.free_many(freed)

    def _drop_disk_copy(self, e: Entry, freed: list[int] | None = None) -> None:
        """freed: collect the slot to free (the caller frees the batch) instead of freeing it."""
        assert self.disk is not None
        if e.disk == DiskState.QUEUED:  # a queued best-effort spill, cancelled: the writer skips it
            self._abandon_spill(e)
            return
        path, loc = e.disk_path, e.disk_loc
        self.life.disk_release(e)
        if self.segments is not None:
            if loc >= 0:
                if freed is None:
                    self.segments.free(loc)
                else:
                    freed.append(loc)
        else:
            # unlink now, on the loop thread: a later spill of the same key reuses this path
            self.io.remove(path)
        if not e.in_memory or e.spilling or e.release_pending:
            self._forget(e)

    async def persist_deadline(self, e: Entry) -> None:
        """Rewrite the header so the deadline survives a restart."""
        if e.disk != DiskState.ON_DISK or e.disk_deadline == e.deadline:
            return
        if self.segments is not None:  # a metadata update, committed in the background
            self.segments.set_deadline(e.disk_loc, e.deadline)
            self.life.disk_deadline(e, e.deadline)
            return
        meta = self._meta(e)
        self.life.disk_deadline(e, meta.deadline)
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(
            loop.run_in_executor(self.writer_pool, block_file.rewrite_header, self.io, e.disk_path, meta))
        self._header_tasks.add(task)
        task.add_done_callback(self._header_tasks.discard)
        try:
            await task
        except (OSError, BlockIOError) as err:
            self.stats.bump(e.namespace, "io_errors")
            log.warning("deadline rewrite of %s failed: %s", e.key.hash.hex()[:16], err)
