"""BlockCache: the daemon's core object. The gRPC servicers are thin translations onto it.

Primitives (all per block, batched per call; the session must be open):
  open_session / heartbeat / close_session / reap_sessions   leases and pool mappings
  lookup(hashes) -> tiers of the stored prefix
  store(hashes, block_ids, ttl) -> StoreResults (status per block...); returns once the bytes left the engine pool
  load(hashes, block_ids) -> LoadResults (status, tier per block); returns once the bytes are in the engine pool
Hashes come packed (n x 32 bytes, as on the wire) or as a list; each call validates, plans and
commits in one pass over its batch, and answers in arrays (types.StoreResults / LoadResults).
  prefetch(hashes) -> stage disk blocks into the host tier under a short pin lease
  retain(hashes, ttl) -> new deadline per block (deadlines only ever extend)
  evict(...) / stats views                                    admin
Request-level errors raise CacheError(code, message); per-block outcomes are results.
Moves between tiers live in tiers.Tiers; the policies in eviction and retention.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import operator
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kvservice.core.clock import Clock
from kvservice.ops.config import Config
from kvservice.memory.engine_memory import open_engine_memory
from kvservice.memory.host_arena import HostArena
from kvservice.placement.index import DiskState, Entry
from kvservice.disk.io_backend import BlockIO, BlockIOError, open_backend
from kvservice.disk.io_throttle import throttled
from kvservice.core.namespaces import NamespaceRegistry
from kvservice.ops.quoting import quoted
from kvservice.core.sessions import Session, SessionTable
from kvservice.core.sessions_api import MAIN_LISTENER, NamespaceSpec, OpenedSession, Peer, PoolSpec, SessionInfo
from kvservice.ops.stats import CounterSet, Counters, Histogram
from kvservice.core.lifecycle import Reservation, is_mark
from kvservice.core.tiers import Tiers
from kvservice.core.types import (
    HASH_BYTES, BlockHash, BlockKey, CacheError, ErrorCode, LoadResults, LoadStatus, NamespaceId, PrefetchResult,
    PrefetchStatus, SessionId, StoreResults, StoreStatus, Tier,
)

log = logging.getLogger(__name__)


def spill_staging_bytes(config: Config) -> int:
    """Arena bytes beside the host tier for victims whose spill is queued or being written, so a
    Store does not wait for the disk: a quarter of the host tier, at least 64 MiB (at most the
    tier itself), at most 1 GiB; none without a disk tier (victims are dropped, never staged)."""
    if not config.has_disk:
        return 0
    host = config.host_capacity_bytes
    return min(host, max(64 << 20, min(host // 4, 1 << 30)))


class BlockCache:
    def __init__(self, config: Config, clock: Clock, io: BlockIO | None = None) -> None:
        self.config = config
        self.clock = clock
        self.stats = CounterSet()
        self._io = io
        self.tiers: Tiers | None = None
        self.arena: HostArena | None = None
        self.namespaces = NamespaceRegistry(config.disk_path if config.has_disk else "")
        self._sessions = SessionTable(config.lease_seconds, config.max_sessions, config.max_sessions_per_uid)
        self._copy_pool = ThreadPoolExecutor(4, thread_name_prefix="kv-copy")
        self._store_latency = Histogram("store")
        self._load_latency = Histogram("load")
        self._prefetch_latency = Histogram("prefetch")  # whole calls
        self._prefetch_read_latency = Histogram("prefetch_read")  # their disk reads (calls with a block to read)
        self._stopping = False
        self._background: set[asyncio.Task] = set()

    # --- lifecycle
    async def start(self) -> int:
        """Open the I/O backend, recover the disk tier, start the writers. Returns blocks recovered."""
        _tune_gc()
        _tune_switch_interval()
        io = self._io if self._io is not None else open_backend(self.config.io_backend)
        self._io = throttled(io, self.config.disk_read_bytes_per_second, self.config.disk_write_bytes_per_second)
        # the host tier's memory, all of it, now: pinned where engines copy over PCIe
        self.arena = HostArena(self.config.host_capacity_bytes + spill_staging_bytes(self.config),
                               pin=torch.cuda.is_available())
        self.tiers = Tiers(self.config, self._io, self.stats, self.clock.now, self.arena)
        recovered = await self.tiers.recover()
        sizes = self.tiers.recovered_sizes  # one canary read per namespace
        for ns_id, size in sizes.items():
            self.namespaces.known_from_disk(ns_id, size)
        self.tiers.start()
        return recovered

    async def drain_and_stop(self) -> None:
        """Finish every queued disk write, close sessions and mappings. Used on SIGTERM."""
        self._stopping = True
        t = self._t
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        persisted = await t.persist_retained(self.clock.now())
        if persisted:
            log.info("writing %d retained blocks that were only in host memory", persisted)
        await t.drain()
        await asyncio.gather(*(self._close(s) for s in self._sessions.all()))
        await t.stop()
        self._copy_pool.shutdown(wait=True)
        if self.arena is not None:
            self.arena.close()

    @property
    def _t(self) -> Tiers:
        if self.tiers is None:
            raise CacheError(ErrorCode.UNAVAILABLE, "cache not started")
        return self.tiers

    @property
    def io_backend_name(self) -> str:
        return self._io.name if self._io is not None else "none"

    # --- sessions
    def open_session(self, ns: NamespaceSpec, pool: PoolSpec, canary: bytes, client_name: str,
                     peer: Peer | None = None) -> OpenedSession:
        """Map the pool the peer handed over and open a session bound to that peer. A descriptor in
        `pool` (shm_fd) is consumed, also when the session is refused. `peer` defaults to this
        process (in-process callers); the registration socket passes the kernel's SO_PEERCRED."""
        peer = peer or Peer.this_process()
        try:
            if self._stopping:
                raise CacheError(ErrorCode.UNAVAILABLE, "daemon is shutting down")
            self._sessions.check_room(peer.uid)
            if self.arena.max_slots(pool.block_bytes) == 0:
                raise CacheError(ErrorCode.FAILED_PRECONDITION,
                                 f"a block of {pool.block_bytes} bytes does not fit the host tier's "
                                 f"{self.arena.segment_bytes}-byte arena segments: raise --host-capacity")
        except BaseException:
            if pool.shm_fd >= 0:
                os.close(pool.shm_fd)
            raise
        memory = open_engine_memory(pool)
        try:
            # another allowed uid is its own tenant: its namespaces never share blocks with other uids'
            rec = self.namespaces.admit(ns, pool, canary, "" if peer.listener == MAIN_LISTENER else peer.listener)
        except BaseException:
            memory.close()
            raise
        s = self._sessions.open(rec.id, pool, memory, client_name[:200], peer, canary, self.clock.now())
        log.info("session %s opened: uid %d pid %d, namespace %s (model %s), %d blocks of %d bytes, client %s",
                 s.label, peer.uid, peer.pid, rec.id, quoted(ns.model_id), pool.num_blocks, pool.block_bytes,
                 quoted(client_name))
        return OpenedSession(s.id, rec.id, self.config.lease_seconds, self.config.max_batch_blocks, pool.block_bytes,
                             s.label)

    def session_peer(self, session_id: str) -> Peer | None:
        """Who opened this session (None: no such session); the listeners refuse calls from other peers."""
        s = self._sessions.find(session_id)
        return s.peer if s is not None else None

    def reset_canary(self, namespace: NamespaceId) -> bool:
        """Admin: forget a namespace's hash canary; the next session that stores fixes it again."""
        was = self.namespaces.reset_canary(namespace)
        log.warning("hash canary of namespace %s reset by the operator (was %s)", namespace, "set" if was else "unset")
        return was

    def heartbeat(self, session_id: SessionId) -> float:
        self._sessions.heartbeat(session_id, self.clock.now())
        return self.config.lease_seconds

    async def close_session(self, session_id: SessionId) -> None:
        """Returns once the pool is unmapped: no copy into it is in flight or will start."""
        await self._close(self._sessions.get(session_id))

    def _close(self, s: Session) -> asyncio.Future:
        self._sessions.remove(s.id)
        if self.tiers is not None:
            self.tiers.life.end_leases_of(s.id)
        log.info("session %s closed", s.label)
        # unmapping waits for copies in flight: do it off the event loop (not on the copy pool,
        # whose threads may be the very copies it waits for)
        done = asyncio.ensure_future(asyncio.to_thread(s.memory.close))
        self._background.add(done)
        done.add_done_callback(self._background.discard)
        return done

    def reap_sessions(self) -> list[SessionId]:
        """Close sessions whose lease ran out and end expired prefetch leases; call about once a second."""
        now = self.clock.now()
        dead = self._sessions.expired(now)
        for s in dead:
            log.warning("session %s (uid %d pid %d, client %s) missed its lease; releasing it", s.label, s.peer.uid,
                        s.peer.pid, quoted(s.client_name))
            self._close(s)
        if self.tiers is not None:
            self.tiers.life.end_expired_leases(now)
        return [s.id for s in dead]

    # --- validation
    def _session(self, session_id: str, namespace_id: str) -> Session:
        s = self._sessions.get(session_id)
        if namespace_id and namespace_id != s.namespace:
            raise CacheError(ErrorCode.PERMISSION_DENIED,
                             f"session {s.label} opened namespace {s.namespace}, not {quoted(namespace_id)}")
        return s

    def _check_count(self, n: int) -> None:
        if n > self.config.max_batch_blocks:
            raise CacheError(ErrorCode.RESOURCE_EXHAUSTED,
                             f"batch of {n} blocks exceeds max_batch_blocks = {self.config.max_batch_blocks}")

    def _hashes(self, hashes: bytes | Sequence[bytes]) -> list[bytes]:
        """The request's hashes, one bytes object each: from the wire's packed field (n x 32 bytes,
        head first), or a list of 32-byte hashes (in-process callers). One pass, no per-hash object
        beyond the slice."""
        if isinstance(hashes, (bytes, bytearray, memoryview)):
            packed = bytes(hashes)
            n, rest = divmod(len(packed), HASH_BYTES)
            if rest:
                raise CacheError(ErrorCode.INVALID_ARGUMENT,
                                 f"hashes has {len(packed)} bytes, not a multiple of {HASH_BYTES}: it must be n "
                                 f"hashes of {HASH_BYTES} bytes each, packed head first")
            self._check_count(n)
            # one bytes object per hash, trailing zero bytes kept ('V32', not 'S32'), ~5x a slicing loop
            return np.frombuffer(packed, dtype=_HASH_DTYPE).tolist() if n else []
        hs = list(hashes)
        self._check_count(len(hs))
        for i, h in enumerate(hs):
            if len(h) != HASH_BYTES:
                raise CacheError(ErrorCode.INVALID_ARGUMENT, f"hash #{i} has {len(h)} bytes, expected {HASH_BYTES}")
        return hs

    def _block_ids(self, s: Session, n: int, block_ids: Sequence[int]) -> list[int]:
        """Engine block ids, one per hash, inside the session's pool, none twice. A large batch off
        the wire (a protobuf repeated field: numpy reads it without a Python int per id) is checked
        with numpy (range, and duplicates by marking a table of the pool's blocks): ~0.02 vs ~0.07 us
        a block; a list (in-process callers) is as fast through the Python checks."""
        if n >= _NUMPY_IDS and not isinstance(block_ids, list) and len(block_ids) == n:
            try:
                a = np.asarray(block_ids)
            except (OverflowError, ValueError, TypeError):
                a = None
            if a is not None and a.ndim == 1 and a.dtype.kind in "iu":
                pool_blocks = s.pool.num_blocks
                if int(a.min()) >= 0 and int(a.max()) < pool_blocks:
                    mark = np.zeros(pool_blocks, dtype=np.bool_)
                    mark[a] = True
                    if int(np.count_nonzero(mark)) == n:
                        return a.tolist()
        ids = list(block_ids)  # small batches, and any batch the checks above refused: say why
        if len(ids) != n:
            raise CacheError(ErrorCode.INVALID_ARGUMENT,
                             f"{len(ids)} block_ids for {n} hashes: block_ids must name one engine block per hash")
        if not ids:
            return ids
        pool_blocks = s.pool.num_blocks
        if min(ids) < 0 or max(ids) >= pool_blocks:
            i, b = next((i, b) for i, b in enumerate(ids) if not 0 <= b < pool_blocks)
            raise CacheError(ErrorCode.INVALID_ARGUMENT,
                             f"block_id {b} (#{i}) is outside the pool's {pool_blocks} blocks")
        if len(set(ids)) != n:
            raise CacheError(ErrorCode.INVALID_ARGUMENT, "a block_id appears twice in one batch")
        return ids

    # --- data
    def lookup(self, session_id: SessionId, hashes: bytes | Sequence[bytes], namespace_id: str = "") -> list[int]:
        """Tier value of each block of the stored prefix of the chain (Tier.HOST / Tier.DISK)."""
        s = self._session(session_id, namespace_id)
        return self._t.index.prefix_tiers(s.namespace, self._hashes(hashes))

    async def store(self, session_id: SessionId, hashes: bytes | Sequence[bytes], block_ids: Sequence[int],
                    ttl_seconds: float = 0.0, namespace_id: str = "") -> StoreResults:
        """Store engine blocks block_ids[i] as hashes[i] (a chain segment, head first). Validate,
        plan (no await), copy (one job per chunk), commit, each one pass over the batch. Every
        reservation the plan makes - index entries that are not ready, host slots - is rolled back
        (lifecycle.Lifecycle.rollback) if the call fails or is cancelled at any await."""
        t0 = time.perf_counter()
        s = self._session(session_id, namespace_id)
        hs = self._hashes(hashes)
        ids = self._block_ids(s, len(hs), block_ids)
        self.namespaces.check_canary(s.namespace, s.canary)  # another session may have fixed it since
        t = self._t
        life = t.life
        ttl = t.retention.clamp_ttl(ttl_seconds)
        now = self.clock.now()
        results = StoreResults(len(hs))
        ns, size = s.namespace, s.block_bytes
        blocks = t.index.namespace(ns)
        found = list(map(blocks.get, hs))
        touched: list[tuple[int, Entry]] = []
        if found.count(None) == len(hs):  # all new (the usual Store): no per-block split
            new_pos: list[int] = list(range(len(hs)))  # positions of hashes not stored yet
            new_hashes = hs
        else:
            new_pos = [i for i, e in enumerate(found) if e is None]
            touched = [(i, e) for i, e in enumerate(found) if e is not None]
            new_hashes = [hs[i] for i in new_pos]
        del found
        dups: list[int] = []
        # the new hashes are held at once (a mark each); their entries are built part by part
        res = life.reserve_lazily(blocks, ns, new_hashes, size, now) if new_hashes else None
        if res is None and new_hashes:  # a hash twice in one batch (nothing reserved): its first place stores it
            first: dict[bytes, int] = {}
            for i in new_pos:
                first.setdefault(hs[i], i)
            dups = [i for i in new_pos if first[hs[i]] != i]
            new_pos = [i for i in new_pos if first[hs[i]] == i]
            new_hashes = [hs[i] for i in new_pos]
            res = life.reserve_lazily(blocks, ns, new_hashes, size, now)
            assert res is not None
        touched.extend((i, blocks[hs[i]]) for i in dups)
        try:
            pending = await self._store_hits(touched, ttl, now, results) if touched else []
            if res is not None:
                await self._store_new(s, new_pos, res, ids if len(new_pos) == len(ids) else [ids[i] for i in new_pos],
                                      ttl, now, results)
                life.finish(res)  # our own hashes twice in the batch (pending) wait for this
            if pending:  # after our own blocks: two Stores that wait for each other's both commit first
                await self._store_pending(pending, hs, blocks, ttl, now, results)
        finally:
            if res is not None:  # what was reserved by this call and never committed is rolled back
                life.finish(res)
        entries = res.entries if res is not None else []
        if entries and entries[0].ready and self.namespaces.fix_canary(s.namespace, s.canary):
            log.info("namespace %s: hash canary fixed by session %s, its first store", s.namespace, s.label)
        self._store_latency.observe(time.perf_counter() - t0)
        _fail_unanswered(results, StoreStatus.FAILED)
        return results

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
        bytes nobody kept. A hit on a Store's reservation mark (its entry not built yet) is looked
        up again once that Store is over."""
        waits = self._t.life.outcome([e for _, e in pending])
        if waits:
            await asyncio.wait(waits)
        stored: list[tuple[int, Entry]] = []
        for i, e in pending:
            if is_mark(e):
                e = blocks.get(hs[i])
            if e is None or not e.ready:
                results.set(i, StoreStatus.NOT_STORED,
                            message="a concurrent Store of this block did not complete (cancelled or failed): store it again")
            else:
                stored.append((i, e))
        await self._answer_already_stored(stored, ttl, now, results)

    async def _store_new(self, s: Session, pos: list[int], res: Reservation, bids: list[int], ttl: float,
                         now: float, results: StoreResults) -> None:
        """Copy new blocks in, head first, in chunks the host tier can hold: a batch larger than
        the host tier streams through it (earlier chunks spill as later ones arrive)."""
        t = self._t
        chunk = max(1, min(t.host.arena.max_slots(s.block_bytes), t.host.capacity_bytes // s.block_bytes))
        n = len(res)
        for lo in range(0, n, chunk):
            hi = lo + chunk
            stored = await self._store_chunk(s, pos[lo:hi], res, bids[lo:hi], ttl, now, results)
            if not stored:
                t.life.release_unbuilt(res)
                for i in pos[hi:]:
                    results.set(i, StoreStatus.NOT_STORED, message="no room in the host tier")
                return

    async def _store_chunk(self, s: Session, pos: list[int], res: Reservation, bids: list[int], ttl: float,
                           now: float, results: StoreResults) -> bool:
        """Store what fits of one chunk (the next len(pos) hashes of res); False when some of it did
        not fit. Plan (evict, no await), wait for the spills that make the room, take slots, build the
        reserved entries (Lifecycle.build) and place the slots on them, copy
        the engine's blocks straight into them, commit. Cancelled or failed before the commit, the
        reservations are rolled back; their slots go once the copy thread is done with them.
        A chunk of more than 2 x PIPELINE_BLOCKS is planned and copied in parts (_parts: growing
        from PIPELINE_FIRST to PIPELINE_BLOCKS), the plan of a part beside the copy of the one
        before (at most PIPELINE_DEPTH copies in flight): the bookkeeping of a large Store runs
        while the copy thread waits on the device, and the first copy starts after a short plan.
        Its blocks are still committed together at the end, as one chain."""
        t = self._t
        life = t.life
        n = len(pos)
        first = len(res.entries)  # entries of earlier chunks
        jobs: list[tuple[asyncio.Future, list[Entry]]] = []  # copies started: their futures and blocks
        sums: list[int] = []
        waited = 0  # jobs whose copy was awaited (their checksums are in sums)
        placed_n = 0  # entries[:placed_n] have slots and a copy started
        loop = asyncio.get_running_loop()
        try:
            for lo, hi in _parts(n):
                want = hi - lo
                fit, offsets = await self._host_room(s.block_bytes, want, now)
                if fit:
                    placed = life.build(res, fit)
                    life.place(placed, offsets)
                    jobs.append((loop.run_in_executor(self._copy_pool, s.memory.gather_into, bids[lo:lo + fit],
                                                      t.host.arena, offsets), placed))
                    placed_n = lo + fit
                if fit < want:  # head first: when only part of the chain fits, keep its prefix
                    self._refuse_rest(s, pos[lo + fit:], res, lo + fit, n, now, results)
                    break
                while len(jobs) - waited >= PIPELINE_DEPTH or (waited < len(jobs) and hi >= n):
                    sums += await asyncio.shield(jobs[waited][0])
                    waited += 1
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
        life.commit(placed, sums)
        self.stats.bump(s.namespace, "stores", placed_n)
        status = results.status
        if not ttl:
            if pos[placed_n - 1] - pos[0] == placed_n - 1:  # positions ascending: a contiguous run, one slice
                status[pos[0]:pos[0] + placed_n] = [StoreStatus.STORED] * placed_n
            else:
                for i in pos[:placed_n]:
                    status[i] = StoreStatus.STORED
            return placed_n == n
        for i, e in zip(pos, placed):
            self._retain_one(e, ttl, now, StoreStatus.STORED, results, i)  # new: nothing on disk to persist
        return placed_n == n

    async def _host_room(self, size: int, n: int, now: float) -> tuple[int, list[int] | None]:
        """Make room for n blocks of size (evictions, the spills they need) and take the slots:
        (fit, offsets) for the first `fit` of them; (0, None) when none fit."""
        t = self._t
        fit = 0
        for attempt in range(4):  # a concurrent Store may take the slots our spills freed: plan again
            fit, spills = t.make_host_room(size, n if attempt == 0 else fit, now)
            wait = t.room_after(spills, now, size, fit) if spills else None
            if fit and wait is not None:
                # the spills belong to the tiers, not to this call: cancelling the Store must not abandon them
                await asyncio.shield(wait)
            if not fit or t.host.placeable(size) >= fit:
                break
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
        _when_copy_ends(fut, functools.partial(life.release_aborted, placed))

    async def _copy(self, fn, *args, on_fail=None, on_abandon=None):
        """Run one copy job on the copy pool. If the caller is cancelled (or the job fails), on_fail
        runs at once and the job still runs to its end in its thread: on_abandon runs only then, so
        memory the job touches (slots, pins) is never handed to anyone while the copy is on it."""
        fut = asyncio.get_running_loop().run_in_executor(self._copy_pool, fn, *args)
        try:
            return await asyncio.shield(fut)
        except BaseException:
            if on_fail is not None:
                on_fail()
            if on_abandon is not None:
                if fut.done():
                    on_abandon()
                else:
                    fut.add_done_callback(lambda _: on_abandon())
            raise

    def _retain_one(self, e: Entry, ttl: float, now: float, status: StoreStatus, results: StoreResults,
                    i: int) -> bool:
        """Extend e's retention to now + ttl (ttl > 0) and record the outcome as results[i]. True
        when the new deadline must be written to e's disk copy (await Tiers.persist_deadline)."""
        deadline = self._t.retention.extend(e, ttl, now)
        if deadline is None:
            self.stats.bump(e.namespace, "retain_cap_refusals")
            results.set(i, StoreStatus.STORED_NOT_RETAINED if status == StoreStatus.STORED else status,
                        message="retained-bytes cap of the namespace reached; stored without retention")
            return False
        self._t.mark_retained(e)
        results.set(i, status, deadline)
        return e.disk == DiskState.ON_DISK

    async def load(self, session_id: SessionId, hashes: bytes | Sequence[bytes], block_ids: Sequence[int],
                   namespace_id: str = "") -> LoadResults:
        """Fill engine blocks block_ids[i] with the blocks stored as hashes[i]; returns once they landed."""
        t0 = time.perf_counter()
        s = self._session(session_id, namespace_id)
        hs = self._hashes(hashes)
        ids = self._block_ids(s, len(hs), block_ids)
        t = self._t
        life = t.life
        results = LoadResults(len(hs))
        on_disk_state = DiskState.ON_DISK
        found: list[Entry] = list(map(t.index.namespace(s.namespace).get, hs))
        slots = _host_slots(found)  # None unless every block is a ready host hit
        missing = [] if slots is not None else [
            i for i, e in enumerate(found) if e is None or not e.ready or (e.slot < 0 and e.disk != on_disk_state)]
        if not missing:  # every block found (the usual Load): no per-block split
            pos: list[int] = list(range(len(hs)))  # positions found
            bids = ids
        else:
            gone = set(missing)
            pos = [i for i in range(len(hs)) if i not in gone]
            found = [found[i] for i in pos]
            bids = [ids[i] for i in pos]
        if missing:
            status = results.status
            for i in missing:
                status[i] = LoadStatus.MISSING
            self.stats.bump(s.namespace, "load_misses", len(missing))
        life.pin(found)
        if slots is not None and len(found) > 2 * PIPELINE_BLOCKS:  # all host hits, many: copied in parts
            await self._load_host_parts(s, found, bids, slots)
            self._answer_loaded(results, pos, len(found))
            self.stats.bump(s.namespace, "loads_host", len(found))
            self._load_latency.observe(time.perf_counter() - t0)
            return results
        handed_over = False  # once the scatter runs, its thread drops the pins when it is done
        try:
            host_ids, host_slots, srcs, disk_ids, served, tiers_of, disk_loads = await self._collect_bytes(
                s, pos, bids, found, results)
            if host_ids or srcs:
                handed_over = True
                await self._copy(_scatter, s.memory, t.host.arena, host_ids, host_slots, disk_ids, srcs,
                                 on_abandon=lambda: life.unpin(found))
            status, tiers = results.status, results.tier
            loaded = int(LoadStatus.LOADED)
            if len(served) == len(status):  # all served, in order: whole-array results
                status[:] = [loaded] * len(status)
                tiers[:] = tiers_of
            else:
                for k in served:
                    i = pos[k]
                    status[i] = loaded
                    tiers[i] = tiers_of[k]
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
        self._load_latency.observe(time.perf_counter() - t0)
        _fail_unanswered(results, LoadStatus.FAILED)
        return results

    async def _load_host_parts(self, s: Session, found: list[Entry], bids: list[int], slots: list[int]) -> None:
        """Copy pinned host blocks to the engine in parts (_parts), at most PIPELINE_DEPTH copies in
        flight: each part's bookkeeping (reuse, leases used, its pins) runs beside the next part's
        copy, the chain's LRU refresh beside the last ones. Every pin is dropped: a part's when its
        copy has ended (also when the call is cancelled or a copy fails), one never copied at once."""
        t = self._t
        life = t.life
        loop = asyncio.get_running_loop()
        n = len(found)
        jobs: list[tuple[asyncio.Future, int, int]] = []
        done = 0  # jobs[:done] ended and were settled
        try:
            for lo, hi in _parts(n):
                jobs.append((loop.run_in_executor(self._copy_pool, s.memory.scatter_from, bids[lo:hi], t.host.arena,
                                                  slots[lo:hi]), lo, hi))
                if hi >= n:  # beside the last copies: head newest, as one chain (a failed copy leaves it
                    t.host.touch(found)  # refreshed, which is harmless)
                    if t.disk is not None:
                        t.disk.touch(found)
                while len(jobs) - done >= PIPELINE_DEPTH or (done < len(jobs) and hi >= n):
                    fut, a, b = jobs[done]
                    await asyncio.shield(fut)
                    part = found[a:b]
                    life.loaded(s.id, part)
                    life.unpin(part)
                    done += 1
        except BaseException:
            for fut, a, b in jobs[done:]:  # each part's pins go once its copy thread is done with them
                _when_copy_ends(fut, functools.partial(life.unpin, found[a:b]))
            life.unpin(found[jobs[-1][2] if jobs else 0:])  # parts never started
            raise

    @staticmethod
    def _answer_loaded(results: LoadResults, pos: list[int], n: int) -> None:
        """LOADED from the host tier for the n found blocks at positions pos."""
        loaded, host = int(LoadStatus.LOADED), int(Tier.HOST)
        if n == len(results.status):
            results.status[:] = [loaded] * n
            results.tier[:] = [host] * n
        else:
            status, tiers = results.status, results.tier
            for i in pos:
                status[i] = loaded
                tiers[i] = host

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
            if not t.onboard(e, r):  # no free or clean slot was left: onboarded after the reply
                late.append((e, r))
            srcs.append(r)
            ids.append(bids[k])
        if late and self.config.onboard_disk_hits == "always":  # as one batch: one eviction plan, copies off the loop
            self._later(t.onboard_many([e for e, _ in late], [r for _, r in late]))
        # "clean": served from their scratch buffers only; onboarding them would spill the dirty blocks
        # they replace, a disk write for every disk read
        return host_ids, host_slots, srcs, ids, served, tiers_of, disk_loads

    async def prefetch(self, session_id: SessionId, hashes: bytes | Sequence[bytes],
                       namespace_id: str = "") -> list[PrefetchResult]:
        """Stage disk blocks into the host tier under a lease. A session's leases hold at most
        prefetch_share of the host tier, and all sessions' leases together prefetch_total_share
        (the rest is refused, with the reason: many sessions must not pin the whole tier between
        them); a block already in host memory is leased once, never renewed by another prefetch
        while its lease runs."""
        t0 = time.perf_counter()
        s = self._session(session_id, namespace_id)
        hashes = self._hashes(hashes)
        t = self._t
        life = t.life
        now = self.clock.now()
        seconds = self.config.pin_lease_seconds
        out: list[PrefetchResult] = []
        get = t.index.namespace(s.namespace).get
        to_read: list[tuple[int, Entry]] = []
        life.end_expired_leases(now)  # ran out, not reaped yet: no longer count
        budget = min(self._lease_cap() - life.leases.owned_bytes(s.id),
                     self._total_lease_cap() - life.leases.total_bytes)
        not_found = PrefetchResult(PrefetchStatus.NOT_FOUND)
        in_host = PrefetchResult(PrefetchStatus.ALREADY_IN_HOST)
        lease_now: dict[int, Entry] = {}  # in host memory, no lease running: leased as one batch below
        leasing = 0  # their bytes
        for h in hashes:
            e = get(h)
            if e is None or not e.ready or e.tier == Tier.NONE:
                out.append(not_found)
            elif e.in_memory:
                # a running lease (this session's or another's) is not renewed
                if e.lease_until <= now and id(e) not in lease_now:
                    if e.size > budget:
                        out.append(self._over_cap(s, leasing))
                        continue
                    budget -= e.size
                    leasing += e.size
                    lease_now[id(e)] = e
                out.append(in_host)
            elif e.size > budget:
                out.append(self._over_cap(s, leasing))
            else:
                budget -= e.size
                to_read.append((len(out), e))
                out.append(PrefetchResult(PrefetchStatus.STAGED))
        if lease_now:
            life.lease_many(s.id, list(lease_now.values()), now, seconds, staged=False)
        reading = [e for _, e in to_read]
        if not reading:
            self._prefetch_latency.observe(time.perf_counter() - t0)
            return out
        life.pin(reading)
        try:
            # one coalesced read, straight into host slots where there is room (no copy on the loop)
            reads = await t.read_batch(reading, s.memory.alloc_host, s.block_bytes)
            self._prefetch_read_latency.observe(time.perf_counter() - t0)
            late: list[tuple[int, Entry, torch.Tensor]] = []  # landed in scratch, no free or clean slot left
            for (pos, e), (r, onboarded) in zip(to_read, reads):
                if isinstance(r, BaseException):
                    out[pos] = PrefetchResult(PrefetchStatus.FAILED, f"disk read failed, block discarded: {r}")
                elif not onboarded and not e.in_memory and not t.onboard(e, r):
                    late.append((pos, e, r))
            if late:  # one eviction plan and one wait for its spills, not a wait per block
                await t.onboard_many([e for _, e, _ in late], [r for _, _, r in late])
                for pos, e, _ in late:
                    if not e.in_memory:
                        out[pos] = PrefetchResult(PrefetchStatus.FAILED,
                                                  "no room in the host tier: it is pinned by loads and prefetches")
            for pos, e in to_read:
                if out[pos].status != PrefetchStatus.STAGED:
                    continue
                if e.lease_until <= now and self._sessions.find(s.id) is s:  # its session may have closed meanwhile
                    life.lease(s.id, e, now, seconds, staged=True)
                self.stats.bump(s.namespace, "prefetch_staged")
        finally:
            life.unpin(reading)
        self._prefetch_latency.observe(time.perf_counter() - t0)
        return out

    def _lease_cap(self) -> int:
        return int(self.config.prefetch_share * self._t.host.capacity_bytes)

    def _total_lease_cap(self) -> int:
        return int(self.config.prefetch_total_share * self._t.host.capacity_bytes)

    def _over_cap(self, s: Session, leasing: int = 0) -> PrefetchResult:
        """Why a prefetch is refused; `leasing`: bytes this call is about to lease."""
        book = self._t.life.leases
        mine, total = book.owned_bytes(s.id) + leasing, book.total_bytes + leasing
        if self._lease_cap() - mine <= self._total_lease_cap() - total:
            why = (f"this session's prefetch leases hold {mine} bytes; its cap is "
                   f"{self._lease_cap()} (prefetch_share {self.config.prefetch_share:g} of the host tier)")
        else:
            why = (f"the prefetch leases of all sessions hold {total} bytes; their cap is {self._total_lease_cap()} "
                   f"(prefetch_total_share {self.config.prefetch_total_share:g} of the host tier)")
        return PrefetchResult(PrefetchStatus.FAILED, why)

    def _later(self, coro) -> None:
        """Run off the request path (onboarding a disk hit after the Load reply)."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

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

    # --- admin
    async def evict(self, *, namespace: NamespaceId | None = None, expired: bool = False, all: bool = False) -> int:
        if sum((namespace is not None, expired, all)) != 1:
            raise CacheError(ErrorCode.INVALID_ARGUMENT, "evict needs exactly one of namespace, expired, all")
        t = self._t
        now = self.clock.now()
        if namespace is not None:
            victims = [e for e in t.index.values() if e.namespace == namespace]
        elif expired:
            victims = [e for e in t.index.values() if 0 < e.deadline <= now]
        else:
            victims = list(t.index.values())
        n = 0
        for e in victims:
            if e.ready and not e.pinned(now):
                t.remove(e)
                self.stats.bump(e.namespace, "evictions_admin")
                n += 1
        return n

    def describe_blocks(self, namespace: NamespaceId, hashes: Sequence[bytes]) -> list[dict | None]:
        """Admin.DescribeBlocks: where each block is and what holds it, read-only; None: not stored."""
        if len(hashes) > self.config.max_batch_blocks:
            raise CacheError(ErrorCode.RESOURCE_EXHAUSTED,
                             f"{len(hashes)} hashes exceed max_batch_blocks = {self.config.max_batch_blocks}")
        t = self._t
        now = self.clock.now()
        if namespace not in self.namespaces.records and not any(e.namespace == namespace for e in t.index.values()):
            raise CacheError(ErrorCode.NOT_FOUND, f"namespace {quoted(namespace)} has no blocks and no sessions")
        out: list[dict | None] = []
        for h in hashes:
            e = t.index.get(BlockKey(namespace, BlockHash(h)))
            if e is None or e.tier == Tier.NONE:
                out.append(None)
                continue
            tiers = (["host"] if e.in_memory else []) + (["disk"] if e.disk == DiskState.ON_DISK else [])
            out.append(dict(tiers=tiers, disk=e.disk.name.lower(), deadline=e.deadline, retained=e.retained(now),
                            pinned=e.pinned(now), bytes=e.size, reuse=e.reuse, stored_at=e.stored_at))
        return out

    def sessions(self) -> list[SessionInfo]:
        now = self.clock.now()
        leases = self._t.life.leases
        return [SessionInfo(s.label, s.namespace, s.client_name, s.pool.kind, s.pool.num_blocks, s.opened_at,
                            max(0.0, s.lease_until - now), leases.count(s.id), s.peer.uid, s.peer.pid)
                for s in self._sessions.all()]

    def namespace_stats(self) -> list[dict]:
        t = self._t
        now = self.clock.now()
        rows: dict[str, dict] = {}

        def row_of(ns_id: str, block_bytes: int) -> dict:
            row = rows.get(ns_id)
            if row is None:
                rec = self.namespaces.records.get(ns_id)
                spec = rec.spec if rec is not None else None
                row = rows[ns_id] = dict(
                    namespace_id=ns_id, model_id=spec.model_id if spec else "", tp_rank=spec.tp_rank if spec else 0,
                    tp_size=spec.tp_size if spec else 0, block_bytes=rec.block_bytes if rec else block_bytes,
                    host_blocks=0, host_bytes=0, disk_blocks=0, disk_bytes=0, retained_bytes=0,
                    retained_cap_bytes=self.config.retained_cap_bytes, sessions=0, counters=self.stats.ns(ns_id))
            return row

        for ns_id, rec in self.namespaces.records.items():
            row_of(ns_id, rec.block_bytes)
        for e in t.index.values():
            row = row_of(e.namespace, e.size)
            if e.host_buf is not None:
                row["host_blocks"] += 1
                row["host_bytes"] += e.size
            if e.disk == DiskState.ON_DISK:
                row["disk_blocks"] += 1
                row["disk_bytes"] += e.size
            if e.deadline > now:
                row["retained_bytes"] += e.size
        for s in self._sessions.all():
            if s.namespace in rows:
                rows[s.namespace]["sessions"] += 1
        return list(rows.values())

    def tier_stats(self) -> list[dict]:
        t = self._t
        now = self.clock.now()
        out = []
        for tier in (t.host, t.disk):
            if tier is None:
                continue
            entries = list(tier.entries())
            out.append(dict(name=tier.name, capacity_bytes=tier.capacity_bytes, used_bytes=tier.used_bytes,
                            blocks=len(entries), pinned_blocks=sum(e.pinned(now) for e in entries),
                            retained_blocks=sum(e.retained(now) for e in entries)))
        return out

    @property
    def counters(self) -> Counters:
        return self.stats.total

    @property
    def latencies(self) -> list[Histogram]:
        return [self._store_latency, self._load_latency, self._prefetch_latency, self._prefetch_read_latency]

    def queue_depths(self) -> dict[str, int]:
        t = self._t
        return dict(write_queue_depth=t.writes.waiting, writes_in_progress=t.writes.in_flight,
                    write_queue_high_water=t.writes.high_water, write_queue_capacity=t.writes.capacity,
                    read_queue_depth=t.reads_in_flight)

    def audit(self, idle: bool = True) -> list[str]:
        """What is inconsistent right now, in words (empty: nothing): lifecycle.Lifecycle.audit's
        invariants, and the disk tier's room. idle: no call is in flight, so nothing may be
        half-made or pinned either; idle=False checks what holds at every await point (the host
        room and lease books). Tests and the property machine check it after every step."""
        t = self._t
        problems = t.life.audit({s.id for s in self._sessions.all()}, idle=idle)
        if idle and t.disk is not None:
            disk = sum(e.size for e in t.index.values() if e.disk != DiskState.NONE)
            if disk != t.disk.used_bytes:
                problems.append(f"disk tier accounts {t.disk.used_bytes} bytes, its blocks hold {disk}")
        return problems


_HASH_DTYPE = np.dtype(f"V{HASH_BYTES}")
_NUMPY_IDS = 256  # block ids checked with numpy from this many on (its fixed cost is a few us)
# A Store chunk of more than 2 x PIPELINE_BLOCKS blocks is planned and copied in parts of that many,
# the next part's plan beside the previous part's copy, at most PIPELINE_DEPTH copies in flight.
# KVSERVICE_STORE_PART_BLOCKS overrides the part size (a benchmark's A/B; a huge value: one part)
PIPELINE_BLOCKS = max(1, int(os.environ.get("KVSERVICE_STORE_PART_BLOCKS", "2048")))
PIPELINE_FIRST = 256  # the first part: the first copy starts after a short plan; parts double from it
PIPELINE_DEPTH = 2
_slot_of = operator.attrgetter("slot")
GC_YOUNG_THRESHOLD = 50_000  # allocations between young collections (CPython's default: 700)


SWITCH_INTERVAL = float(os.environ.get("KVSERVICE_SWITCH_INTERVAL", "0.0002"))  # seconds


def _tune_switch_interval() -> None:
    """A copy thread woken by its device (a DMA done) needs the GIL back to start the next piece;
    while the event loop runs a Store's or Load's bookkeeping it would wait up to CPython's
    default 5 ms switch interval each time, and the copies of a Store or Load in parts (whose
    point is to overlap that bookkeeping) would stall. 0.2 ms: the loop gives the GIL up soon."""
    if SWITCH_INTERVAL > 0 and sys.getswitchinterval() > SWITCH_INTERVAL:
        sys.setswitchinterval(SWITCH_INTERVAL)


def _tune_gc() -> None:
    """A Store of 4096 blocks makes ~10k long-lived objects (entries and their keys, no cycles
    among them): at CPython's default thresholds that is a dozen young collections per call and a
    full one (a walk of every entry in the daemon) every few calls - measured 1.6 -> 0.6 us per
    new entry with 200k live. Collect young objects less often; cycles are still collected."""
    young, mid, old = gc.get_threshold()
    if young and young < GC_YOUNG_THRESHOLD:
        gc.set_threshold(GC_YOUNG_THRESHOLD, max(mid, 20), max(old, 50))


def _when_copy_ends(fut: asyncio.Future, fn: Callable[[], object]) -> None:
    """Run fn once an abandoned copy job's thread is done with its memory (now if it is), its outcome
    retrieved: the call's failure is raised already or superseded."""
    if fut.done():
        if not fut.cancelled():
            fut.exception()
        fn()
    else:
        fut.add_done_callback(lambda f: (f.cancelled() or f.exception(), fn()))


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


