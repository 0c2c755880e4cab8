"""Making room in the host tier (a mixin of tiers.Tiers: it runs on the Tiers' state).

  make_host_room(size, n, now) -> fit, spills   evict LRU victims so n blocks fit: a victim with a disk copy
                                                or dropped (no disk, the gate) frees its slot at once; the
                                                rest get disk room and a slot and spill (room_after)
  headroom_fits(size, n, now), trim_host(...)  a Store past the capacity, into the headroom, evicting once
                                                its copy is queued (no disk tier)
  room_after(spills, now) -> future             queue those spills; what to wait for before their room is free
  host_blockers / protection_reason             why a Store finds no room (pins, protected retained blocks)
  onboard_many(entries, bufs, evict)            disk blocks read into scratch, put back in host slots: one
                                                eviction plan, the copy on a thread, loose slots meanwhile
  onboarding() -> future | None                 those copies in flight (a Store short of room waits for them)
Which victims, in which order: kvservice.placement (lru, eviction, retention), pure policies.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import operator
from collections import Counter

import torch

from kvservice.placement.eviction import DiskRoom, plan_disk_eviction
from kvservice.placement.index import DiskState, Entry

log = logging.getLogger(__name__)
_namespace_of = operator.attrgetter("namespace")
_deadline_of = operator.attrgetter("deadline")


def _copy_rows(rows: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    for row, src in zip(rows, srcs):
        row.copy_(src)


def _count_namespaces(entries: list[Entry]) -> Counter:
    """Entries per namespace (a batch of one namespace, the usual one, without counting each)."""
    names = set(map(_namespace_of, entries))
    return Counter({names.pop(): len(entries)}) if len(names) == 1 else Counter(map(_namespace_of, entries))


class HostRoom:
    """Host-tier room, evictions and onboarding; mixed into Tiers, whose state it uses:
    self.host, self.disk, self.life, self.index, self.stats, self.config, self.gate, self.segments, self.writes,
    self.now, self.onboard_pool, self._onboarding, self._header_tasks, and SpillJobs' _reserve_slot,
    _size_budget, _apply_disk_plan, _abandon_spill."""

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
            if self.disk is None:  # all dropped: chosen and taken out of the LRU in one walk
                victims = host.take_oldest(n - have, now)
                self._evict_victims(victims, now, plain=True, taken=True)
                return min(n, have + len(victims)), []
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

    def headroom_fits(self, block_bytes: int, n: int, now: float) -> bool:
        """Whether a Store of n blocks of block_bytes, which do not fit the tier's capacity now, may take
        slots in the host tier's headroom and evict after its copy is queued (trim_host): no disk tier
        (victims are dropped: nothing to wait for), one block size in the arena, the headroom has the
        slots, and the unpinned blocks can make up what it takes past the capacity. Otherwise the Store
        evicts first (make_host_room), refusals and all. No await, no change."""
        host = self.host
        if not host.headroom_bytes or self.disk is not None or not host.arena.holds_only(block_bytes):
            return False
        if host.placeable_over(block_bytes) < n:
            return False
        past = -(-(n * block_bytes - host.free_bytes) // block_bytes)  # blocks past the capacity once taken
        return len(host) - host.counts.pinned_blocks(now) >= past

    def trim_host(self, block_bytes: int, now: float) -> None:
        """After a Store took headroom (headroom_fits) and its copy is queued: drop LRU victims until the
        tier is back within its capacity, or as many as the pins allow now (the next Store's plan evicts
        the rest before it copies). No await."""
        host = self.host
        if host.used_bytes > host.capacity_bytes:
            self.make_host_room(block_bytes, 0, now)  # n = 0: what makes free_bytes >= 0 (no disk: no spills)

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
        k = self.writes.try_submit_many(spills)
        if k == len(spills):
            return None
        task = asyncio.ensure_future(self._submit_spills(spills, k, now))  # the queue is full: the rest waits (or sheds)
        self._header_tasks.add(task)
        task.add_done_callback(self._header_tasks.discard)
        return task

    async def _submit_spills(self, spills: list[Entry], k: int, now: float) -> None:
        """Submit spills[k:] as the queue makes room, each run that fits with one call. Under the
        "shed" policy a best-effort spill that finds the queue full is dropped (retained ones wait).
        A spill not submitted (the daemon is stopping) is abandoned, never left QUEUED."""
        writes = self.writes
        shed = writes.policy == "shed"
        try:
            while k < len(spills):
                k = writes.try_submit_many(spills, k)
                if k == len(spills):
                    break
                v = spills[k]
                if shed and not v.retained(now):
                    self.stats.bump(v.namespace, "drops_pressure")
                    self._abandon_spill(v)
                    k += 1
                    continue
                await writes.room()
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

    def _evict_victims(self, victims: list[Entry], now: float, plain: bool = False,
                       taken: bool = False) -> list[Entry]:
        """_evict_from_host for each victim, in one pass: the ones with a disk copy and the ones
        dropped (no disk tier, or the gate says no) leave the host tier as one batch first (a disk
        plan of the rest may then forget a released one); the rest are planned one by one.
        plain: the victims are unpinned resident blocks of one size (make_host_room's fast path);
        taken: plain ones, with no disk tier, out of the LRU already (HostTier.take_oldest)."""
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
            if no_disk and taken:  # the usual batch with no disk tier, out of the LRU already: one pass
                self.life.drop_plain(drop, dropped)
            else:
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
            out.append(e)
        self.life.evict_to_spill_many(out)
        return out

    def _count_by_ns(self, entries: list[Entry], counter: str) -> None:
        for ns, k in Counter(map(_namespace_of, entries)).items():
            self.stats.bump(ns, counter, k)

    def _drop(self, e: Entry) -> None:
        self.life.evict(e, keep_slot=False)
        self._forget(e)

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
            abandoned, added = [False], [0]
            # settled in the job's first done callback, before anything waiting on the job resumes (a
            # Store waiting in onboarding() then finds the blocks resident, not their slots still loose)
            job.add_done_callback(functools.partial(self._settle_onboard, [entries[i] for i in take], offsets, size,
                                                    abandoned, added))
            self._onboarding.add(job)  # until _settle_onboard
            try:
                await asyncio.shield(job)
            except BaseException:  # cancelled, or the copy failed: the slots go back once no thread writes them
                abandoned[0] = True
                raise
            done += added[0]
        return done

    def _settle_onboard(self, entries: list[Entry], offsets: list[int], size: int, abandoned: list[bool],
                        added: list[int], job: asyncio.Future) -> None:
        """onboard_many's copy has ended (the loop, at once): its slots become the blocks' host copies;
        back to the arena if the copy failed, the call was cancelled, or a block was forgotten or put in
        host memory by another call meanwhile."""
        self._onboarding.discard(job)
        failed = job.cancelled() or job.exception() is not None
        adds: list[Entry] = []
        add_offs: list[int] = []
        spare: list[int] = []
        holds = self.index.holds
        for e, off in zip(entries, offsets):
            if not failed and not abandoned[0] and holds(e) and not e.in_memory:
                adds.append(e)
                add_offs.append(off)
            else:
                spare.append(off)
        if spare:
            self.host.free(spare, size)
        if adds:
            self.life.add(adds, add_offs)
            self._count_by_ns(adds, "disk_onboards")
        added[0] = len(adds)

    def onboarding(self) -> asyncio.Future | None:
        """What to wait for before the slots of the onboarding copies in flight are blocks' again
        (then evictable like any host block: they have a disk copy); None when there are none. A
        Store that finds the tier short waits for this rather than be refused for slots that are
        only loose for the time of a memcpy."""
        if not self._onboarding:
            return None
        return asyncio.gather(*self._onboarding, return_exceptions=True)
