"""Tiers: the index, host tier, disk tier and retention, and every move between them.

Primitives (all state changes happen on the event loop thread; bytes move in thread pools):
  make_host_room(size, n, now) -> fit, spills   evict host LRU victims (spill or drop) so n blocks fit
  room_after(spills, now) -> future       queue those spills; resolves when their slots are free
  read_from_disk(entry) -> buffer         read and checksum-verify; a bad block is discarded
  onboard_many(entries, bufs, evict)      put disk blocks read into scratch back into the host tier
  remove(entry)                           forget a block everywhere (admin evict, corruption)
  persist_deadline(entry)                 rewrite a disk header after its deadline moved
  recover()                               rebuild the disk index from block files at start
                                          (disk_format "segments": from kvservice.disk's metadata)
  drain() / stop()                        finish queued spills (SIGTERM)
"""

from __future__ import annotations

import asyncio
import functools
import gc
import itertools
import logging
import operator
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kvservice.disk import block_file
from kvservice.ops.config import Config
from kvservice.disk import FaultKind, aligned_buffer
from kvservice.disk.batch_io import HostSlots
from kvservice.disk.slots import slot_class
from kvservice.disk.store import META_PER_SLOT, READ_FANOUT
from kvservice.disk.tier_io import BlockWrite, DiskFault, TierIO, remove_v1_blocks
from kvservice.disk.disk_tier import DiskTier
from kvservice.placement.eviction import DiskRoom, Victim, admission_gate, plan_disk_eviction
from kvservice.memory.host_tier import HostTier
from kvservice.core.lifecycle import Lifecycle
from kvservice.core.pipeline import when_copy_ends
from kvservice.placement.index import BlockIndex, DiskState, Entry
from kvservice.disk.io_backend import BlockIO, BlockIOError
from kvservice.memory.host_arena import HostArena
from kvservice.placement.retention import Retention
from kvservice.ops.stats import CounterSet
from kvservice.core.types import BlockHash, NamespaceId
from kvservice.disk.write_queue import WriteQueue

log = logging.getLogger(__name__)
_namespace_of = operator.attrgetter("namespace")
_deadline_of = operator.attrgetter("deadline")

SPILL_BATCH_BYTES = 32 << 20  # spills one writer hands the disk tier at once (one DiskStore.write)
READ_PARTS = 4  # a large Load's disk read: parts settled one by one (read_batch's on_part)
READ_PART_BYTES = 8 << 20  # at least this much per part