def _parts(n: int) -> list[tuple[int, int]]:
    """The (lo, hi) parts a Store chunk or a Load of n blocks is planned and copied in: one part up
    to 2 x PIPELINE_BLOCKS; else min(PIPELINE_FIRST, PIPELINE_BLOCKS) blocks first, each part
    twice the one before up to PIPELINE_BLOCKS."""
    if n <= 2 * PIPELINE_BLOCKS:
        return [(0, n)]
    out: list[tuple[int, int]] = []
    size, lo = min(PIPELINE_FIRST, PIPELINE_BLOCKS), 0
    while lo < n:
        hi = min(n, lo + size)
        out.append((lo, hi))
        lo, size = hi, min(2 * size, PIPELINE_BLOCKS)
    return out


def _fail_unanswered(results: StoreResults | LoadResults, failed: int) -> None:
    """A block the call left without a status (a core bug) is reported failed, never as success."""
    if 0 in results.status:
        for i, st in enumerate(results.status):
            if st == 0:
                results.set(i, failed, message="internal error")


def _scatter(memory, arena: HostArena, host_ids: list[int], host_slots: list[int], ids: list[int],
             srcs: list[torch.Tensor]) -> None:
    """One copy job of a Load: host slots -> engine (scatter_from), then disk-read buffers -> engine."""
    if host_ids:
        memory.scatter_from(host_ids, arena, host_slots)
    if ids:
        memory.scatter(ids, srcs)
