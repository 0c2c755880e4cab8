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
The data paths live beside this module, as mixins over BlockCache's state: store_path (Store,
retain), load_path (Load), prefetch_path (Prefetch), with pipeline (parts of a large batch).
Moves between tiers live in tiers.Tiers; the policies in eviction and retention.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kvservice.core import pipeline
from kvservice.core.clock import Clock
from kvservice.ops.config import Config
from kvservice.memory.engine_memory import open_engine_memory
from kvservice.memory.host_arena import HostArena
from kvservice.memory.key_groups import KeyIds
from kvservice.placement.index import DiskState
from kvservice.disk.io_backend import BlockIO, open_backend
from kvservice.disk.io_throttle import throttled
from kvservice.core.namespaces import NamespaceRegistry
from kvservice.ops.quoting import quoted
from kvservice.core.sessions import Session, SessionTable
from kvservice.core.sessions_api import MAIN_LISTENER, NamespaceSpec, OpenedSession, Peer, PoolSpec, SessionInfo
from kvservice.ops.stats import CounterSet, Counters, Histogram
from kvservice.core.tiers import Tiers, arena_bytes
from kvservice.core.lifecycle import in_host_tier
from kvservice.core.load_path import LoadPath
from kvservice.core.prefetch_path import PrefetchPath
from kvservice.core.store_path import StorePath
from kvservice.core.types import HASH_BYTES, BlockHash, BlockKey, CacheError, ErrorCode, NamespaceId, SessionId, Tier
from kvservice.ops.trace import TRACE

log = logging.getLogger(__name__)


