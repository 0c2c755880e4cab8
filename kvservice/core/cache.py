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
import heapq
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

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
        self._leases: dict[BlockKey, tuple[Entry, bool]] = {}  # prefetch leases: entry, staged from disk
        self._leased_bytes: dict[SessionId, int] = {}  # bytes of each session's running leases
        self._leased_total = 0  # bytes of all running leases
        self._lease_expiry: list[tuple[float, int, BlockKey]] = []  # heap of (until, seq, key); stale ones skipped
        self._lease_seq = 0
        self._copy_pool = ThreadPoolExecutor(4, thread_name_prefix="kv-copy")
        self._store_latency = Histogram("store")
        self._load_latency = Histogram("load")
        self._stopping = False
        self._background: set[asyncio.Task] = set()

    # --- lifecycle
    async def start(self) -> int:
        """Open the I/O backend, recover the disk tier, start the writers. Returns blocks recovered."""
        io = self._io if self._io is not None else open_backend(self.config.io_backend)
        self._io = throttled(io, self.config.disk_read_bytes_per_second, self.config.disk_write_bytes_per_second)
        # the host tier's memory, all of it, now: pinned where engines copy over PCIe
        self.arena = HostArena(self.config.host_capacity_bytes + spill_staging_bytes(self.config),
                               pin=torch.cuda.is_available())
        self.tiers = Tiers(self.config, self._io, self.stats, self.clock.now, self.arena)
        recovered = await self.tiers.recover()
        sizes = {e.namespace: e.size for e in self.tiers.index.values()}  # one canary read per namespace
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
        for key in list(s.leased):
            held = self._leases.get(key)
            if held is not None and held[0].lease_owner == s.id:
                self._end_lease(key, used=False)
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
        self._end_expired_leases(now)
        return [s.id for s in dead]

    def _end_lease(self, key: BlockKey, used: bool) -> None:
        e, staged = self._leases.pop(key)
        self._leased_total -= e.size
        if staged:
            self.stats.bump(e.namespace, "prefetch_used" if used else "prefetch_wasted")
        owner = SessionId(e.lease_owner)
        left = self._leased_bytes.get(owner, 0) - e.size
        if left > 0:
            self._leased_bytes[owner] = left
        else:
            self._leased_bytes.pop(owner, None)
        s = self._open_session_or_none(owner)
        if s is not None:
            s.leased.discard(key)
        e.lease_until = 0.0
        e.lease_owner = ""

    def _open_session_or_none(self, session_id: SessionId) -> Session | None:
        try:
            return self._sessions.get(session_id)
        except CacheError:
            return None

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
            return [packed[i:i + HASH_BYTES] for i in range(0, len(packed), HASH_BYTES)]
        hs = list(hashes)
        self._check_count(len(hs))
        for i, h in enumerate(hs):
            if len(h) != HASH_BYTES:
                raise CacheError(ErrorCode.INVALID_ARGUMENT, f"hash #{i} has {len(h)} bytes, expected {HASH_BYTES}")
        return hs

    def _block_ids(self, s: Session, n: int, block_ids: Sequence[int]) -> list[int]:
        """Engine block ids, one per hash, inside the session's pool, none twice."""
        ids = list(block_ids)
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
        reservation the plan makes - index entries that are not ready, host room - is rolled back
        if the call fails or is cancelled at any await."""
        t0 = time.perf_counter()
        s = self._session(session_id, namespace_id)
        hs = self._hashes(hashes)
        ids = self._block_ids(s, len(hs), block_ids)
        self.namespaces.check_canary(s.namespace, s.canary)  # another session may have fixed it since
        t = self._t
        ttl = t.retention.clamp_ttl(ttl_seconds)
        now = self.clock.now()
        results = StoreResults(len(hs))
        ns, size = s.namespace, s.block_bytes
        blocks = t.index.namespace(ns)
        new: list[tuple[int, Entry, int]] = []  # (position, entry, engine block id)
        touched: list[tuple[int, Entry]] = []
        for i, h in enumerate(hs):
            e = blocks.get(h)
            if e is not None:
                touched.append((i, e))
                continue
            e = blocks[h] = Entry(BlockKey(ns, h), size, 0, now, pins=1, ready=False)
            new.append((i, e, ids[i]))
        try:
            if touched:
                self.stats.bump(ns, "store_hits", len(touched))
                hit = [e for _, e in touched]
                t.host.touch(hit)
                if t.disk is not None:
                    t.disk.touch(hit)
                # hits are retained first: a block this Store retains is no victim of its own evictions
                for i, e in touched:
                    if not e.ready:
                        results.set(i, StoreStatus.ALREADY_STORED)
                    elif ttl:
                        await self._retain_one(e, ttl, now, StoreStatus.ALREADY_STORED, results, i)
                    else:
                        results.set(i, StoreStatus.ALREADY_STORED, e.deadline if e.deadline > now else 0.0)
            if new:
                await self._store_new(s, new, ttl, now, results)
        finally:
            # whatever is still not ready was reserved by this call and never committed
            for _, e, _ in new:
                if not e.ready:
                    t.index.remove(e)
        if any(e.ready for _, e, _ in new) and self.namespaces.fix_canary(s.namespace, s.canary):
            log.info("namespace %s: hash canary fixed by session %s, its first store", s.namespace, s.label)
        self._store_latency.observe(time.perf_counter() - t0)
        _fail_unanswered(results, StoreStatus.FAILED)
        return results

    async def _store_new(self, s: Session, new: list[tuple[int, Entry, int]], ttl: float, now: float,
                         results: StoreResults) -> None:
        """Copy new blocks in, head first, in chunks the host tier can hold: a batch larger than
        the host tier streams through it (earlier chunks spill as later ones arrive)."""
        t = self._t
        chunk = max(1, min(t.host.arena.max_slots(s.block_bytes), t.host.capacity_bytes // s.block_bytes))
        for lo in range(0, len(new), chunk):
            stored = await self._store_chunk(s, new[lo:lo + chunk], ttl, now, results)
            if not stored:
                for i, e, _ in new[lo + chunk:]:
                    t.index.remove(e)
                    results.set(i, StoreStatus.NOT_STORED, message="no room in the host tier")
                return

    async def _store_chunk(self, s: Session, new: list[tuple[int, Entry, int]], ttl: float, now: float,
                           results: StoreResults) -> bool:
        """Store what fits of one chunk; False when some of it did not fit. Plan (evict, no await),
        wait for the spills that make the room, take slots, copy the engine's blocks straight into
        them, commit. Cancelled or failed before the commit, the slots go back (after the copy
        thread is done with them) and the entries go in store()'s finally."""
        t = self._t
        size = s.block_bytes
        # head first: when only part of the chain fits, keep its prefix
        fit, offsets = 0, None
        for attempt in range(4):  # a concurrent Store may take the slots our spills freed: plan again
            fit, spills = t.make_host_room(size, len(new) if attempt == 0 else fit, now)
            wait = t.room_after(spills, now, size, fit) if spills else None
            if fit and wait is not None:
                # the spills belong to the tiers, not to this call: cancelling the Store must not abandon them
                await asyncio.shield(wait)
            if not fit or t.host.placeable(size) >= fit:
                break
        if fit:
            fit = min(fit, t.host.placeable(size))
            offsets = t.host.alloc(size, fit) if fit else None
        if fit < len(new):
            pinned, protected = t.host_blockers(now)
            if protected:  # DESIGN §5 protect-unexpired: refused admission, counted
                why = "the rest of it holds unexpired retained blocks that cannot spill: " + t.protection_reason()
                self.stats.bump(s.namespace, "admission_refusals", len(new) - fit)
            elif pinned:
                why = "the rest of it is pinned by loads or prefetches in flight"
            else:
                why = "a concurrent call took the rest"
            message = f"host tier has room for {fit} of {len(new)} blocks: {why}"
            for i, e, _ in new[fit:]:
                t.index.remove(e)
                results.set(i, StoreStatus.NOT_STORED, message=message)
        complete = fit == len(new)
        new = new[:fit]
        if not new or offsets is None:
            return complete
        sums = await self._copy(s.memory.gather_into, [b for _, _, b in new], t.host.arena, offsets,
                                on_abandon=lambda: t.host.free(offsets, size))
        entries = [e for _, e, _ in new]
        for e, c in zip(entries, sums):
            e.checksum = c
            e.ready = True
            e.pins -= 1
        t.host.add(entries, offsets)
        self.stats.bump(s.namespace, "stores", len(entries))
        status = results.status
        if not ttl:
            for i, _, _ in new:
                status[i] = StoreStatus.STORED
            return complete
        for i, e, _ in new:
            await self._retain_one(e, ttl, now, StoreStatus.STORED, results, i)
        return complete

    async def _copy(self, fn, *args, on_abandon=None):
        """Run one copy job on the copy pool. If the caller is cancelled (or the job fails) the job
        still runs to its end in its thread: on_abandon runs only then, so memory the job touches
        (slots, pins) is never handed to anyone while the copy is on it."""
        fut = asyncio.get_running_loop().run_in_executor(self._copy_pool, fn, *args)
        try:
            return await asyncio.shield(fut)
        except BaseException:
            if on_abandon is not None:
                if fut.done():
                    on_abandon()
                else:
                    fut.add_done_callback(lambda _: on_abandon())
            raise

    async def _retain_one(self, e: Entry, ttl: float, now: float, status: StoreStatus, results: StoreResults,
                          i: int) -> None:
        """Extend e's retention to now + ttl (ttl > 0) and record the outcome as results[i]."""
        deadline = self._t.retention.extend(e, ttl, now)
        if deadline is None:
            self.stats.bump(e.namespace, "retain_cap_refusals")
            results.set(i, StoreStatus.STORED_NOT_RETAINED if status == StoreStatus.STORED else status,
                        message="retained-bytes cap of the namespace reached; stored without retention")
            return
        self._t.mark_retained(e)
        if e.disk == DiskState.ON_DISK:
            await self._t.persist_deadline(e)
        results.set(i, status, deadline)

    async def load(self, session_id: SessionId, hashes: bytes | Sequence[bytes], block_ids: Sequence[int],
                   namespace_id: str = "") -> LoadResults:
        """Fill engine blocks block_ids[i] with the blocks stored as hashes[i]; returns once they landed."""
        t0 = time.perf_counter()
        s = self._session(session_id, namespace_id)
        hs = self._hashes(hashes)
        ids = self._block_ids(s, len(hs), block_ids)
        t = self._t
        results = LoadResults(len(hs))
        blocks = t.index.namespace(s.namespace)
        found: list[tuple[int, int, Entry]] = []  # (position, engine block id, entry)
        misses = 0
        for i, h in enumerate(hs):
            e = blocks.get(h)
            if e is None or not e.ready or (e.slot < 0 and e.disk != DiskState.ON_DISK):
                results.status[i] = LoadStatus.MISSING
                misses += 1
                continue
            e.pins += 1
            found.append((i, ids[i], e))
        if misses:
            self.stats.bump(s.namespace, "load_misses", misses)
        pinned = [e for _, _, e in found]
        handed_over = False  # once the scatter runs, its thread drops the pins when it is done
        try:
            host_ids, host_slots, srcs, ids, served = await self._collect_bytes(s, found, results)
            if host_ids or srcs:
                handed_over = True
                await self._copy(_scatter, s.memory, t.host.arena, host_ids, host_slots, ids, srcs,
                                 on_abandon=lambda: t.host.unpin(pinned))
            status, tiers = results.status, results.tier
            host_loads = disk_loads = 0
            for (i, _, e), tier in served:
                e.reuse += 1
                if tier == Tier.HOST:
                    host_loads += 1
                else:
                    disk_loads += 1
                if e.lease_owner == s.id and e.key in self._leases:
                    self._end_lease(e.key, used=True)
                status[i] = LoadStatus.LOADED
                tiers[i] = tier
            if host_loads:
                self.stats.bump(s.namespace, "loads_host", host_loads)
            if disk_loads:
                self.stats.bump(s.namespace, "loads_disk", disk_loads)
            chain = [e for (_, _, e), _ in served]
            t.host.touch(chain)
            if t.disk is not None:
                t.disk.touch(chain)
            t.host.unpin(pinned)
        except BaseException:
            if not handed_over:
                t.host.unpin(pinned)
            raise
        self._load_latency.observe(time.perf_counter() - t0)
        _fail_unanswered(results, LoadStatus.FAILED)
        return results

    async def _collect_bytes(self, s: Session, found: list[tuple[int, int, Entry]], results: LoadResults):
        """Where the found blocks' bytes come from: host slots (engine ids + slot offsets, copied
        with one scatter_from per batch, no per-block tensor), and disk blocks read (and verified) as
        one batch, landing in host slots that become their host copy where the host tier has room
        (engine ids + buffers). `served`: (item, tier) in request order."""
        t = self._t
        # slots are pinned by the caller: a spill that finishes meanwhile leaves them in place
        on_disk = [e for _, _, e in found if e.slot < 0]
        reads = await t.read_batch(on_disk, s.memory.alloc_host, s.block_bytes) if on_disk else []
        read_of = {id(e): r for e, r in zip(on_disk, reads)}
        host_ids: list[int] = []
        host_slots: list[int] = []
        srcs: list[torch.Tensor] = []
        ids: list[int] = []
        served: list[tuple[tuple[int, int, Entry], Tier]] = []
        for item in found:
            i, b, e = item
            r = read_of.get(id(e)) if read_of else None
            if r is None:
                host_ids.append(b)
                host_slots.append(e.slot)
                served.append((item, Tier.HOST))
                continue
            r, onboarded = r
            if isinstance(r, BaseException):
                if not isinstance(r, (BlockIOError, OSError)):
                    raise r
                self.stats.bump(s.namespace, "load_failures")
                results.set(i, LoadStatus.FAILED, Tier.DISK, message=f"disk block discarded: {r}")
                continue
            served.append((item, Tier.DISK))
            if onboarded:  # read straight into its host slot: copied with the host hits, one job
                host_ids.append(b)
                host_slots.append(e.slot)
                continue
            if not t.onboard(e, r):  # no free or clean slot was left: onboarded after the reply
                self._later(t.onboard_evicting(e, r))
            srcs.append(r)
            ids.append(b)
        return host_ids, host_slots, srcs, ids, served

    async def prefetch(self, session_id: SessionId, hashes: bytes | Sequence[bytes],
                       namespace_id: str = "") -> list[PrefetchResult]:
        """Stage disk blocks into the host tier under a lease. A session's leases hold at most
        prefetch_share of the host tier, and all sessions' leases together prefetch_total_share
        (the rest is refused, with the reason: many sessions must not pin the whole tier between
        them); a block already in host memory is leased once, never renewed by another prefetch
        while its lease runs."""
        s = self._session(session_id, namespace_id)
        hashes = self._hashes(hashes)
        t = self._t
        now = self.clock.now()
        out: list[PrefetchResult] = []
        blocks = t.index.namespace(s.namespace)
        to_read: list[tuple[int, Entry]] = []
        self._end_expired_leases(now)  # ran out, not reaped yet: no longer count
        budget = min(self._lease_cap() - self._leased_bytes.get(s.id, 0), self._total_lease_cap() - self._leased_total)
        for h in hashes:
            e = blocks.get(h)
            if e is None or not e.ready or e.tier == Tier.NONE:
                out.append(PrefetchResult(PrefetchStatus.NOT_FOUND))
            elif e.in_memory:
                if e.lease_until <= now:  # a running lease (this session's or another's) is not renewed
                    if e.size > budget:
                        out.append(self._over_cap(s))
                        continue
                    budget -= self._lease(s, e, now, staged=False)
                out.append(PrefetchResult(PrefetchStatus.ALREADY_IN_HOST))
            elif e.size > budget:
                out.append(self._over_cap(s))
            else:
                budget -= e.size
                e.pins += 1
                to_read.append((len(out), e))
                out.append(PrefetchResult(PrefetchStatus.STAGED))
        try:
            # one coalesced read, straight into host slots where there is room (no copy on the loop)
            reads = await t.read_batch([e for _, e in to_read], s.memory.alloc_host, s.block_bytes) if to_read else []
            for (pos, e), (r, onboarded) in zip(to_read, reads):
                if isinstance(r, BaseException):
                    out[pos] = PrefetchResult(PrefetchStatus.FAILED, f"disk read failed, block discarded: {r}")
                    continue
                if not onboarded and not e.in_memory and not t.onboard(e, r) and not await t.onboard_evicting(e, r):
                    out[pos] = PrefetchResult(PrefetchStatus.FAILED,
                                              "no room in the host tier: it is pinned by loads and prefetches")
                    continue
                if e.lease_until <= now:
                    self._lease(s, e, now, staged=True)
                self.stats.bump(s.namespace, "prefetch_staged")
        finally:
            t.host.unpin([e for _, e in to_read])
        return out

    def _lease_cap(self) -> int:
        return int(self.config.prefetch_share * self._t.host.capacity_bytes)

    def _total_lease_cap(self) -> int:
        return int(self.config.prefetch_total_share * self._t.host.capacity_bytes)

    def _end_expired_leases(self, now: float) -> None:
        """End the leases that ran out (the reaper, and a prefetch before it counts the caps)."""
        heap = self._lease_expiry
        while heap and heap[0][0] <= now:
            _, _, key = heapq.heappop(heap)
            held = self._leases.get(key)
            if held is not None and held[0].lease_until <= now:  # not ended early, not leased again since
                self._end_lease(key, used=False)

    def _over_cap(self, s: Session) -> PrefetchResult:
        mine, total = self._leased_bytes.get(s.id, 0), self._leased_total
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

    def _lease(self, s: Session, e: Entry, now: float, staged: bool) -> int:
        """Pin e for one lease, owned by s; returns the bytes it adds to s's leases. Only for a
        block whose lease is not running (an ended one not yet reaped is ended first)."""
        if e.key in self._leases:
            self._end_lease(e.key, used=False)
        e.lease_until = now + self.config.pin_lease_seconds
        e.lease_owner = s.id
        self._leases[e.key] = (e, staged)
        self._leased_total += e.size
        self._lease_seq += 1
        heapq.heappush(self._lease_expiry, (e.lease_until, self._lease_seq, e.key))
        self._leased_bytes[s.id] = self._leased_bytes.get(s.id, 0) + e.size
        s.leased.add(e.key)
        return e.size

    async def retain(self, session_id: SessionId, hashes: bytes | Sequence[bytes], ttl_seconds: float,
                     namespace_id: str = "") -> list[float]:
        """Extend the retention of stored blocks; the new deadline per hash, 0.0 when not stored or
        refused by the namespace's retained-bytes cap (ttl 0 changes nothing and reads them)."""
        s = self._session(session_id, namespace_id)
        hashes = self._hashes(hashes)
        t = self._t
        ttl = t.retention.clamp_ttl(ttl_seconds)
        now = self.clock.now()
        blocks = t.index.namespace(s.namespace)
        out: list[float] = [0.0] * len(hashes)
        results = StoreResults(1)
        for k, h in enumerate(hashes):
            e = blocks.get(h)
            if e is None or not e.ready or e.tier == Tier.NONE:
                continue
            if not ttl:
                out[k] = e.deadline if e.deadline > now else 0.0
                continue
            results.messages.clear()
            await self._retain_one(e, ttl, now, StoreStatus.ALREADY_STORED, results, 0)
            out[k] = 0.0 if results.messages else e.deadline
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
        return [SessionInfo(s.label, s.namespace, s.client_name, s.pool.kind, s.pool.num_blocks, s.opened_at,
                            max(0.0, s.lease_until - now), len(s.leased), s.peer.uid, s.peer.pid)
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
        return [self._store_latency, self._load_latency]

    def queue_depths(self) -> dict[str, int]:
        t = self._t
        return dict(write_queue_depth=t.writes.waiting, writes_in_progress=t.writes.in_flight,
                    write_queue_high_water=t.writes.high_water, write_queue_capacity=t.writes.capacity,
                    read_queue_depth=t.reads_in_flight)

    def audit(self) -> list[str]:
        """What is inconsistent right now, in words (empty: nothing). Call it when no call is in
        flight: then no entry is half-made, nothing is pinned, and each tier's room is the sum of
        the blocks it holds. Tests and the property machine check it after every step."""
        t = self._t
        problems: list[str] = []
        entries = list(t.index.values())
        half = [e for e in entries if not e.ready]
        if half:
            problems.append(f"{len(half)} entries reserved but never committed")
        pinned = [e for e in entries if e.pins]
        if pinned:
            problems.append(f"{len(pinned)} entries still pinned by copies or reads")
        owners = {s.id for s in self._sessions.all()}
        orphans = [k for k, (e, _) in self._leases.items() if e.lease_owner not in owners]
        if orphans:
            problems.append(f"{len(orphans)} prefetch leases held by no open session")
        leased = sum(e.size for e, _ in self._leases.values())
        if leased != self._leased_total or leased != sum(self._leased_bytes.values()):
            problems.append(f"prefetch leases account {self._leased_total} bytes, they hold {leased}")
        host = sum(e.size for e in entries if e.host_buf is not None)
        if host != t.host.used_bytes:
            problems.append(f"host tier accounts {t.host.used_bytes} bytes, its blocks hold {host}")
        staged = sum(e.size for e in entries if e.staged)
        if staged != t.host.staged_bytes or staged > t.host.staging_bytes:
            problems.append(f"spill staging accounts {t.host.staged_bytes} bytes, its spills hold {staged}")
        slots = sum(e.size for e in entries if e.slot >= 0)
        if self.arena is not None and slots != self.arena.used_bytes:
            problems.append(f"arena has {self.arena.used_bytes} bytes of slots taken, blocks hold {slots}")
        if t.disk is not None:
            disk = sum(e.size for e in entries if e.disk != DiskState.NONE)
            if disk != t.disk.used_bytes:
                problems.append(f"disk tier accounts {t.disk.used_bytes} bytes, its blocks hold {disk}")
        return problems


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
