"""The Load path of BlockCache (a mixin: it runs on BlockCache's state).

  load(hashes, block_ids)  pin what is found; host hits: copied to the engine (a large Load's head in
                           parts, pipeline.parts, each part looked up and pinned beside the copies
                           of the ones before); disk blocks: one coalesced read that lands in host slots
                           where there is room (their host copy, no second copy), verified, then one
                           copy job; a block that cannot be served is MISSING or FAILED, never
                           substituted. Pins are dropped once the copy thread is done with the slots.
"""

from __future__ import annotations

import asyncio
import functools
import operator
import time
from collections.abc import Callable, Sequence

import torch

from kvservice.core import pipeline
from kvservice.core.sessions import Session
from kvservice.core.types import LoadResults, LoadStatus, SessionId, Tier
from kvservice.disk.io_backend import BlockIOError
from kvservice.memory.host_arena import HostArena
from kvservice.ops.trace import TRACE
from kvservice.placement.index import DiskState, Entry

_slot_of = operator.attrgetter("slot")
_LOADED, _HOST = bytes((LoadStatus.LOADED,)), bytes((Tier.HOST,))  # one byte each (LoadResults are bytearrays)


class LoadPath:
    """Load; mixed into BlockCache, whose state it uses:
    self._t (Tiers), self.stats, self.config, self._copy_pool, self._copy(), self._later(), self._load_latency,
    self._session(), self._hashes(), self._block_ids()."""

    async def load(self, session_id: SessionId, hashes: bytes | Sequence[bytes], block_ids: Sequence[int],
                   namespace_id: str = "", answer: pipeline.Answer | None = None) -> LoadResults:
        """Fill engine blocks block_ids[i] with the blocks stored as hashes[i]; returns once they landed.
        A large Load (more than 2 x pipeline.PIPELINE_BLOCKS) goes in parts while its blocks are ready
        host hits: each part looked up, pinned and handed to a copy thread in turn, the next part's
        lookup beside the copies in flight (_load_host_parts); whatever follows the first part that is
        not all host hits goes the general way (_load_found), as one batch.
        answer: called with the results once the last copy has landed and every status is final,
        before the pins and the LRU refresh that follow (no await from there to the return;
        pipeline.Answer)."""
        t0 = time.perf_counter()
        s = self._session(session_id, namespace_id)
        hs = self._hashes(hashes)
        ids = self._block_ids(s, len(hs), block_ids)
        call = TRACE.begin("load", len(hs))
        results = LoadResults(len(hs))
        done, head = 0, []
        if pipeline.in_parts(len(hs), s.block_bytes, pipeline.LOAD_FIRST_BYTES):
            def all_copied() -> None:  # every block served by the parts: final before their last bookkeeping
                self._answer_loaded(results, len(hs))
                if answer is not None:
                    answer(results)
            done, head = await self._load_host_parts(s, hs, ids, call, all_copied)
            if done:
                self._answer_loaded(results, done)
                self.stats.bump(s.namespace, "loads_host", done)
        if done < len(hs):
            rest = results if not done else LoadResults(len(hs) - done)
            await self._load_found(s, hs[done:] if done else hs, ids[done:] if done else ids, rest, call,
                                   None if done else answer)
            if done:
                results.status[done:], results.tier[done:] = rest.status, rest.tier
                results.messages.update((done + i, m) for i, m in rest.messages.items())
                self._t.host.touch(head)  # the chain's head newest again (the rest was refreshed after it)
                if self._t.disk is not None:
                    self._t.disk.touch(head)
        self._load_latency.observe(time.perf_counter() - t0)
        pipeline.fail_unanswered(results, LoadStatus.FAILED)
        TRACE.mark(call, "end")
        return results

    async def _load_found(self, s: Session, hs: list[bytes], ids: list[int], results: LoadResults,
                          call: int = 0, answer: pipeline.Answer | None = None) -> None:
        """Load hs into ids as one batch (results: theirs, in order): pin what is found; host hits
        and disk blocks (_collect_bytes) copied with one job; MISSING / FAILED for the rest.
        answer: called once the statuses are final, before the pins and LRU refresh."""
        t = self._t
        life = t.life
        on_disk_state = DiskState.ON_DISK
        found: list[Entry] = list(map(t.index.namespace(s.namespace).get, hs))
        missing = [i for i, e in enumerate(found)
                   if e is None or not e.ready or (e.slot < 0 and e.disk != on_disk_state)]
        if not missing:  # every block found (the usual Load): no per-block split
            pos: list[int] = list(range(len(hs)))  # positions found
            bids = ids
        else:
            gone = set(missing)
            pos = [i for i in range(len(hs)) if i not in gone]
            found = [found[i] for i in pos]
            bids = [ids[i] for i in pos]
            status = results.status
            for i in missing:
                status[i] = LoadStatus.MISSING
            self.stats.bump(s.namespace, "load_misses", len(missing))
        life.pin(found)
        TRACE.mark(call, "pinned")
        handed_over = False  # once the scatter runs, its thread drops the pins when it is done
        try:
            host_ids, host_slots, srcs, disk_ids, served, tiers_of, disk_loads = await self._collect_bytes(
                s, pos, bids, found, results)
            if host_ids or srcs:
                handed_over = True
                TRACE.mark(call, "submitted")
                await self._copy(_scatter, s.memory, t.host.arena, host_ids, host_slots, disk_ids, srcs,
                                 on_abandon=lambda: life.unpin(found))
                TRACE.mark(call, "copied")
            status, tiers = results.status, results.tier
            loaded = int(LoadStatus.LOADED)
            if len(served) == len(status):  # all served, in order: whole-array results
                status[:] = _LOADED * len(status)
                tiers[:] = bytes(tiers_of)
            else:
                for k in served:
                    i = pos[k]
                    status[i] = loaded
                    tiers[i] = tiers_of[k]
            if answer is not None:  # the engine reads its reply while the rest is done (no await from here on)
                answer(results)
            chain = [found[k] for k in served] if len(served) < len(found) else found
            life.loaded(s.id, chain)
            if len(served) - disk_loads:
                self.stats.bump(s.namespace, "loads_host", len(served) - disk_loads)
            if disk_loads:
                self.stats.bump(s.namespace, "loads_disk", disk_loads)
            t.host.touch(chain)
            if t.disk is not None:
                t.disk.touch(chain)
            life.unpin(found)
        except BaseException:
            if not handed_over:
                life.unpin(found)
            raise

    async def _load_host_parts(self, s: Session, hs: list[bytes], ids: list[int], call: int = 0,
                               all_copied: Callable[[], None] | None = None) -> tuple[int, list[Entry]]:
        """Load the head of a large batch from the host tier in parts (pipeline.parts), while each
        part is all ready host hits: a part is looked up, pinned and handed to a copy thread with no
        await between, the next one's lookup and the finished ones' bookkeeping (reuse, leases used,
        their pins) beside the copies in flight (at most pipeline.PIPELINE_DEPTH). Returns how many
        blocks, from the head, were loaded (0: the first part was not all host hits; nothing
        pinned) and their entries. The first part that is not stays unpinned and untouched: the
        caller loads it and the rest as one batch. Every pin is dropped: a part's when its copy has ended (also when
        the call is cancelled or a copy fails). The served chain is refreshed head newest, once
        every part is handed over (beside the last copies). all_copied(): called once the last copy of
        a batch served whole by the parts has landed, before that part's bookkeeping."""
        t = self._t
        life = t.life
        get = t.index.namespace(s.namespace).get
        loop = asyncio.get_running_loop()
        n = len(hs)
        jobs: list[tuple[asyncio.Future, list[Entry]]] = []
        done = 0  # jobs[:done] ended and were settled
        served = 0  # hs[:served] are pinned and handed to copies
        chain: list[Entry] = []

        def landed(k: int) -> Callable[[], None] | None:  # all_copied for the last part of a batch served whole
            return all_copied if served == n and k == len(jobs) - 1 else None

        def touch_served() -> None:  # the served head, newest first, as one chain (a failed copy leaves it refreshed: harmless)
            nonlocal chain
            chain = [e for _, part in jobs for e in part]
            t.host.touch(chain)
            if t.disk is not None:
                t.disk.touch(chain)
        try:
            for lo, hi in pipeline.parts(n, s.block_bytes, pipeline.LOAD_FIRST_BYTES, pipeline.LOAD_GROW):
                found = list(map(get, hs[lo:hi]))
                slots = _host_slots(found)
                if slots is None:  # a miss, a block not ready or only on disk: the rest goes the general way
                    break
                life.pin(found)
                if not lo:
                    TRACE.mark(call, "pinned")
                copy, enq = pipeline.copy_call(s.memory, "scatter_from", loop)
                jobs.append((loop.run_in_executor(self._copy_pool, copy, ids[lo:hi], t.host.arena, slots), found))
                served = hi
                TRACE.mark(call, "submitted")
                if enq is not None:  # any bookkeeping once this copy is queued (or over): pipeline.LOAD_ENQUEUE_FIRST
                    await asyncio.wait((enq, jobs[-1][0]), return_when=asyncio.FIRST_COMPLETED)
                    TRACE.mark(call, "enqueued")
                if hi == n:  # the whole batch handed over: its chain refreshed while the last two parts copy
                    touch_served()  # (after the wait below, the device would sit idle through it: 2.6 ms of 32768 blocks on the H100)
                while len(jobs) - done >= pipeline.PIPELINE_DEPTH:
                    await self._settle_part(s, jobs[done], call, landed(done))
                    done += 1
            if served and not chain:  # a part that was not all host hits ended the loop: the head served so far
                touch_served()
            while done < len(jobs):
                await self._settle_part(s, jobs[done], call, landed(done))
                done += 1
        except BaseException:
            for fut, part in jobs[done:]:  # each part's pins go once its copy thread is done with them
                pipeline.when_copy_ends(fut, functools.partial(life.unpin, part))
            raise
        return served, chain

    async def _settle_part(self, s: Session, job: tuple[asyncio.Future, list[Entry]], call: int,
                           landed: Callable[[], None] | None = None) -> None:
        """A part of _load_host_parts: its copy's end awaited, then landed() (if any), then its
        blocks' reuse and leases counted and their pins dropped (a failure raises before: the caller
        drops the pins once the copy thread is done)."""
        fut, part = job
        await asyncio.shield(fut)
        TRACE.mark(call, "copied")
        if landed is not None:
            landed()
        life = self._t.life
        life.loaded(s.id, part)
        life.unpin(part)

    @staticmethod
    def _answer_loaded(results: LoadResults, n: int) -> None:
        """LOADED from the host tier for the first n blocks."""
        results.status[:n] = _LOADED * n
        results.tier[:n] = _HOST * n

    async def _collect_bytes(self, s: Session, pos: list[int], bids: list[int], found: list[Entry],
                             results: LoadResults):
        """Where the found blocks' bytes come from: host slots (engine ids + slot offsets, copied
        with one scatter_from per batch, no per-block tensor), and disk blocks read (and verified) as
        one batch, landing in host slots that become their host copy where the host tier has room
        (engine ids + buffers). `served`: the indexes into found that are served, in request order;
        `tiers_of[k]`: the tier found[k] is served from."""
        t = self._t
        host = int(Tier.HOST)
        # slots are pinned by the caller: a spill that finishes meanwhile leaves them in place
        slots = list(map(_slot_of, found))
        if not found or min(slots) >= 0:  # all host hits: one scatter_from of their slots
            return bids, slots, [], [], range(len(found)), [host] * len(found), 0
        on_disk = [k for k, off in enumerate(slots) if off < 0]
        disk_entries = [found[k] for k in on_disk]
        early: list[asyncio.Future] = []  # copies of disk blocks that landed while the rest was read
        copied: set[int] = set()  # their indexes into found

        def landed(first: int, part: list) -> None:  # read_batch's on_part, on the loop
            ks = [on_disk[first + j] for j, (_, onboarded) in enumerate(part) if onboarded]
            if not ks:
                return
            es = [found[k] for k in ks]
            t.life.pin(es)  # the copy reads their slots: held until it has ended, whatever the Load does
            job = asyncio.get_running_loop().run_in_executor(
                self._copy_pool, _scatter, s.memory, t.host.arena, [bids[k] for k in ks], [e.slot for e in es], [], [])
            job.add_done_callback(lambda _: t.life.unpin(es))
            early.append(job)
            copied.update(ks)

        reads = await t.read_batch(disk_entries, s.memory.alloc_host, s.block_bytes, on_part=landed)
        if early:
            await asyncio.gather(*map(asyncio.shield, early))
        read_of = dict(zip(on_disk, reads))
        host_ids: list[int] = []
        host_slots: list[int] = []
        srcs: list[torch.Tensor] = []
        ids: list[int] = []
        served: list[int] = []
        late: list[tuple[Entry, torch.Tensor]] = []  # disk blocks onboarded after the reply
        disk_loads = 0
        tiers_of = [host] * len(found)
        for k, e in enumerate(found):
            r = read_of.get(k)
            if r is None:
                host_ids.append(bids[k])
                host_slots.append(e.slot)
                served.append(k)
                continue
            r, onboarded = r
            tiers_of[k] = int(Tier.DISK)
            if isinstance(r, BaseException):
                if not isinstance(r, (BlockIOError, OSError)):
                    raise r
                self.stats.bump(s.namespace, "load_failures")
                results.set(pos[k], LoadStatus.FAILED, Tier.DISK, message=f"disk block discarded: {r}")
                continue
            served.append(k)
            disk_loads += 1
            if k in copied:  # copied to the engine as its part landed
                continue
            if onboarded:  # read straight into its host slot: copied with the host hits, one job
                host_ids.append(bids[k])
                host_slots.append(e.slot)
                continue
            late.append((e, r))  # no free or clean slot was left: onboarded after the reply
            srcs.append(r)
            ids.append(bids[k])
        if late:  # as one batch: one eviction plan, the copies off the loop, after the reply
            # "clean": free slots only; evicting the dirty blocks they would replace spills them, a disk
            # write for every disk read. What finds no slot is served from its scratch buffer only.
            self._later(t.onboard_many([e for e, _ in late], [r for _, r in late],
                                       evict=self.config.onboard_disk_hits == "always"))
        return host_ids, host_slots, srcs, ids, served, tiers_of, disk_loads


def _host_slots(found: list[Entry | None]) -> list[int] | None:
    """The slots of found blocks when every one is ready and in host memory, else None. A plain
    loop: Python 3.11's specialised slot reads beat map(attrgetter) passes ~2x."""
    slots: list[int] = []
    add = slots.append
    for e in found:
        if e is None or not e.ready or e.slot < 0:
            return None
        add(e.slot)
    return slots if slots else None


def _scatter(memory, arena: HostArena, host_ids: list[int], host_slots: list[int], ids: list[int],
             srcs: list[torch.Tensor]) -> None:
    """One copy job of a Load: host slots -> engine (scatter_from), then disk-read buffers -> engine."""
    if host_ids:
        memory.scatter_from(host_ids, arena, host_slots)
    if ids:
        memory.scatter(ids, srcs)