class BlockCache(StorePath, LoadPath, PrefetchPath):
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
        self._tidying: asyncio.Task | None = None  # _tidy, while it runs

    # --- lifecycle
    async def start(self) -> int:
        """Open the I/O backend, recover the disk tier, start the writers. Returns blocks recovered."""
        _tune_gc(self.config.max_batch_blocks)
        _tune_switch_interval()
        io = self._io if self._io is not None else open_backend(self.config.io_backend)
        self._io = throttled(io, self.config.disk_read_bytes_per_second, self.config.disk_write_bytes_per_second)
        # the host tier's memory, all of it, now: pinned where engines copy over PCIe
        self.arena = HostArena(arena_bytes(self.config), pin=torch.cuda.is_available())
        self.tiers = Tiers(self.config, self._io, self.stats, self.clock.now, self.arena)
        recovered = await self.tiers.recover()
        sizes = self.tiers.recovered_sizes  # one canary read per namespace
        for ns_id, size in sizes.items():
            self.namespaces.known_from_disk(ns_id, size)
        self.tiers.start()
        # a fresh daemon's first Stores take new entries built now, as the later ones take those
        # built after the Store before them (Lifecycle.blanks)
        self.tiers.life.blanks.refill()
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
        TRACE.dump()  # KVTUNE_TRACE: the call timelines (a no-op when off)

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
            if self.arena.max_slots(pool.key_bytes) == 0:
                raise CacheError(ErrorCode.FAILED_PRECONDITION,
                                 f"a block of {pool.key_bytes} bytes does not fit the host tier's "
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
        log.info("session %s opened: uid %d pid %d, namespace %s (model %s), %d blocks of %d bytes (%d a key), "
                 "client %s", s.label, peer.uid, peer.pid, rec.id, quoted(ns.model_id), pool.num_blocks,
                 pool.block_bytes, pool.blocks_per_key, quoted(client_name))
        return OpenedSession(s.id, rec.id, self.config.lease_seconds, self.config.max_batch_blocks, pool.key_bytes,
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

    def _block_ids(self, s: Session, n: int, block_ids: Sequence[int]) -> list[int] | KeyIds:
        """Engine block ids, one per hash (k per hash, as KeyIds, for a pool of blocks_per_key k > 1),
        inside the session's pool, none twice. A large batch off the wire (a protobuf repeated field,
        or the frames channel's array: numpy reads it without a Python int per id) is checked with
        numpy (range, and duplicates by marking a table of the pool's blocks): ~0.02 vs ~0.07 us a
        block; a list (in-process callers) is as fast through the Python checks."""
        k = s.pool.blocks_per_key
        if k == 1:
            return self._engine_ids(s, n, block_ids, 1)
        a = self._engine_ids(s, n * k, block_ids, k, as_array=True)
        return KeyIds(np.asarray(a, dtype=np.int64).reshape(n, k))

    def _engine_ids(self, s: Session, m: int, block_ids: Sequence[int], k: int, as_array: bool = False):
        """_block_ids' checks of m ids (k per hash): a list of ints (as_array: or the checked array)."""
        if m >= _NUMPY_IDS and not isinstance(block_ids, list) and len(block_ids) == m:
            try:
                a = np.asarray(block_ids)
            except (OverflowError, ValueError, TypeError):
                a = None
            if a is not None and a.ndim == 1 and a.dtype.kind in "iu":
                pool_blocks = s.pool.num_blocks
                if int(a.min()) >= 0 and int(a.max()) < pool_blocks:
                    mark = np.zeros(pool_blocks, dtype=np.bool_)
                    mark[a] = True
                    if int(np.count_nonzero(mark)) == m:
                        return a if as_array else a.tolist()
        # small batches, and any batch the checks above refused: say why (an array off the frames channel: as ints)
        ids = block_ids.tolist() if isinstance(block_ids, np.ndarray) else list(block_ids)
        if len(ids) != m:
            per = ("one engine block per hash" if k == 1 else
                   f"{k} engine blocks per hash, a hash's in order (the pool's blocks_per_key)")
            raise CacheError(ErrorCode.INVALID_ARGUMENT,
                             f"{len(ids)} block_ids for {m // k} hashes: block_ids must name {per}")
        if not ids:
            return ids
        pool_blocks = s.pool.num_blocks
        if min(ids) < 0 or max(ids) >= pool_blocks:
            i, b = next((i, b) for i, b in enumerate(ids) if not 0 <= b < pool_blocks)
            raise CacheError(ErrorCode.INVALID_ARGUMENT,
                             f"block_id {b} (#{i}) is outside the pool's {pool_blocks} blocks")
        if len(set(ids)) != m:
            raise CacheError(ErrorCode.INVALID_ARGUMENT, "a block_id appears twice in one batch")
        return ids

    # --- data
    def lookup(self, session_id: SessionId, hashes: bytes | Sequence[bytes], namespace_id: str = "") -> list[int]:
        """Tier value of each block of the stored prefix of the chain (Tier.HOST / Tier.DISK)."""
        s = self._session(session_id, namespace_id)
        return self._t.index.prefix_tiers(s.namespace, self._hashes(hashes))


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


    def _tidy_soon(self, answered: bool = False) -> None:
        """Start the task that does Lifecycle.tidy_step until nothing is left, a step (~1 ms) between
        other requests: a Load the engine sends as soon as its Store was answered waits for one step
        at most, not for all of it (32768 blank entries are ~15 ms of the GPU host's loop).
        answered: the caller's reply is out already (pipeline.Answer.sent): then (pipeline.TIDY, by
        default) all of it is done now, before the next request is read."""
        if answered and pipeline.TIDY == "answer":
            while self._t.life.tidy_step():
                pass
            return
        if self._tidying is None and not self._stopping:
            self._tidying = asyncio.ensure_future(self._tidy())
            self._background.add(self._tidying)
            self._tidying.add_done_callback(self._background.discard)

    async def _tidy(self) -> None:
        try:
            while self._t.life.tidy_step():
                await asyncio.sleep(0)
        finally:
            self._tidying = None

    def _later(self, coro) -> None:
        """Run off the request path (onboarding a disk hit after the Load reply)."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


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
        if namespace not in self.namespaces.records and not t.index.has_namespace(namespace):
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
                            max(0.0, s.lease_until - now), leases.count(s.id), s.peer.uid, s.peer.pid,
                            s.pool.blocks_per_key)
                for s in self._sessions.all()]

    def namespace_stats(self) -> list[dict]:
        """One row per namespace with a record or an indexed entry: O(namespaces + sessions), from
        the counts the lifecycle keeps (kvservice.placement.tier_counts) and retention's sums;
        _namespace_stats_walked is the walk they replace (audit() checks they agree)."""
        return self._namespace_stats(self.clock.now())

    def _namespace_stats(self, now: float) -> list[dict]:
        t = self._t
        counts = t.life.ns_counts
        rows: dict[str, dict] = {}
        for ns_id, rec in self.namespaces.records.items():
            rows[ns_id] = self._namespace_row(ns_id, rec.block_bytes)
        for ns_id, first in t.index.namespaces():
            if ns_id not in rows:
                rows[ns_id] = self._namespace_row(ns_id, first.size)
        for ns_id, row in rows.items():
            row["host_blocks"], row["host_bytes"], row["disk_blocks"], row["disk_bytes"] = counts.get(ns_id)
            row["retained_bytes"] = t.retention.retained_bytes(ns_id, now)
        for s in self._sessions.all():
            if s.namespace in rows:
                rows[s.namespace]["sessions"] += 1
        return list(rows.values())

    def _namespace_row(self, ns_id: str, block_bytes: int) -> dict:
        rec = self.namespaces.records.get(ns_id)
        spec = rec.spec if rec is not None else None
        return dict(namespace_id=ns_id, model_id=spec.model_id if spec else "", tp_rank=spec.tp_rank if spec else 0,
                    tp_size=spec.tp_size if spec else 0, block_bytes=rec.block_bytes if rec else block_bytes,
                    host_blocks=0, host_bytes=0, disk_blocks=0, disk_bytes=0, retained_bytes=0,
                    retained_cap_bytes=self.config.retained_cap_bytes, sessions=0, counters=self.stats.ns(ns_id))

    def _namespace_stats_walked(self, now: float) -> list[dict]:
        """namespace_stats by a walk of every indexed entry: the reference audit() checks the counts against."""
        t = self._t
        rows: dict[str, dict] = {}

        def row_of(ns_id: str, block_bytes: int) -> dict:
            row = rows.get(ns_id)
            if row is None:
                row = rows[ns_id] = self._namespace_row(ns_id, block_bytes)
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
        """One row per tier, O(1) each: blocks and bytes from the tier's books, pinned and retained
        members from its counts (kvservice.placement.tier_counts); audit() checks them against
        _tier_stats_walked."""
        return self._tier_stats(self.clock.now())

    def _tier_stats(self, now: float) -> list[dict]:
        t = self._t
        out = []
        if t.host is not None:
            host = t.host
            out.append(dict(name=host.name, capacity_bytes=host.capacity_bytes, used_bytes=host.used_bytes,
                            blocks=len(host) + len(host.unstaged), pinned_blocks=host.counts.pinned_blocks(now),
                            retained_blocks=host.counts.retained_blocks(now)))
        if t.disk is not None:
            disk = t.disk
            out.append(dict(name=disk.name, capacity_bytes=disk.capacity_bytes, used_bytes=disk.used_bytes,
                            blocks=len(disk.unmarked) + len(disk.retained), pinned_blocks=disk.counts.pinned_blocks(now),
                            retained_blocks=disk.counts.retained_blocks(now)))
        return out

    def _tier_stats_walked(self, now: float) -> list[dict]:
        """tier_stats by a walk of each tier's blocks: the reference audit() checks the counts against."""
        t = self._t
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
        problems += self._audit_stats_counts()
        return problems

    def _audit_stats_counts(self) -> list[str]:
        """The Stats figures kept incrementally against the walks they replace (at one `now`), and
        the lifecycle's test of host tier membership (lifecycle.in_host_tier) against the tier's books.
        These hold at every await point, not only when idle."""
        t = self._t
        now = self.clock.now()
        problems: list[str] = []
        for kind, fast, walked in (("namespace", self._namespace_stats(now), self._namespace_stats_walked(now)),
                                   ("tier", self._tier_stats(now), self._tier_stats_walked(now))):
            for a, b in itertools.zip_longest(fast, walked, fillvalue={}):
                name = a.get("namespace_id", a.get("name")) or b.get("namespace_id", b.get("name"))
                for k in sorted(set(a) | set(b)):
                    if a.get(k) != b.get(k):
                        problems.append(f"{kind} {name} stats: {k} is {a.get(k)} counted, {b.get(k)} walked")
        members = {id(e) for e in t.host.entries()}
        seen = {id(e): e for e in t.index.values()}
        for more in (t.life.aborted.values(), t.life.releasing.values(), t.host.spilling.values(), t.host.entries()):
            seen.update((id(e), e) for e in more)
        odd = [e for k, e in seen.items() if in_host_tier(e) != (k in members)]
        if odd:
            problems.append(f"{len(odd)} blocks whose state says {'not ' if id(odd[0]) in members else ''}in the "
                            f"host tier, its books say otherwise")
        if t.disk is not None:
            on_disk = {id(e) for e in t.disk.entries()}
            odd = [e for k, e in seen.items() if (e.disk == DiskState.ON_DISK) != (k in on_disk)]
            if odd:
                problems.append(f"{len(odd)} blocks whose disk state and the disk tier's books disagree")
        return problems


_HASH_DTYPE = np.dtype(f"V{HASH_BYTES}")
_NUMPY_IDS = 256  # block ids checked with numpy from this many on (its fixed cost is a few us)
GC_YOUNG_THRESHOLD = 50_000  # allocations between young collections (CPython's default: 700)


SWITCH_INTERVAL = float(os.environ.get("KVTUNE_SWITCH_INTERVAL", "0.0002"))  # seconds


def _tune_switch_interval() -> None:
    """A copy thread woken by its device (a DMA done) needs the GIL back to start the next piece;
    while the event loop runs a Store's or Load's bookkeeping it would wait up to CPython's
    default 5 ms switch interval each time, and the copies of a Store or Load in parts (whose
    point is to overlap that bookkeeping) would stall. 0.2 ms: the loop gives the GIL up soon."""
    if SWITCH_INTERVAL > 0 and sys.getswitchinterval() > SWITCH_INTERVAL:
        sys.setswitchinterval(SWITCH_INTERVAL)


def _tune_gc(max_batch_blocks: int = 0) -> None:
    """A Store of 4096 blocks makes ~10k long-lived objects (entries and their keys, no cycles
    among them): at CPython's default thresholds that is a dozen young collections per call and a
    full one (a walk of every entry in the daemon) every few calls - measured 1.6 -> 0.6 us per
    new entry with 200k live. Collect young objects less often; cycles are still collected.
    At least twice the largest batch: a Store builds an entry per new block before the batch it
    evicts is freed (the host LRU lets a Store's entries go as one group, once all are evicted), so
    a threshold under the batch size made every large Store walk its new entries in a young
    collection that frees nothing (65536 blocks: 13-24 ms a Store, ~0.25 us an entry, CPU box);
    in the steady state a Store frees as many as it builds, and the count stays under this one."""
    young, mid, old = gc.get_threshold()
    want = max(GC_YOUNG_THRESHOLD, 2 * max_batch_blocks + 16384)
    if young and young < want:
        gc.set_threshold(want, max(mid, 20), max(old, 50))