def _copy_rows(rows: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    for row, src in zip(rows, srcs):
        row.copy_(src)


def _count_namespaces(entries: list[Entry]) -> Counter:
    """Entries per namespace (a batch of one namespace, the usual one, without counting each)."""
    names = set(map(_namespace_of, entries))
    return Counter({names.pop(): len(entries)}) if len(names) == 1 else Counter(map(_namespace_of, entries))


class Tiers:
    def __init__(self, config: Config, io: BlockIO, stats: CounterSet, clock_now, arena: HostArena) -> None:
        self.config = config
        self.io = io
        self.stats = stats
        self.now = clock_now
        self.index = BlockIndex()
        self.host = HostTier(arena, config.host_capacity_bytes)
        self.disk = DiskTier(config.disk_path, config.disk_capacity_bytes) if config.has_disk else None
        self.segments: TierIO | None = None  # disk tier v2 (disk_format "segments"), opened by recover()
        self._writing: set[int] = set()  # segment slots with a write in flight
        self._budget_sizes: set[int] = set()  # block sizes the disk budget accounts for (_size_budget)
        self._arena_bytes: np.ndarray | None = None  # the arena as numpy (HostSlots' base), made on first use
        self.recovered_sizes: dict[NamespaceId, int] = {}  # recover(): block size of each namespace found on disk
        self.retention = Retention(config.max_ttl_seconds, config.retained_cap_bytes)
        self.life = Lifecycle(self.index, self.host, self.retention, stats, self.disk)  # every block state change
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

    # --- host tier
    def make_host_room(self, block_bytes: int, n: int, now: float) -> tuple[int, list[Entry]]:
        """Evict LRU victims so that n blocks of block_bytes can be placed in the arena, or as many
        as the pins allow. Returns (fit, spills): `fit` blocks are placeable once the `spills` have
        been written (await Tiers.room_after(spills)); victims with a disk copy, or dropped, gave
        their slots back at once. No await: nothing can come between the plan and the evictions,
        and the caller has no reservation to undo."""
        host = self.host
        if host.placeable(block_bytes) >= n:
            return n, []
        # two budgets: arena slots (segments of one block size) and the tier's capacity in bytes
        phys = host.arena.placeable(block_bytes)
        room = host.free_bytes
        have = min(phys, room // block_bytes)
        if host.arena.holds_only(block_bytes):
            # every resident block is of block_bytes: each victim frees one slot and block_bytes of
            # room, so `have` grows by one per victim: the first n - have candidates, taken as a batch
            victims = self._host_victims(now, n - have)
            have += len(victims)
        else:
            victims = []
            freed_in: dict[int, int] = {}
            slot_freeing = host.arena.slot_freeing
            k = 0  # have only grows: the shortest prefix of victims that makes room for `fit` ends where it last grew
            for e in self._host_candidates(now):
                size = e.size
                phys += 1 if size == block_bytes else slot_freeing(e.slot, size, block_bytes, freed_in)
                room += size
                victims.append(e)
                now_have = min(phys, room // block_bytes)
                if now_have > have:
                    have, k = now_have, len(victims)
                    if have >= n:
                        break
            del victims[k:]
        fit = min(n, have)
        # retained victims claim disk room before best-effort ones
        if self.disk is not None and victims and max(map(_deadline_of, victims)) > now:
            victims.sort(key=lambda e: not e.retained(now))
        spills = self._evict_victims(victims, now, plain=host.arena.holds_only(block_bytes))
        return fit, spills

    def room_after(self, spills: list[Entry], now: float, block_bytes: int = 0, fit: int = 0) -> asyncio.Future | None:
        """Queue the spills make_host_room chose; returns what to wait for before their room can be
        taken (None: nothing): queue room under the "wait" policy, and the writes of victims that
        found the spill staging budget full. When the `fit` blocks of block_bytes need the very
        slots the victims hold (another block size: a whole segment must empty first), the writes
        of staged victims too. The work is the tiers' own: a caller awaiting this through
        asyncio.shield may be cancelled without abandoning a spill."""
        slots_needed = (fit > 0 and any(v.size != block_bytes for v in spills)
                        and self.host.arena.placeable(block_bytes) < fit)
        pending = self.spill(spills, now)
        freed = self.host.freed(spills, staged_too=slots_needed)
        waits = [f for f in (pending, freed) if f is not None]
        if not waits:
            return None
        return waits[0] if len(waits) == 1 else asyncio.gather(*waits)

    def spill(self, spills: list[Entry], now: float) -> asyncio.Future[None] | None:
        """Queue spills. What the queue cannot take now is submitted by a task of the tiers' own,
        returned (backpressure under the "wait" policy). drain() waits for these tasks.
        None: all queued."""
        for k, v in enumerate(spills):
            if not self.writes.try_submit(v):  # the queue is full: the rest waits (or sheds) in a task
                task = asyncio.ensure_future(self._submit_spills(spills[k:], now))
                self._header_tasks.add(task)
                task.add_done_callback(self._header_tasks.discard)
                return task
        return None

    async def _submit_spills(self, spills: list[Entry], now: float) -> None:
        """A spill not submitted (the daemon is stopping) is abandoned, never left QUEUED."""
        for k, v in enumerate(spills):
            try:
                await self._submit_spill(v, now)
            except BaseException:
                for rest in spills[k:]:
                    if rest.disk == DiskState.QUEUED:
                        self.stats.bump(rest.namespace, "drops_pressure")
                        self._abandon_spill(rest)
                raise

    def _host_candidates(self, now: float):
        """Host entries that may be evicted, oldest first. Under protect-unexpired, an unexpired
        retained block the disk could not admit is not one: evicting it could only drop it."""
        protect = self.disk is not None and (self.config.protect_unexpired or self._disk_unwritable())
        room = self._disk_room(now) if protect else None
        for e in self.host.entries_oldest_first():
            if e.pins or e.lease_until > now:  # pinned(now), inlined: this loop runs once per victim
                continue
            if room is not None and e.disk == DiskState.NONE and e.retained(now) and not room.take(e.size):
                continue
            yield e

    def _host_victims(self, now: float, want: int) -> list[Entry]:
        """The first `want` of _host_candidates (fewer if there are not as many), filtered a slice
        of the LRU at a time: exactly the entries the generator would look at, so the disk room
        is asked for the same ones, without a generator step per victim."""
        if want <= 0:
            return []
        protect = self.disk is not None and (self.config.protect_unexpired or self._disk_unwritable())
        room = self._disk_room(now) if protect else None
        it = iter(self.host.entries_oldest_first())
        out: list[Entry] = []
        none = DiskState.NONE
        while len(out) < want:
            chunk = list(itertools.islice(it, want - len(out)))
            if not chunk:
                break
            if room is None:
                out += [e for e in chunk if not e.pins and e.lease_until <= now]
            else:
                take = room.take
                out += [e for e in chunk if not e.pins and e.lease_until <= now
                        and (e.disk != none or e.deadline <= now or take(e.size))]
        return out

    def host_blockers(self, now: float) -> tuple[int, int]:
        """(pinned, protected) bytes of host blocks make_host_room may not evict now: pinned by
        copies, reads or leases, or unexpired retained ones the disk cannot admit (protect-unexpired).
        For a refused Store's message: without protection the walk stops at the first pinned block
        (pinned is then that block's bytes, not the sum), so a tier pinned by leases is not walked
        whole on every refused Store."""
        protect = self.disk is not None and (self.config.protect_unexpired or self._disk_unwritable())
        room = self._disk_room(now) if protect else None
        pinned = protected = 0
        for e in self.host.entries_oldest_first():
            if e.pinned(now):
                pinned += e.size
                if room is None:
                    break
            elif room is not None and e.disk == DiskState.NONE and e.retained(now) and not room.take(e.size):
                protected += e.size
        return pinned, protected

    def _disk_room(self, now: float) -> DiskRoom:
        """Disk bytes a spill could get without evicting an unexpired retained block (counted lazily)."""
        assert self.disk is not None
        return DiskRoom.none() if self._disk_unwritable() else DiskRoom.of(self.disk, now)

    def protection_reason(self) -> str:
        """Why unexpired retained host blocks cannot spill now (for a refused Store's message)."""
        if self._disk_unwritable():
            assert self.segments is not None
            return f"the disk tier cannot be written: {self.segments.store.refusal()}"
        return "the disk tier is full of unexpired retained blocks and protect_unexpired is on"

    def _disk_unwritable(self) -> bool:
        """Disk tier v2 on a read-only filesystem (at open, or its last spill said EROFS): retained
        blocks must stay in host memory."""
        store = self.segments.store if self.segments is not None else None
        return store is not None and (store.readonly or store.read_only_fault is not None)

    def _evict_from_host(self, e: Entry, now: float) -> bool:
        """Take e out of the host tier; True when it was given disk room and must be spilled (its
        slot stays until the write ends), False when its slot went back at once."""
        self.stats.bump(e.namespace, "host_evictions")
        if e.disk != DiskState.NONE:
            self.life.evict(e, keep_slot=False)  # a disk copy exists or is being written
            return False
        if self.disk is None:
            self.stats.bump(e.namespace, "drops_no_disk")
            self._drop(e)
            return False
        if not e.retained(now) and not self.gate(e, now):
            self.stats.bump(e.namespace, "drops_gate")
            self._drop(e)
            return False
        plan = plan_disk_eviction(self.disk, e.size, now, self.config.protect_unexpired)
        if plan is None:
            self.stats.bump(e.namespace, "admission_refusals")
            self._drop(e)
            return False
        self._apply_disk_plan(plan)
        self.life.disk_queue(e)
        if not self._reserve_slot(e, now):
            self._drop(e)
            return False
        self.life.evict(e, keep_slot=True)
        return True

    def _evict_victims(self, victims: list[Entry], now: float, plain: bool = False) -> list[Entry]:
        """_evict_from_host for each victim, in one pass: the ones with a disk copy and the ones
        dropped (no disk tier, or the gate says no) leave the host tier as one batch first (a disk
        plan of the rest may then forget a released one); the rest are planned one by one.
        plain: the victims are unpinned resident blocks of one size (make_host_room's fast path)."""
        no_disk = self.disk is None
        rest: list[Entry] = []
        if no_disk:  # nowhere to spill: every victim is dropped
            release: list[Entry] = []
            drop = victims
        else:
            none = DiskState.NONE
            release = [e for e in victims if e.disk != none]
            drop = []
            if len(release) < len(victims):
                gate = self.gate
                for e in victims:
                    if e.disk != none:
                        continue
                    if not e.retained(now) and not gate(e, now):
                        drop.append(e)
                    else:
                        rest.append(e)
        if release or drop:
            dropped = _count_namespaces(drop)
            for ns, k in dropped.items():
                self.stats.bump(ns, "drops_no_disk" if no_disk else "drops_gate", k)
            for ns, k in (dropped + _count_namespaces(release) if release else dropped).items():
                self.stats.bump(ns, "host_evictions", k)
            self.life.evict_many(release + drop if release else drop, plain=plain)
            if drop:
                self.life.forget_many(drop)
        return self._spill_victims(rest, now)

    def _spill_victims(self, victims: list[Entry], now: float) -> list[Entry]:
        """_evict_from_host for host victims that have no disk copy and may spill, as a batch
        (disk tier v2): one disk eviction plan for all their bytes, the planned disk blocks freed
        with one store call, one slot reservation call; a victim the store gives no slot falls
        back to _reserve_slot's evict-and-retry. When the plan for all of them fails (protected
        blocks), block by block as before, so the ones that fit still spill."""
        if self.segments is None or len(victims) < 2:
            return [e for e in victims if self._evict_from_host(e, now)]
        for size in {e.size for e in victims}:
            self._size_budget(size)
        plan = plan_disk_eviction(self.disk, sum(e.size for e in victims), now, self.config.protect_unexpired)
        if plan is None:
            return [e for e in victims if self._evict_from_host(e, now)]
        self._count_by_ns(victims, "host_evictions")
        self._apply_disk_plan(plan, batch=True)
        for e in victims:
            self.life.disk_queue(e)
        locs = self.segments.reserve_many([e.size for e in victims])
        out = []
        for e, loc in zip(victims, locs):
            if loc is not None:
                self.life.disk_slot(e, loc)
            elif not self._reserve_slot(e, now):
                self._drop(e)
                continue
            self.life.evict(e, keep_slot=True)
            out.append(e)
        return out

    def _count_by_ns(self, entries: list[Entry], counter: str) -> None:
        for ns, k in Counter(map(_namespace_of, entries)).items():
            self.stats.bump(ns, counter, k)

    def _drop(self, e: Entry) -> None:
        self.life.evict(e, keep_slot=False)
        self._forget(e)

    async def _submit_spill(self, e: Entry, now: float) -> None:
        # retained spills are never shed: they wait for room in the queue like under "wait"
        if not await self.writes.submit(e, sheddable=not e.retained(now)):
            self.stats.bump(e.namespace, "drops_pressure")
            self._abandon_spill(e)

    async def onboard_many(self, entries: list[Entry], bufs: list[torch.Tensor], evict: bool = True) -> int:
        """Keep disk blocks read into scratch buffers (a Load's or a Prefetch's, that found no free
        or clean host slot) in the host tier, evicting for them (evict=False: free slots only):
        per block size one make_host_room
        (the victims' spills queued together), one wait for their room, then the slots taken and
        filled on a copy thread, and given to their blocks once the copy has ended. The copy runs
        off the event loop: a Load's reply (which this may run beside, after the Load has answered)
        and every other client's calls do not wait for tens of MiB of memcpy. Meanwhile the slots
        are the host tier's loose slots (taken, no block's yet); cancelled, they go back once the
        copy thread is done with them. A block that left the index or got a host copy meanwhile is
        skipped (its slot goes back). Returns how many blocks were onboarded."""
        holds = self.index.holds
        done = 0
        by_size: dict[int, list[int]] = {}
        for i, e in enumerate(entries):
            by_size.setdefault(e.size, []).append(i)
        for size, idxs in by_size.items():
            seen: set[int] = set()  # the same block twice: onboarded once
            live = [i for i in idxs if holds(entries[i]) and not entries[i].in_memory
                    and not (id(entries[i]) in seen or seen.add(id(entries[i])))]
            if not live:
                continue
            if evict and self.host.placeable(size) < len(live):
                now = self.now()
                fit, spills = self.make_host_room(size, len(live), now)
                wait = self.room_after(spills, now, size, fit)
                if wait is not None:
                    await asyncio.shield(wait)
                live = [i for i in live if holds(entries[i]) and not entries[i].in_memory]
            k = min(len(live), self.host.placeable(size))
            offsets = self.host.alloc(size, k) if k else None
            if not offsets:
                continue
            take = live[:k]
            job = asyncio.get_running_loop().run_in_executor(
                self.onboard_pool, _copy_rows, [self.host.arena.row(off, size) for off in offsets],
                [bufs[i].view(torch.uint8).reshape(-1) for i in take])
            self._onboarding.add(job)
            job.add_done_callback(self._onboarding.discard)
            try:
                await asyncio.shield(job)
            except BaseException:  # cancelled, or the copy failed: the slots go once no thread writes them
                when_copy_ends(job, functools.partial(self.host.free, offsets, size))
                raise
            adds: list[Entry] = []
            add_offs: list[int] = []
            spare: list[int] = []
            for i, off in zip(take, offsets):
                e = entries[i]
                if holds(e) and not e.in_memory:
                    adds.append(e)
                    add_offs.append(off)
                else:  # forgotten, or in host memory by another call, while the copy ran
                    spare.append(off)
            if spare:
                self.host.free(spare, size)
            if adds:
                self.life.add(adds, add_offs)
                self._count_by_ns(adds, "disk_onboards")
                done += len(adds)
        return done

    def onboarding(self) -> asyncio.Future | None:
        """What to wait for before the slots of the onboarding copies in flight are blocks' again
        (then evictable like any host block: they have a disk copy); None when there are none. A
        Store that finds the tier short waits for this rather than be refused for slots that are
        only loose for the time of a memcpy."""
        if not self._onboarding:
            return None
        return asyncio.gather(*self._onboarding, return_exceptions=True)

    # --- disk tier
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
        self._writing.update(locs)
        self.life.pin(batch)  # the store reads the blocks' host slots: they must not be freed or reused meanwhile
        job = self.segments.write_many(locs, blocks, self._host_slots(batch, [e.slot for e in batch]))
        settled = asyncio.get_running_loop().create_future()

        def settle(j: asyncio.Future) -> None:
            err = j.exception() if not j.cancelled() else asyncio.CancelledError()
            if err is not None:
                log.error("spill batch of %d blocks failed: %r", len(batch), err)
            faults = j.result() if err is None else [
                DiskFault(FaultKind.IO_ERROR, f"spill failed: {err!r}")] * len(batch)
            self._writing.difference_update(locs)
            self.life.unpin(batch)
            spilled: dict[str, int] = {}
            for e, loc, block, fault in zip(batch, locs, blocks, faults):
                if self._settle_spill(e, loc, block, fault):
                    spilled[e.namespace] = spilled.get(e.namespace, 0) + 1
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

    def _clean_room(self, size: int, want: int, now: float) -> None:
        """Evict the oldest host blocks that have a disk copy (their slots go back at once, nothing
        to write) until `want` blocks of `size` are placeable; looks at a bounded number of them.
        Each clean block of `size` frees exactly one placeable slot: the leading run of those
        leaves as one batch (one arena call); other sizes are checked one by one."""
        short = want - self.host.placeable(size)
        if short <= 0:
            return
        clean = []
        for k, e in enumerate(self.host.entries_oldest_first()):
            if k >= 4 * want + 64:
                break
            if e.disk == DiskState.ON_DISK and not e.pinned(now):
                clean.append(e)
        same = 0
        while same < len(clean) and same < short and clean[same].size == size:
            same += 1
        if same:
            self._count_by_ns(clean[:same], "host_evictions")
            self.life.evict_many(clean[:same])
        for e in clean[same:]:
            if self.host.placeable(size) >= want:
                return
            self._evict_from_host(e, now)

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
