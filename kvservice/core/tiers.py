"""Tiers: the index, host tier, disk tier and retention, and every move between them.

Primitives (all state changes happen on the event loop thread, through kvservice.core.lifecycle;
bytes move in thread pools). The moves live beside this module, as mixins over the Tiers' state:
  host_room.py   make_host_room(size, n, now) -> fit, spills; room_after(spills, now) -> future;
                 onboard_many(entries, bufs, evict) / onboarding(): disk blocks back into host slots
  spill_jobs.py  the write queue's spill writes, disk slots and the disk tier's evictions;
                 persist_deadline(entry): the disk copy's metadata follows a moved deadline
  read_jobs.py   read_batch(entries, scratch, ...): coalesced, verified disk reads into host slots;
                 read_from_disk(entry) (the files format)
This module: the books and pools, persist_retained / drain / stop (SIGTERM), recover() (the disk
index at start: kvservice.disk's metadata, or the files format's scan), remove(entry) (forget a
block everywhere: admin evict, corruption).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvservice.disk import block_file
from kvservice.ops.config import Config
from kvservice.disk.tier_io import TierIO, remove_v1_blocks
from kvservice.disk.disk_tier import DiskTier
from kvservice.placement.eviction import admission_gate, plan_disk_eviction
from kvservice.memory.host_tier import HostTier
from kvservice.core.host_room import HostRoom
from kvservice.core.lifecycle import Lifecycle
from kvservice.core.read_jobs import ReadJobs
from kvservice.core.spill_jobs import SpillJobs
from kvservice.placement.index import BlockIndex, DiskState, Entry
from kvservice.disk.io_backend import BlockIO
from kvservice.memory.host_arena import HostArena
from kvservice.placement.retention import Retention
from kvservice.ops.stats import CounterSet
from kvservice.core.types import BlockHash, NamespaceId
from kvservice.disk.write_queue import WriteQueue

log = logging.getLogger(__name__)

# spills one writer hands the disk tier at once (one DiskStore.write); KVTUNE_SPILL_BATCH_MIB: a
# benchmark's A/B (CPU box, 2 MiB blocks: 32 and 128 MiB spilled at the same rate)
SPILL_BATCH_BYTES = int(os.environ.get("KVTUNE_SPILL_BATCH_MIB", "32")) << 20


# the most new entries built ahead (BlankEntries): ~12 MiB of fixed overhead at 65536
BLANK_ENTRIES_MAX = 65536
# A Store into a full host tier (no disk tier) may take up to this many bytes past the tier's capacity and
# evict only once its copy is queued on the device (store_path: the evictions run beside the DMA instead of
# before it). KVTUNE_STORE_HEADROOM_MIB; at most half the host tier; 0: evict first, as with a disk tier.
STORE_HEADROOM_BYTES = max(0, int(float(os.environ.get("KVTUNE_STORE_HEADROOM_MIB", "256")) * (1 << 20)))


def spill_staging_bytes(config: Config) -> int:
    """Arena bytes beside the host tier for victims whose spill is queued or being written, so a
    Store does not wait for the disk: a quarter of the host tier, at least 64 MiB (at most the
    tier itself), at most 1 GiB; none without a disk tier (victims are dropped, never staged)."""
    if not config.has_disk:
        return 0
    host = config.host_capacity_bytes
    return min(host, max(64 << 20, min(host // 4, 1 << 30)))


def store_headroom_bytes(config: Config) -> int:
    """Arena bytes past the host tier a Store may hold while its evictions wait for its copy to be
    queued: STORE_HEADROOM_BYTES, at most half the tier, in whole pages; none with a disk tier (its
    victims spill, and a Store waits for what the write queue cannot take: that stays before the copy)."""
    if config.has_disk:
        return 0
    return min(STORE_HEADROOM_BYTES, config.host_capacity_bytes // 2) // 4096 * 4096


def arena_bytes(config: Config) -> int:
    """The host arena: the tier's capacity, the spill staging budget and the Stores' headroom."""
    return config.host_capacity_bytes + spill_staging_bytes(config) + store_headroom_bytes(config)


class Tiers(HostRoom, SpillJobs, ReadJobs):
    def __init__(self, config: Config, io: BlockIO, stats: CounterSet, clock_now, arena: HostArena) -> None:
        self.config = config
        self.io = io
        self.stats = stats
        self.now = clock_now
        self.index = BlockIndex()
        self.host = HostTier(arena, config.host_capacity_bytes,
                             min(store_headroom_bytes(config), max(0, arena.capacity_bytes - config.host_capacity_bytes)))
        self.disk = DiskTier(config.disk_path, config.disk_capacity_bytes) if config.has_disk else None
        self.segments: TierIO | None = None  # disk tier v2 (disk_format "segments"), opened by recover()
        self._writing: set[int] = set()  # segment slots with a write in flight
        self._budget_sizes: set[int] = set()  # block sizes the disk budget accounts for (_size_budget)
        self._arena_bytes: np.ndarray | None = None  # the arena as numpy (HostSlots' base), made on first use
        self.recovered_sizes: dict[NamespaceId, int] = {}  # recover(): block size of each namespace found on disk
        self.retention = Retention(config.max_ttl_seconds, config.retained_cap_bytes)
        # every block state change; new entries built ahead for Stores of up to max_batch_blocks (at most 65536)
        self.life = Lifecycle(self.index, self.host, self.retention, stats, self.disk,
                              blank_limit=min(config.max_batch_blocks, BLANK_ENTRIES_MAX))
        self.gate = admission_gate(config)
        self.reader_pool = ThreadPoolExecutor(config.reader_threads, thread_name_prefix="kv-read")
        self.writer_pool = ThreadPoolExecutor(config.writer_threads, thread_name_prefix="kv-write")
        # onboard_many's copies out of scratch buffers into host slots (off the event loop)
        self.onboard_pool = ThreadPoolExecutor(2, thread_name_prefix="kv-onboard")
        self._onboarding: set[asyncio.Future] = set()  # those copies in flight (their slots are loose)
        self.writes: WriteQueue[Entry] = WriteQueue(
            config.write_queue_depth, config.writer_threads, config.write_queue_policy,
            batch_handler=self._write_jobs, cost=lambda e: e.size, batch_bytes=SPILL_BATCH_BYTES)
        self.reads_in_flight = 0
        self._header_tasks: set[asyncio.Future] = set()  # header rewrites and spill submissions

    # --- lifecycle
    def start(self) -> None:
        if self.disk is not None:
            self.writes.start()

    async def persist_retained(self, now: float) -> int:
        """At shutdown: queue writes of unexpired retained blocks that live only in host memory,
        so a restart keeps what a client asked to keep. They stay in the host tier meanwhile."""
        if self.disk is None:
            return 0
        jobs: list[Entry] = []
        for e in list(self.host.entries_oldest_first()):
            if e.disk != DiskState.NONE or not e.retained(now):
                continue
            plan = plan_disk_eviction(self.disk, e.size, now, self.config.protect_unexpired)
            if plan is None:
                self.stats.bump(e.namespace, "admission_refusals")
                continue
            self._apply_disk_plan(plan)
            self.life.disk_queue(e)  # it stays in the host tier: the writer reads its slot
            if not self._reserve_slot(e, now):
                continue
            jobs.append(e)
        for e in jobs:
            await self.writes.submit(e, sheddable=False)
        return len(jobs)

    async def drain(self) -> None:
        while self._header_tasks:  # spill submissions first (they feed the queue), header rewrites
            await asyncio.gather(*self._header_tasks, return_exceptions=True)
        await self.writes.drain()
        if self._header_tasks:
            await asyncio.gather(*self._header_tasks, return_exceptions=True)

    async def stop(self) -> None:
        await self.writes.stop()
        if self.segments is not None:
            await asyncio.get_running_loop().run_in_executor(self.writer_pool, self.segments.close)
        self.reader_pool.shutdown(wait=True)
        self.writer_pool.shutdown(wait=True)
        self.onboard_pool.shutdown(wait=True)

    async def recover(self) -> int:
        """Index every complete block file; torn and corrupt ones were removed by the scan."""
        if self.disk is None:
            return 0
        if self.config.disk_format == "segments":
            return await self._recover_segments()
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(self.reader_pool, block_file.scan, self.disk.root)
        now = self.now()
        entries = [Entry(NamespaceId(meta.namespace), BlockHash(meta.hash), meta.payload_len, meta.checksum,
                         meta.stored_at, deadline=meta.deadline, reuse=meta.reuse, disk=DiskState.ON_DISK,
                         disk_path=path, disk_deadline=meta.deadline)
                   for path, meta in sorted(result.blocks, key=lambda b: b[1].stored_at)]
        self.life.adopt(entries)
        for e in entries:
            self.recovered_sizes[e.namespace] = e.size
        # a smaller capacity than last run: evict in the usual order until it fits
        if self.disk.free_bytes < 0:
            plan = plan_disk_eviction(self.disk, 0, now, protect_unexpired=False) or []
            self._apply_disk_plan(plan)
        log.info("disk tier recovered %d blocks (%d torn, %d corrupt removed)",
                 len(result.blocks), result.torn_removed, result.corrupt_removed)
        return len(result.blocks)

    async def _recover_segments(self) -> int:
        """Disk tier v2: open the store (its metadata says what is on disk, checked and with
        deadlines clamped to max_ttl) and index every block, oldest first."""
        assert self.disk is not None
        c, loop = self.config, asyncio.get_running_loop()
        v1 = await loop.run_in_executor(self.reader_pool, remove_v1_blocks, c.disk_path)
        if v1:
            log.warning("disk tier: removed %d block files of the one-file-per-block format (disk_format is segments)", v1)
        self.segments = await loop.run_in_executor(self.reader_pool, functools.partial(
            TierIO.open, c.disk_path, c.disk_capacity_bytes, max_ttl_seconds=c.max_ttl_seconds,
            writers=self.writer_pool, readers=self.reader_pool, now=self.now, durable=self.io.fsync,
            read_bytes_per_second=c.disk_read_bytes_per_second, write_bytes_per_second=c.disk_write_bytes_per_second))
        store = self.segments.store
        # the policy's byte budget: what is left after the metadata's fixed part, and its
        # per-slot part for each block size in use (_size_budget); what that misses (mixed slot
        # classes, a filesystem that filled first) is met by evicting a little more, _reserve_slot
        self.disk.budget_bytes = max(0, store.capacity_bytes - store.metadata_fixed_bytes)
        rec = store.recovered
        rows = rec.rows.rec[np.argsort(rec.rows.rec["stored_at"], kind="stable")]  # oldest first
        cols = [rows[f].tolist() for f in ("loc", "ns", "hash", "length", "crc", "deadline", "stored_at", "reuse")]
        names = rec.names
        ns_col = rows["ns"]
        for ns in np.flatnonzero(np.bincount(ns_col)).tolist() if len(ns_col) else ():  # each namespace's block size (newest row)
            self.recovered_sizes[names[ns]] = int(rows["length"][np.flatnonzero(ns_col == ns)[-1]])
        for size in set(self.recovered_sizes.values()):
            self._size_budget(size)
        gc_was_on = gc.isenabled()
        gc.disable()  # millions of new objects: generational passes over them would cost more than building them
        try:
            # positional, every field up to disk_deadline: keyword arguments make a dataclass
            # __init__ three times slower, and a loop setting the rest afterwards costs as much again
            on_disk = DiskState.ON_DISK
            entries = [Entry(names[ns], hsh, length, crc, stored, dl, reuse, -1, False, False, False, on_disk, "", loc, dl)
                       for loc, ns, hsh, length, crc, dl, stored, reuse in zip(*cols)]
            self.life.adopt(entries)
        finally:
            if gc_was_on:
                gc.freeze()  # long-lived: keep them out of every later collection
                gc.enable()
        log.info("disk tier (segments, %s): recovered %d blocks (%d bad rows, %d duplicates dropped, %d deadlines "
                 "clamped, %d orphan segments removed, %d unsafe files refused)", self.segments.name, len(rec),
                 rec.dropped_rows, rec.duplicate_rows, rec.clamped_deadlines, rec.orphans_removed, len(rec.unsafe_files))
        for u in rec.unsafe_files:
            log.warning("disk tier: refused %s", u)
        return len(rec)


    # --- host tier


    # --- disk tier


    # --- whole entries
    def remove(self, e: Entry) -> None:
        """Forget e everywhere (admin evict, discard). A queued spill is cancelled; a write
        already in progress removes its file when it finishes."""
        self.life.release(e)
        if e.disk != DiskState.NONE:
            self._drop_disk_copy(e)
        self._forget(e)

    def _forget(self, e: Entry) -> None:
        self.life.forget(e)

    def _meta(self, e: Entry) -> block_file.BlockMeta:
        return block_file.BlockMeta(namespace=e.namespace, hash=e.key.hash, payload_len=e.size, checksum=e.checksum,
                                    deadline=e.deadline, stored_at=e.stored_at, reuse=e.reuse)
