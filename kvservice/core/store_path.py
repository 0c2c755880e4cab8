"""The Store path of BlockCache (a mixin: it runs on BlockCache's state), and retain.

  store(hashes, block_ids, ttl)  validate, reserve the new hashes (lifecycle marks), answer the hits,
                                 then per chunk the host tier can hold: make host room (evictions and
                                 the spills they need), build the reserved entries, copy the engine's
                                 blocks straight into their slots (in parts, pipeline.parts), commit.
                                 Whatever was reserved and not committed is rolled back at any await.
  retain(hashes, ttl)            extend the retention of stored blocks (deadlines only ever extend)
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence

from kvservice.core import pipeline
from kvservice.core.lifecycle import Reservation
from kvservice.core.sessions import Session
from kvservice.core.types import SessionId, StoreResults, StoreStatus, Tier
from kvservice.ops.trace import TRACE
from kvservice.placement.index import DiskState, Entry

log = logging.getLogger(__name__)
_STORED = bytes((StoreStatus.STORED,))  # one status byte (StoreResults.status is a bytearray)


class StorePath:
    """Store and retain; mixed into BlockCache, whose state it uses:
    self._t (Tiers), self.stats, self.clock, self.namespaces, self._copy_pool, self._store_latency,
    self._session(), self._hashes(), self._block_ids()."""

    async def store(self, session_id: SessionId, hashes: bytes | Sequence[bytes], block_ids: Sequence[int],
                    ttl_seconds: float = 0.0, namespace_id: str = "",
                    answer: pipeline.Answer | None = None) -> StoreResults:
        """Store engine blocks block_ids[i] as hashes[i] (a chain segment, head first). Validate,
        plan (no await), copy (one job per chunk), commit, each one pass over the batch. Every
        reservation the plan makes - index entries that are not ready, host slots - is rolled back
        (lifecycle.Lifecycle.rollback) if the call fails or is cancelled at any await.
        answer: called with the results once the last copy has landed and every status is final,
        right before the commit (no await from there to the return; pipeline.Answer)."""
        t0 = time.perf_counter()
        s = self._session(session_id, namespace_id)
        hs = self._hashes(hashes)
        ids = self._block_ids(s, len(hs), block_ids)
        call = TRACE.begin("store", len(hs))
        self.namespaces.check_canary(s.namespace, s.canary)  # another session may have fixed it since
        ttl = self._t.retention.clamp_ttl(ttl_seconds)
        now = self.clock.now()
        results = StoreResults(len(hs))
        head = self._head_first(len(hs), s.block_bytes)
        first: Entry | None = None
        taken = 0  # hs[:taken] answered by the head-first path
        pre = None
        if head:
            first, taken, pre = await self._store_head_first(s, hs, ids, head, ttl, now, results, call, answer)
        if taken < len(hs):
            rest = results if not taken else StoreResults(len(hs) - taken)
            e = await self._store_batch(s, hs[taken:] if taken else hs, ids[taken:] if taken else ids, ttl, now,
                                        rest, call, pre, None if taken else answer)
            if taken:
                results.merge(rest, taken)
                # the head, stored first, is the chain's newest again (its tail goes first, as in one Store)
                blocks = self._t.index.namespace(s.namespace)
                self._t.host.touch([e for e in map(blocks.get, hs[:taken]) if e is not None and e.ready])
            first = first or e
        if first is not None and first.ready and self.namespaces.fix_canary(s.namespace, s.canary):
            log.info("namespace %s: hash canary fixed by session %s, its first store", s.namespace, s.label)
        self._store_latency.observe(time.perf_counter() - t0)
        pipeline.fail_unanswered(results, StoreStatus.FAILED)
        # the evicted entries freed, the next Store's new entries built: now if the engine has its answer
        # (pipeline.TIDY), else between requests
        self._tidy_soon(answered=answer is not None and answer.sent)
        TRACE.mark(call, "end")
        return results

    def _head_first(self, n: int, size: int) -> int:
        """The head a Store of n blocks reserves and starts copying before it reserves the rest: the
        first part by bytes (pipeline.parts), when the batch goes in parts and in one host chunk; 0: none
        (the whole batch is reserved first)."""
        if not pipeline.STORE_FIRST_BYTES or n * size <= pipeline.STORE_FIRST_BYTES:
            return 0
        if n > self._chunk_blocks(size):  # more than one chunk
            return 0
        return pipeline.parts(n, size, pipeline.STORE_FIRST_BYTES, pipeline.STORE_GROW)[0][1]

    async def _store_head_first(self, s: Session, hs: list[bytes], ids: list[int], head: int, ttl: float,
                                now: float, results: StoreResults, call: int, answer: pipeline.Answer | None = None
                                ) -> tuple[Entry | None, int, tuple[Reservation, list[Entry], int] | None]:
        """A large Store whose first part (hs[:head]) is all new: reserved, planned and copied before
        the rest is reserved; each later part's hashes are reserved just before that part's plan,
        beside the copies in flight (Lifecycle.reserve_more, no await between it and its check), and
        the batch is stored in one pass, as one chain, while every part is all new. From the first
        part that is not (a hit, a hash twice, another Store's), the rest is left to the general path,
        as a Store of its own once this one is over: returns (the first entry, blocks answered here, None).
        A head that is not all new: nothing answered here (0), its reservation handed on (the third
        item: reserve_found's answer) for the general path to go on from."""
        t = self._t
        life = t.life
        ns, size = s.namespace, s.block_bytes
        res, found, added = life.reserve_found(t.index.namespace(ns), ns, hs[:head], size, now)
        if added != head:  # a hit or a hash twice in the head: the general path, from this reservation
            return None, 0, (res, found, added)
        del found
        n = len(hs)
        res.hashes = hs  # a later part's entries are reserved only once reserve_part() took its hashes
        TRACE.mark(call, "reserved")
        taken = n

        def reserve_part(lo: int, hi: int) -> bool:
            nonlocal taken
            _, more = life.reserve_more(res, hs[lo:hi])
            if more == hi - lo:
                return True
            life.unreserve(res, more)
            res.hashes = hs[:lo]
            taken = lo
            return False
        try:
            await self._store_new(s, list(range(n)), res, ids, ttl, now, results, call, reserve_part, answer)
        finally:
            life.finish(res)
        return (res.entries[0] if res.entries else None), taken, None

    async def _store_batch(self, s: Session, hs: list[bytes], ids: list[int], ttl: float, now: float,
                           results: StoreResults, call: int,
                           pre: tuple[Reservation, list[Entry], int] | None = None,
                           answer: pipeline.Answer | None = None) -> Entry | None:
        """Store hs as one batch (the general path: hits, hashes twice, another Store's, new blocks):
        reserve and look up all of it in one pass, then answer hits, store the new blocks, and answer
        the hits that waited for another Store. pre: go on from the reservation of its head that
        _store_head_first made (reserve_found's answer for hs[:len(found)]). Returns the first new
        entry (None: none)."""
        t = self._t
        life = t.life
        ns, size = s.namespace, s.block_bytes
        blocks = t.index.namespace(ns)
        # one pass: the new hashes are held at once (a RESERVED entry each; their slots come part
        # by part), the others' entries found
        if pre is not None:
            res, found, added = pre
            more, added_more = life.reserve_more(res, hs[len(found):])
            found += more
            added += added_more
        else:
            res, found, added = life.reserve_found(blocks, ns, hs, size, now)
        touched: list[tuple[int, Entry]] = []
        if added == len(hs):  # all new, each once (the usual Store): no per-block split
            new_pos: list[int] = list(range(len(hs)))  # positions of hashes not stored yet
            new_hashes = hs
        else:
            mine = set(map(id, res.entries))  # this call's new entries (a hash twice: both places map to one)
            new_pos = [i for i, e in enumerate(found) if id(e) in mine]
            touched = [(i, e) for i, e in enumerate(found) if id(e) not in mine]
            if added < len(new_pos):  # a hash twice in one batch: its first place stores it, the others wait for it
                first: dict[bytes, int] = {}
                for i in new_pos:
                    first.setdefault(hs[i], i)
                touched += [(i, found[i]) for i in new_pos if first[hs[i]] != i]
                new_pos = [i for i in new_pos if first[hs[i]] == i]
            new_hashes = [hs[i] for i in new_pos]
        del found
        if new_hashes:
            res.hashes = new_hashes
        else:
            res = None
        TRACE.mark(call, "reserved")
        try:
            pending = await self._store_hits(touched, ttl, now, results) if touched else []
            if res is not None:
                await self._store_new(s, new_pos, res, ids if len(new_pos) == len(ids) else [ids[i] for i in new_pos],
                                      ttl, now, results, call, answer=answer)
                life.finish(res)  # our own hashes twice in the batch (pending) wait for this
            if pending:  # after our own blocks: two Stores that wait for each other's both commit first
                await self._store_pending(pending, hs, blocks, ttl, now, results)
        finally:
            if res is not None:  # what was reserved by this call and never committed is rolled back
                life.finish(res)
        return res.entries[0] if res is not None and res.entries else None

    async def _store_hits(self, touched: list[tuple[int, Entry]], ttl: float, now: float,
                          results: StoreResults) -> list[tuple[int, Entry]]:
        """Blocks of a Store that are stored already: touched, and retained if asked. Hits are
        retained first: a block this Store retains is no victim of its own evictions. Returns the
        hits another call is still copying in (answered by _store_pending)."""
        t = self._t
        self.stats.bump(touched[0][1].namespace, "store_hits", len(touched))
        hit = [e for _, e in touched]
        t.host.touch(hit)
        if t.disk is not None:
            t.disk.touch(hit)
        # a block a concurrent Store is still copying in is answered once that one commits or not
        pending = [(i, e) for i, e in touched if not e.ready]
        await self._answer_already_stored([(i, e) for i, e in touched if e.ready], ttl, now, results)
        return pending

    async def _answer_already_stored(self, hits: list[tuple[int, Entry]], ttl: float, now: float,
                                     results: StoreResults) -> None:
        """ALREADY_STORED for ready blocks, retained for ttl when asked (new deadlines persisted)."""
        persist: list[Entry] = []
        already = StoreStatus.ALREADY_STORED
        if not ttl:  # the usual hit: a status, and the deadline of a block still retained
            status = results.status
            for i, e in hits:
                if e.deadline > now:
                    results.set(i, already, e.deadline)
                else:
                    status[i] = already
            return
        for i, e in hits:
            if self._retain_one(e, ttl, now, already, results, i):
                persist.append(e)
        for e in persist:
            await self._t.persist_deadline(e)

    async def _store_pending(self, pending: list[tuple[int, Entry]], hs: list[bytes], blocks: dict[bytes, Entry],
                             ttl: float, now: float, results: StoreResults) -> None:
        """Hits that another Store was copying in: ALREADY_STORED (and retained if asked) once it
        committed them; NOT_STORED if it was cancelled or failed - never an acknowledgement of
        bytes nobody kept."""
        waits = self._t.life.outcome([e for _, e in pending])
        if waits:
            await asyncio.wait(waits)
        stored: list[tuple[int, Entry]] = []
        for i, e in pending:
            if not e.ready:
                results.set(i, StoreStatus.NOT_STORED,
                            message="a concurrent Store of this block did not complete (cancelled or failed): store it again")
            elif blocks.get(hs[i]) is not e:  # committed, then evicted (no disk copy) before this call woke up
                results.set(i, StoreStatus.NOT_STORED,
                            message="a concurrent Store stored this block, but it was evicted before this Store "
                                    "could answer: store it again")
            else:
                stored.append((i, e))
        await self._answer_already_stored(stored, ttl, now, results)

    async def _store_new(self, s: Session, pos: list[int], res: Reservation, bids: list[int], ttl: float,
                         now: float, results: StoreResults, call: int = 0,
                         reserve_part: Callable[[int, int], bool] | None = None,
                         answer: pipeline.Answer | None = None) -> None:
        """Copy new blocks in, head first, in chunks the host tier can hold: a batch larger than
        the host tier streams through it (earlier chunks spill as later ones arrive).
        reserve_part: see _store_chunk (a batch of one chunk only). answer: given to the last chunk."""
        t = self._t
        chunk = self._chunk_blocks(s.block_bytes)
        n = len(res)
        for lo in range(0, n, chunk):
            hi = lo + chunk
            stored = await self._store_chunk(s, pos[lo:hi], res, bids[lo:hi], ttl, now, results, call, reserve_part,
                                             answer if hi >= n else None)
            if not stored:
                t.life.release_unbuilt(res)
                for i in pos[hi:]:
                    results.set(i, StoreStatus.NOT_STORED, message="no room in the host tier")
                return

    def _chunk_blocks(self, size: int) -> int:
        """The most blocks of size one chunk of a Store holds: what the host tier can hold at once."""
        host = self._t.host
        return max(1, min(host.arena.max_slots(size), host.capacity_bytes // size))

    async def _store_chunk(self, s: Session, pos: list[int], res: Reservation, bids: list[int], ttl: float,
                           now: float, results: StoreResults, call: int = 0,
                           reserve_part: Callable[[int, int], bool] | None = None,
                           answer: pipeline.Answer | None = None) -> bool:
        """Store what fits of one chunk (the next len(pos) hashes of res); False when some of it did
        not fit. Plan (evict, no await), wait for the spills that make the room, take slots, build the
        reserved entries (Lifecycle.build) and place the slots on them, copy
        the engine's blocks straight into them, commit. Cancelled or failed before the commit, the
        reservations are rolled back; their slots go once the copy thread is done with them.
        A chunk of more than pipeline.STORE_FIRST_BYTES (or 2 x pipeline.PIPELINE_BLOCKS blocks) is
        planned and copied in parts (pipeline.parts: that many bytes first, growing to
        pipeline.PIPELINE_BLOCKS), the plan of a part beside the copy of the one before (at most
        pipeline.PIPELINE_DEPTH copies in flight): the bookkeeping of a large Store runs while the copy
        thread waits on the device, and the first copy starts after a short plan.
        Its blocks are still committed together at the end, as one chain.
        reserve_part(lo, hi) (_store_head_first's): called before each part after the first, to hold
        that part's hashes (the first part's are held already); False means they are not all new: the
        chunk ends before that part (its blocks and the later ones were never built).
        answer (the call's last chunk): called once the copies have landed, before the commit, when the
        statuses are final then (no retention asked; a part given back by reserve_part leaves some
        unanswered: pipeline.Answer sends nothing then)."""
        t = self._t
        life = t.life
        n = len(pos)
        first = res.placed  # entries of earlier chunks
        jobs: list[tuple[asyncio.Future, list[Entry]]] = []  # copies started: their futures and blocks
        sums: list[int] = []
        waited = 0  # jobs whose copy was awaited (their checksums are in sums)
        placed_n = 0  # entries[:placed_n] have slots and a copy started
        loop = asyncio.get_running_loop()
        try:
            for lo, hi in pipeline.parts(n, s.block_bytes, pipeline.STORE_FIRST_BYTES, pipeline.STORE_GROW):
                if lo and reserve_part is not None:
                    if not reserve_part(lo, hi):  # the rest goes as a Store of its own, once this one is over
                        n = lo
                        pos = pos[:lo]
                        break
                    TRACE.mark(call, "reserved")
                want = hi - lo
                offsets = None
                if t.host.placeable(s.block_bytes) < want and t.headroom_fits(s.block_bytes, want, now):
                    # slots past the capacity now, the evictions once the copy is queued (trim_host)
                    offsets = t.host.alloc(s.block_bytes, want, over=True)
                over = offsets is not None
                if over:
                    fit = want
                else:
                    fit, offsets = await self._host_room(s.block_bytes, want, now)
                TRACE.mark(call, "room")
                if fit:
                    placed = life.build(res, fit)
                    life.place(placed, offsets)
                    copy, enq = pipeline.copy_call(s.memory, "gather_into", loop, hi < n or over)
                    jobs.append((loop.run_in_executor(self._copy_pool, copy, bids[lo:lo + fit], t.host.arena, offsets),
                                 placed))
                    TRACE.mark(call, "submitted")
                    placed_n = lo + fit
                    if enq is not None:  # the next plan once this copy is queued (or over): see pipeline.ENQUEUE_FIRST
                        await asyncio.wait((enq, jobs[-1][0]), return_when=asyncio.FIRST_COMPLETED)
                        TRACE.mark(call, "enqueued")
                    if over:
                        t.trim_host(s.block_bytes, now)
                        TRACE.mark(call, "trimmed")
                if fit < want:  # head first: when only part of the chain fits, keep its prefix
                    self._refuse_rest(s, pos[lo + fit:], res, lo + fit, n, now, results)
                    break
                while len(jobs) - waited >= pipeline.PIPELINE_DEPTH or (waited < len(jobs) and hi >= n):
                    sums += await asyncio.shield(jobs[waited][0])
                    TRACE.mark(call, "copied")
                    waited += 1
                if hi >= n:
                    break
        except BaseException:
            for fut, placed in jobs[waited:] if waited < len(jobs) else ():
                self._abandon_copy(fut, placed)
            if waited:  # copied, not committed: rolled back, their slots free now
                done = [e for _, placed in jobs[:waited] for e in placed]
                life.rollback(done, copy_running=True)
                life.release_aborted(done)
            raise
        if not placed_n:
            return n == 0
        while waited < len(jobs):  # the loop broke early (a part did not fit): the copies started still land
            try:
                sums += await asyncio.shield(jobs[waited][0])
            except BaseException:
                for fut, placed in jobs:
                    self._abandon_copy(fut, placed)
                raise
            waited += 1
        placed = res.entries[first:first + placed_n]
        if not ttl:  # the statuses first: final now, whatever the bookkeeping below does (it cannot fail them)
            status = results.status
            if pos[placed_n - 1] - pos[0] == placed_n - 1:  # positions ascending: a contiguous run, one slice
                status[pos[0]:pos[0] + placed_n] = _STORED * placed_n
            else:
                for i in pos[:placed_n]:
                    status[i] = StoreStatus.STORED
            if answer is not None:  # the engine reads its reply while this commits (no await from here on)
                answer(results)
        life.commit(placed, sums, res)
        TRACE.mark(call, "committed")
        self.stats.bump(s.namespace, "stores", placed_n)
        if not ttl:
            return placed_n == n
        for i, e in zip(pos, placed):
            self._retain_one(e, ttl, now, StoreStatus.STORED, results, i)  # new: nothing on disk to persist
        return placed_n == n

    async def _host_room(self, size: int, n: int, now: float) -> tuple[int, list[int] | None]:
        """Make room for n blocks of size (evictions, the spills they need) and take the slots:
        (fit, offsets) for the first `fit` of them; (0, None) when none fit."""
        t = self._t
        fit = want = n
        for _ in range(4):  # a concurrent Store (or an onboarding) may take the slots our spills freed: plan again
            if t.host.placeable(size) < want:
                onboarding = t.onboarding()  # slots a disk hit's onboarding copy fills: evictable blocks in a moment
                if onboarding is not None:
                    await asyncio.shield(onboarding)
            fit, spills = t.make_host_room(size, want, now)
            wait = t.room_after(spills, now, size, fit) if spills else None
            if fit and wait is not None:
                # the spills belong to the tiers, not to this call: cancelling the Store must not abandon them
                await asyncio.shield(wait)
            if not fit or t.host.placeable(size) >= fit:
                break
            want = fit
        if not fit:
            return 0, None
        fit = min(fit, t.host.placeable(size))
        offsets = t.host.alloc(size, fit) if fit else None
        return (fit, offsets) if offsets is not None else (0, None)

    def _refuse_rest(self, s: Session, pos: list[int], res: Reservation, fit: int, n: int, now: float,
                     results: StoreResults) -> None:
        """The blocks of a chunk past the first `fit` of its n did not fit: out of the index (with
        every later one of res), NOT_STORED, why."""
        t = self._t
        pinned, protected = t.host_blockers(now)
        if protected:  # DESIGN §5 protect-unexpired: refused admission, counted
            why = "the rest of it holds unexpired retained blocks that cannot spill: " + t.protection_reason()
            self.stats.bump(s.namespace, "admission_refusals", len(pos))
        elif pinned:
            why = "the rest of it is pinned by loads or prefetches in flight"
        else:
            why = "a concurrent call took the rest"
        message = f"host tier has room for {fit} of {n} blocks: {why}"
        t.life.release_unbuilt(res)
        for i in pos:
            results.set(i, StoreStatus.NOT_STORED, message=message)

    def _abandon_copy(self, fut: asyncio.Future, placed: list[Entry]) -> None:
        """A copy into reserved slots whose Store failed or was cancelled: the reservations are
        rolled back now, their slots go when the copy thread is done with them (_copy's rule)."""
        life = self._t.life
        life.rollback(placed, copy_running=True)
        pipeline.when_copy_ends(fut, functools.partial(life.release_aborted, placed))

    def _retain_one(self, e: Entry, ttl: float, now: float, status: StoreStatus, results: StoreResults,
                    i: int) -> bool:
        """Extend e's retention to now + ttl (ttl > 0) and record the outcome as results[i]. True
        when the new deadline must be written to e's disk copy (await Tiers.persist_deadline)."""
        deadline = self._t.life.retain(e, ttl, now)
        if deadline is None:
            self.stats.bump(e.namespace, "retain_cap_refusals")
            results.set(i, StoreStatus.STORED_NOT_RETAINED if status == StoreStatus.STORED else status,
                        message="retained-bytes cap of the namespace reached; stored without retention")
            return False
        results.set(i, status, deadline)
        return e.disk == DiskState.ON_DISK

    async def retain(self, session_id: SessionId, hashes: bytes | Sequence[bytes], ttl_seconds: float,
                     namespace_id: str = "") -> list[float]:
        """Extend the retention of stored blocks; the new deadline per hash, 0.0 when not stored or
        refused by the namespace's retained-bytes cap (ttl 0 changes nothing and reads them)."""
        s = self._session(session_id, namespace_id)
        hashes = self._hashes(hashes)
        t = self._t
        ttl = t.retention.clamp_ttl(ttl_seconds)
        now = self.clock.now()
        get = t.index.namespace(s.namespace).get
        out: list[float] = [0.0] * len(hashes)
        results = StoreResults(1)
        persist: list[Entry] = []
        for k, h in enumerate(hashes):
            e = get(h)
            if e is None or not e.ready or e.tier == Tier.NONE:
                continue
            if not ttl:
                out[k] = e.deadline if e.deadline > now else 0.0
                continue
            results.messages.clear()
            if self._retain_one(e, ttl, now, StoreStatus.ALREADY_STORED, results, 0):
                persist.append(e)
            out[k] = 0.0 if results.messages else e.deadline
        for e in persist:
            await t.persist_deadline(e)
        return out
