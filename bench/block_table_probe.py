"""A probe of issue 10 item 2 (per-block state in arrays): how fast can one namespace's host-tier
bookkeeping be in Python with numpy columns and one dict, beside the current core doing the same calls.

    .venv/bin/python bench/block_table_probe.py [--batches 4096,32768] [--rounds 5]
    .venv/bin/python bench/block_table_probe.py --check [--steps 20000] [--seed 1]

This is a probe, not the daemon. ArrayBlockTable (below, not in kvservice/) holds one namespace's host
tier: numpy columns indexed by row (slot, state, pins, lease_until, deadline, checksum, size, reuse,
LRU stamp, the 32-byte hash), one dict hash -> row (the only per-block Python structure), a stack of
free rows and one of free slots. Every operation is one pass over its batch, vectorised where it pays.

Timed side by side, us per block, best of --rounds (Lookup: 10 x --rounds). After every round, untimed,
the table's audit() and, on the current side, BlockCache.audit(): both walk every block, so each round
starts with the same cold CPU caches on both sides; Lookup is also timed repeated with no walk between
(cache-hot, as bench/core_overhead.py times it). The daemon's GC thresholds (cache._tune_gc) hold for both.
  store      Store of new hashes into a full tier (3 batches): each Store evicts a batch (dropped, no
             disk), reserves, commits. Current core: BlockCache.store with no-op copies, as
             bench/core_overhead.py drives it (shm Pool from tests/corekit.py, FakeClock). Two current
             columns: the copy job through the core's thread pool (as core_overhead.py), and through
             an inline executor (no thread hop: the core's own bookkeeping only, the fairer one).
  store_hit  Store of hashes already stored (touched, ALREADY_STORED).
  load       Load of host hits, then their unpin (the current core unpins inside load()).
  lookup     Lookup of the batch's first 1024 hashes (a stored prefix).
Then the array table's Store broken into its parts (min over rounds of each part).

--check: a randomized sequence of store / commit / rollback / load / unpin / lease / evict / lookup
against a plain model (dict of records + the core's own ChainLRU for the order); after every step
the two must agree (states, pins, leases, reuse, checksums, the whole LRU order) and audit() must
find nothing. No timing thresholds.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import random
import sys
import tempfile
import time
from collections import deque
from dataclasses import replace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HASH = np.dtype("V32")  # one 32-byte hash; .tolist() gives one bytes object each (trailing zeros kept)

# row states
FREE, RESERVED, READY = 0, 1, 2
# tier codes (kvservice.core.types.Tier) and disk states (kvservice.placement.index.DiskState)
T_HOST, T_DISK = 2, 3
D_NONE, D_ON_DISK = 0, 2
# store statuses, one per hash
S_RESERVED = 1  # new: a row and a slot are reserved (commit or rollback follows)
S_ALREADY = 2  # stored and ready: touched
S_PENDING = 3  # reserved by another Store not yet committed (the core waits for its outcome)
S_DUP = 4  # the same hash earlier in this batch (answered as that one)
S_NO_ROOM = 5  # the tier could not make room (pins, leases): NOT_STORED
# load statuses
L_HIT, L_MISSING = 1, 2


class AuditError(AssertionError):
    pass


class ArrayBlockTable:
    """One namespace's host tier as columns. Rows: index entries; slots: byte offsets in the arena.
    `rows` must exceed `slots` by the largest batch (a Store takes rows for all its new hashes
    before it makes room, so that one dict write per hash detects duplicates and reserves at once).

    LRU: a global stamp counter. Touching a chain (head first) gives it fresh stamps, head newest,
    as ChainLRU.touch does (its tail is evicted first). Victims: the smallest stamps among READY,
    unpinned, unleased rows (np.argpartition over the candidates)."""

    def __init__(self, slots: int, block_bytes: int, rows: int | None = None, key_column: bool = True) -> None:
        R = rows if rows is not None else 2 * slots
        assert R >= slots
        self.R, self.S, self.block_bytes = R, slots, block_bytes
        self.slot = np.full(R, -1, np.int64)
        self.state = np.zeros(R, np.uint8)
        self.disk = np.zeros(R, np.uint8)  # always D_NONE here; Lookup reads it as the core does
        self.pins = np.zeros(R, np.int32)
        self.lease_until = np.zeros(R, np.float64)
        self.deadline = np.zeros(R, np.float64)
        self.checksum = np.zeros(R, np.uint32)
        self.size = np.zeros(R, np.int32)
        self.reuse = np.zeros(R, np.int32)
        self.stamp = np.zeros(R, np.int64)
        self.hash = np.zeros(R, HASH)
        # key_column: an object column holding each live row's dict key (the bytes object the dict
        # holds, its hash cached): a victim's key is a gather, not a new bytes object from the hash
        # column that the dict must hash again (measured: ~100 vs ~170 ns a victim at 32768)
        self.key_column = key_column
        self.keys = np.empty(R, object)
        self.index: dict[bytes, int] = {}
        self.free_rows = np.arange(R - 1, -1, -1, dtype=np.int64)  # a stack: the top is free_rows[n_free_rows-1]
        self.n_free_rows = R
        self.free_slots = np.arange(slots - 1, -1, -1, dtype=np.int64) * block_bytes
        self.n_free_slots = slots
        self.clock = 0  # the LRU stamp counter
        self._mark = np.zeros(R, np.int64)  # scratch: duplicate rows in a batch (_has_dups)
        self.prof: dict[str, float] | None = None  # store()'s parts, seconds, when a dict
        self.last_victims: np.ndarray = np.zeros(0, np.int64)

    # --- helpers
    def _pop_rows(self, k: int) -> np.ndarray:
        top = self.n_free_rows
        assert k <= top, "out of rows: rows must exceed slots by the largest batch"
        self.n_free_rows = top - k
        return self.free_rows[top - k:top][::-1].copy()

    def _push_rows(self, rows: np.ndarray) -> None:
        top = self.n_free_rows
        self.free_rows[top:top + len(rows)] = rows
        self.n_free_rows = top + len(rows)

    def _pop_slots(self, k: int) -> np.ndarray:
        top = self.n_free_slots
        assert k <= top
        self.n_free_slots = top - k
        return self.free_slots[top - k:top][::-1].copy()

    def _push_slots(self, offsets: np.ndarray) -> None:
        top = self.n_free_slots
        self.free_slots[top:top + len(offsets)] = offsets
        self.n_free_slots = top + len(offsets)

    def _has_dups(self, rows: np.ndarray) -> bool:
        """A row twice in `rows`: scatter positions, gather them back (O(n), no sort)."""
        pos = np.arange(len(rows))
        self._mark[rows] = pos
        return bool((self._mark[rows] != pos).any())

    def _touch(self, rows: np.ndarray) -> None:
        """Fresh stamps, head (rows[0]) newest. A row twice gets its head-most occurrence's stamp
        (ChainLRU.touch: each occurrence moves it to the newest end, the head-most last): assigned
        reversed, the head-most write comes last (numpy's fancy assignment: the last write wins)."""
        n = len(rows)
        self.stamp[rows[::-1]] = np.arange(self.clock, self.clock + n, dtype=np.int64)
        self.clock += n

    def _rows_of(self, hs: list[bytes]) -> tuple[np.ndarray, list]:
        """Rows of hashes (-1: not indexed) and the raw probe list."""
        found = list(map(self.index.get, hs))
        if None in found:
            r = np.array([-1 if x is None else x for x in found], dtype=np.int64)
        else:
            r = np.fromiter(found, np.int64, len(found))
        return r, found

    # --- Lookup
    def lookup_prefix(self, packed: bytes) -> list[int]:
        """Tier code of each block of the stored prefix: stops at the first hash missing or not ready."""
        hs = np.frombuffer(packed, HASH).tolist()
        found = list(map(self.index.get, hs))
        if None in found:
            found = found[:found.index(None)]
        if not found:
            return []
        r = np.fromiter(found, np.int64, len(found))
        ready = self.state[r] == READY
        host = ready & (self.slot[r] >= 0)
        if host.all():
            return [T_HOST] * len(found)
        disk = ready & (self.disk[r] == D_ON_DISK)
        code = np.where(host, T_HOST, np.where(disk, T_DISK, 0))
        bad = np.flatnonzero(code == 0)
        return code[:bad[0] if len(bad) else len(code)].tolist()

    # --- Store
    def store(self, packed: bytes, now: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Reserve rows and slots for the new hashes of a chain (head first); touch the ones stored.
        Returns (status per hash, rows reserved, their positions in the batch), rows in chain order:
        commit(rows, checksums) or rollback(rows) follows."""
        prof = self.prof
        t0 = time.perf_counter()
        hv = np.frombuffer(packed, HASH)
        hs = hv.tolist()
        n = len(hs)
        t1 = time.perf_counter()
        index = self.index
        found = list(map(index.get, hs))
        nnew = found.count(None)
        t2 = time.perf_counter()
        status = np.empty(n, np.uint8)
        if nnew == n:  # the usual Store: all new, no per-block split
            pos = np.arange(n)
            new_hs = hs
        else:
            isnew = np.fromiter((x is None for x in found), dtype=bool, count=n)
            pos = np.flatnonzero(isnew)
            hit_pos = np.flatnonzero(~isnew)
            hit_rows = np.array([found[i] for i in hit_pos.tolist()], dtype=np.int64) if nnew else \
                np.array(found, dtype=np.int64)
            ready = self.state[hit_rows] == READY
            status[hit_pos] = np.where(ready, S_ALREADY, S_PENDING)
            if ready.any():
                self._touch(hit_rows[ready])  # resident ready hits (all of them here) are refreshed
            new_hs = [hs[i] for i in pos.tolist()]
        t3 = time.perf_counter()
        k = len(new_hs)
        rows = self._pop_rows(k)
        before = len(index)
        index.update(zip(new_hs, rows.tolist()))  # one write a new hash: its final row
        if len(index) - before < k:  # a hash twice in the batch: undo, keep each one's first place
            for h in new_hs:
                index.pop(h, None)
            self._push_rows(rows[::-1])
            first: dict[bytes, int] = {}
            for i in pos.tolist():
                first.setdefault(hs[i], i)
            keep = np.fromiter((first[hs[i]] == i for i in pos.tolist()), dtype=bool, count=len(pos))
            status[pos[~keep]] = S_DUP
            pos = pos[keep]
            new_hs = [hs[i] for i in pos.tolist()]
            k = len(new_hs)
            rows = self._pop_rows(k)
            index.update(zip(new_hs, rows.tolist()))
        self.state[rows] = RESERVED  # before the eviction: never a victim
        self.pins[rows] = 1
        t4 = time.perf_counter()
        # room: evict the oldest unpinned, unleased ready rows
        need = k - self.n_free_slots
        ta = tb = t4
        if need > 0:
            ta, tb = self._evict(need, now)
        t5 = time.perf_counter()
        fit = min(k, self.n_free_slots)
        if fit < k:  # head first: keep the prefix that fits, the rest leaves the index
            for h in new_hs[fit:]:
                del index[h]
            rest = rows[fit:]
            self.state[rest] = FREE
            self.pins[rest] = 0
            self._push_rows(rest[::-1])
            status[pos[fit:]] = S_NO_ROOM
            rows, pos = rows[:fit], pos[:fit]
        offsets = self._pop_slots(fit)
        if self.key_column:
            self.keys[rows] = new_hs if fit == len(new_hs) else new_hs[:fit]
        self.slot[rows] = offsets
        self.hash[rows] = hv[pos] if fit < n else hv
        self.size[rows] = self.block_bytes
        self.checksum[rows] = 0
        self.deadline[rows] = 0.0
        self.lease_until[rows] = 0.0
        self.reuse[rows] = 0
        self.disk[rows] = D_NONE
        status[pos] = S_RESERVED
        t6 = time.perf_counter()
        if prof is not None:
            for key, dt in (("hash split", t1 - t0), ("dict probe", t2 - t1), ("hits split/touch", t3 - t2),
                            ("dict insert (+ rows)", t4 - t3), ("eviction selection", ta - t4),
                            ("dict removal (+ free)", tb - ta), ("column writes (+ slots)", t6 - t5)):
                prof[key] = prof.get(key, 0.0) + dt
        return status, rows, pos

    def _evict(self, need: int, now: float) -> tuple[float, float]:
        """Up to `need` victims out: the oldest stamps among READY, unpinned, unleased rows. O(R):
        one mask over the columns, argpartition over the candidates' stamps. Returns the times the
        selection and the removal ended (for store's breakdown)."""
        cand = np.flatnonzero((self.state == READY) & (self.pins == 0) & (self.lease_until <= now))
        if len(cand) > need:
            cand = cand[np.argpartition(self.stamp[cand], need - 1)[:need]]
        ta = time.perf_counter()
        self.evict_rows(cand)
        return ta, time.perf_counter()

    def evict_rows(self, victims: np.ndarray) -> None:
        """Victims' hashes out of the dict, their rows and slots back on the stacks."""
        self.last_victims = victims
        if not len(victims):
            return
        index = self.index
        if self.key_column:
            deque(map(index.__delitem__, self.keys[victims].tolist()), maxlen=0)
            self.keys[victims] = None
        else:
            deque(map(index.__delitem__, self.hash[victims].tolist()), maxlen=0)
        self._push_slots(self.slot[victims])
        self.slot[victims] = -1
        self.state[victims] = FREE
        self._push_rows(victims)

    def evict(self, want: int, now: float) -> int:
        """Make `want` more slots free if the pins and leases allow (an admin-style eviction)."""
        need = want - self.n_free_slots
        if need <= 0:
            return 0
        self._evict(need, now)
        return len(self.last_victims)

    def commit(self, rows: np.ndarray, checksums: np.ndarray) -> None:
        """Reserved rows (chain order) -> READY, unpinned, in the LRU with the head newest."""
        assert (self.state[rows] == RESERVED).all(), "commit of a row not reserved"
        prof = self.prof
        t0 = time.perf_counter()
        self.state[rows] = READY
        self.pins[rows] = 0
        self.checksum[rows] = checksums
        self._touch(rows)
        if prof is not None:
            prof["commit (columns, stamps)"] = prof.get("commit (columns, stamps)", 0.0) + time.perf_counter() - t0

    def rollback(self, rows: np.ndarray) -> None:
        """A Store that did not commit: its rows still reserved leave the index, rows and slots freed."""
        rows = rows[self.state[rows] == RESERVED]
        if not len(rows):
            return
        deque(map(self.index.__delitem__, self.hash[rows].tolist()), maxlen=0)
        if self.key_column:
            self.keys[rows] = None
        self._push_slots(self.slot[rows])
        self.slot[rows] = -1
        self.state[rows] = FREE
        self.pins[rows] = 0
        self._push_rows(rows)

    # --- Load
    def load(self, packed: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Host hits of a Load, pinned (one pin an occurrence), reuse counted, touched as one chain.
        Returns (status per hash, rows of the hits, their slots), hits in request order."""
        hs = np.frombuffer(packed, HASH).tolist()
        r, _ = self._rows_of(hs)
        ok = r >= 0
        rr = np.where(ok, r, 0)
        ok &= (self.state[rr] == READY) & (self.slot[rr] >= 0)
        if ok.all():
            status = np.full(len(r), L_HIT, np.uint8)
            hits = r
        else:
            status = np.where(ok, L_HIT, L_MISSING).astype(np.uint8)
            hits = r[ok]
        if self._has_dups(hits):
            np.add.at(self.pins, hits, 1)
            np.add.at(self.reuse, hits, 1)
        else:
            self.pins[hits] += 1
            self.reuse[hits] += 1
        self._touch(hits)
        return status, hits, self.slot[hits]

    def unpin(self, rows: np.ndarray) -> None:
        if self._has_dups(rows):
            np.subtract.at(self.pins, rows, 1)
        else:
            self.pins[rows] -= 1

    def lease(self, rows: np.ndarray, until: float) -> None:
        """Prefetch-style lease: not a victim before `until` (a later lease replaces it)."""
        self.lease_until[rows] = until

    # --- invariants
    def audit(self) -> list[str]:
        p: list[str] = []
        live = self.state != FREE
        nlive = int(live.sum())
        used = self.S - self.n_free_slots
        with_slot = int((live & (self.slot >= 0)).sum())
        if used != with_slot:
            p.append(f"used slots {used} != reserved+ready rows with a slot {with_slot}")
        if int((self.state[live] == RESERVED).sum() + (self.state[live] == READY).sum()) != nlive:
            p.append("a live row in an unknown state")
        if len(self.index) != nlive:
            p.append(f"dict size {len(self.index)} != live rows {nlive}")
        if self.R - self.n_free_rows != nlive:
            p.append(f"rows taken {self.R - self.n_free_rows} != live rows {nlive}")
        free = ~live
        if (self.pins[free] != 0).any():
            p.append(f"{int((self.pins[free] != 0).sum())} free rows pinned")
        if (self.slot[free] >= 0).any():
            p.append("a free row holds a slot")
        if (self.pins < 0).any():
            p.append("negative pins")
        fr = self.free_rows[:self.n_free_rows]
        if len(np.unique(fr)) != len(fr) or live[fr].any():
            p.append("the free-row stack holds a live row or a row twice")
        fs = self.free_slots[:self.n_free_slots]
        taken = self.slot[live & (self.slot >= 0)]
        allslots = np.concatenate([fs, taken])
        if len(np.unique(allslots)) != len(allslots) or len(allslots) != self.S:
            p.append("slots lost or held twice")
        if len(allslots) and ((allslots % self.block_bytes) != 0).any():
            p.append("a slot off the block grid")
        rows = np.fromiter(self.index.values(), np.int64, len(self.index))
        if len(rows):
            if not live[rows].all():
                p.append("the dict maps a hash to a free row")
            keys = np.frombuffer(b"".join(self.index.keys()), HASH)
            if (self.hash[rows] != keys).any():
                p.append("a row's hash column differs from its dict key")
            if self.key_column and self.keys[rows].tolist() != list(self.index.keys()):
                p.append("a row's key column differs from its dict key")
        if self.key_column and (self.keys[free] != None).any():  # noqa: E711 - elementwise
            p.append("a free row keeps a key")
        return p

    def check(self) -> None:
        problems = self.audit()
        if problems:
            raise AuditError("ArrayBlockTable.audit: " + "; ".join(problems))

    def lru_order(self) -> list[bytes]:
        """Ready rows' hashes, oldest first (for --check)."""
        r = np.flatnonzero(self.state == READY)
        r = r[np.argsort(self.stamp[r], kind="stable")]
        return self.hash[r].tolist()


# --- the array table, timed
def fresh_batch(n: int) -> bytes:
    return os.urandom(32 * n)


def measure_array(batch: int, rounds: int, block_bytes: int,
                  key_column: bool = True) -> tuple[dict[str, float], dict[str, float]]:
    S = 3 * batch
    t = ArrayBlockTable(S, block_bytes, rows=S + batch, key_column=key_column)
    now = 1000.0
    zeros = np.zeros(batch, np.uint32)
    last = b""
    for _ in range(4):  # fill the tier (and one evicting Store)
        last = fresh_batch(batch)
        st, rows, _ = t.store(last, now)
        t.commit(rows, zeros)
    t.check()
    out: dict[str, float] = {}
    parts: dict[str, float] = {}

    def timed(name, make, call, check=None, walk=True):
        best = float("inf")
        for _ in range(rounds * (10 if name.startswith("lookup") else 1)):
            arg = make()
            t0 = time.perf_counter()
            res = call(arg)
            best = min(best, time.perf_counter() - t0)
            if check is not None:
                check(res)
            if walk:  # audit() walks every row and key: the next round starts cache-cold
                t.check()
        if not walk:
            t.check()
        out[name] = best

    def new():
        nonlocal last
        last = fresh_batch(batch)
        return last

    def store_commit(p):
        st, rows, _ = t.store(p, now)
        t.commit(rows, zeros)
        return st, rows

    def stored_all(res):
        st, rows = res
        assert (st == S_RESERVED).all() and len(rows) == batch, "a Store did not reserve its whole batch"
        assert len(t.last_victims) == batch, f"a Store evicted {len(t.last_victims)}, not a batch"

    timed("store", new, store_commit, stored_all)
    # the Store's parts: the same Store again, with its timers on (min of each part over the rounds)
    for _ in range(rounds):
        t.prof = {}
        store_commit(new())
        for k, v in t.prof.items():
            parts[k] = min(parts.get(k, float("inf")), v)
        t.prof = None
        t.check()

    def all_already(res):
        st, rows, _ = res
        assert (st == S_ALREADY).all() and not len(rows)

    timed("store_hit", lambda: last, lambda p: t.store(p, now), all_already)

    def load_unpin(p):
        st, rows, slots = t.load(p)
        t.unpin(rows)
        return st

    def all_hits(st):
        assert (st == L_HIT).all(), "a Load missed"

    timed("load", lambda: last, load_unpin, all_hits)
    head = last[:32 * 1024]

    def full(codes):
        assert codes == [T_HOST] * min(1024, batch), "a short Lookup"

    timed("lookup", lambda: head, t.lookup_prefix, full)
    timed("lookup_hot", lambda: head, t.lookup_prefix, full, walk=False)
    return out, parts


# --- the current core, the same calls
class InlineExecutor(concurrent.futures.Executor):
    """Runs a copy job at submit, on the loop's thread: the core's bookkeeping without a thread hop."""

    def submit(self, fn, /, *args, **kwargs):
        f: concurrent.futures.Future = concurrent.futures.Future()
        try:
            f.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting call
            f.set_exception(e)
        return f


async def measure_core(block_bytes: int, batch: int, rounds: int, tmp: str, inline: bool) -> dict[str, float]:
    """bench/core_overhead.py's setup and calls with no-op copies (host tier of 3 batches, no disk)."""
    from kvservice.core.cache import BlockCache
    from kvservice.core.clock import FakeClock
    from kvservice.ops.config import Config
    from tests.corekit import CANARY, Pool, h, ns_spec

    cfg = replace(Config(), socket_path=os.path.join(tmp, "kv.sock"), host_capacity_bytes=3 * batch * block_bytes,
                  disk_path="", disk_capacity_bytes=0, max_batch_blocks=max(8192, batch), io_backend="posix",
                  prefetch_share=1.0, prefetch_total_share=1.0, pin_lease_seconds=1.0, lease_seconds=1e9)
    cache = BlockCache(cfg, FakeClock())
    await cache.start()
    pool = Pool(num_blocks=batch, block_bytes=block_bytes)
    sid = cache.open_session(ns_spec(f"probe-{block_bytes}-{batch}-{inline}"), pool.spec, CANARY, "probe").session_id
    mem = cache._sessions.get(sid).memory
    mem.gather_into = lambda block_ids, arena, offsets: [0] * len(block_ids)
    mem.scatter_from = lambda block_ids, arena, offsets: None
    real_pool = cache._copy_pool
    if inline:
        cache._copy_pool = InlineExecutor()
    ids = list(range(batch))
    seq = [0]
    last = [b""]

    def new() -> bytes:
        seq[0] += 1
        last[0] = b"".join(h(i, f"{inline}/{seq[0]}") for i in range(batch))
        return last[0]

    out: dict[str, float] = {}

    async def timed(name, make, call, check, walk=True):
        best = float("inf")
        for _ in range(rounds * (10 if name.startswith("lookup") else 1)):
            arg = make()
            t0 = time.perf_counter()
            res = await call(arg)
            best = min(best, time.perf_counter() - t0)
            check(res)
            if walk:  # as the array side's audit(): the same cache-cold start for the next round
                problems = cache.audit()
                assert not problems, problems
        out[name] = best

    def all_ok(code):
        def check(res):
            bad = [s for s in res.status if s != code]
            assert not bad, f"{len(bad)} blocks not {code}"
        return check

    for _ in range(4):
        await cache.store(sid, new(), ids)
    await timed("store", new, lambda hs: cache.store(sid, hs, ids), all_ok(1))
    await timed("store_hit", lambda: last[0], lambda hs: cache.store(sid, hs, ids), all_ok(2))
    await timed("load", lambda: last[0], lambda hs: cache.load(sid, hs, ids), all_ok(1))
    head = last[0][:32 * 1024]

    async def lookup(hs):
        return cache.lookup(sid, hs)

    def full(codes):
        assert len(codes) == min(1024, batch)

    await timed("lookup", lambda: head, lookup, full)
    await timed("lookup_hot", lambda: head, lookup, full, walk=False)
    problems = cache.audit()
    assert not problems, problems
    cache._copy_pool = real_pool
    await cache.close_session(sid)
    await cache.drain_and_stop()
    pool.close()
    return out


# --- --check: the table against a plain model
class Model:
    """A dict of records and the core's own ChainLRU (keyed by hash) over the ready blocks."""

    def __init__(self, slots: int) -> None:
        from kvservice.placement.lru import ChainLRU
        self.S = slots
        self.rec: dict[bytes, dict] = {}
        self.lru = ChainLRU()

    def used(self) -> int:
        return len(self.rec)

    def store(self, hs: list[bytes], now: float) -> tuple[list[int], list[bytes], set[bytes]]:
        status = [0] * len(hs)
        new_pos, hits, seen = [], [], set()
        for i, h in enumerate(hs):
            r = self.rec.get(h)
            if r is not None:
                status[i] = S_ALREADY if r["state"] == READY else S_PENDING
                if r["state"] == READY:
                    hits.append(h)
            elif h in seen:
                status[i] = S_DUP
            else:
                seen.add(h)
                new_pos.append(i)
        if hits:
            self.lru.touch_present(hits)
        k = len(new_pos)
        victims = self._evict(k - (self.S - self.used()), now)
        fit = min(k, self.S - self.used())
        for j, i in enumerate(new_pos):
            if j < fit:
                self.rec[hs[i]] = dict(state=RESERVED, pins=1, lease=0.0, reuse=0, checksum=0)
                status[i] = S_RESERVED
            else:
                status[i] = S_NO_ROOM
        return status, [hs[i] for i in new_pos[:fit]], victims

    def _evict(self, need: int, now: float) -> set[bytes]:
        out: list[bytes] = []
        if need > 0:
            for h in self.lru.oldest_first():
                r = self.rec[h]
                if r["pins"] == 0 and r["lease"] <= now:
                    out.append(h)
                    if len(out) == need:
                        break
        for h in out:
            self.lru.discard(h)
            del self.rec[h]
        return set(out)

    def evict(self, want: int, now: float) -> set[bytes]:
        return self._evict(want - (self.S - self.used()), now)

    def commit(self, hs: list[bytes], sums: list[int]) -> None:
        for h, c in zip(hs, sums):
            r = self.rec[h]
            r.update(state=READY, pins=0, checksum=c)
        self.lru.add_new(hs)

    def rollback(self, hs: list[bytes]) -> None:
        for h in hs:
            r = self.rec.get(h)
            if r is not None and r["state"] == RESERVED:
                del self.rec[h]

    def load(self, hs: list[bytes]) -> tuple[list[int], list[bytes]]:
        status, hits = [], []
        for h in hs:
            r = self.rec.get(h)
            if r is not None and r["state"] == READY:
                status.append(L_HIT)
                hits.append(h)
                r["pins"] += 1
                r["reuse"] += 1
            else:
                status.append(L_MISSING)
        self.lru.touch_present(hits)
        return status, hits

    def unpin(self, hs: list[bytes]) -> None:
        for h in hs:
            self.rec[h]["pins"] -= 1

    def lease(self, hs: list[bytes], until: float) -> None:
        for h in hs:
            self.rec[h]["lease"] = until

    def lookup(self, hs: list[bytes]) -> list[int]:
        out = []
        for h in hs:
            r = self.rec.get(h)
            if r is None or r["state"] != READY:
                break
            out.append(T_HOST)
        return out


def compare(t: ArrayBlockTable, m: Model, step: int, what: str) -> None:
    def fail(msg: str) -> None:
        raise AuditError(f"step {step} ({what}): {msg}")

    t.check()
    if set(t.index) != set(m.rec):
        fail(f"indexed hashes differ: {len(set(t.index) ^ set(m.rec))} not in both")
    for h, r in m.rec.items():
        row = t.index[h]
        got = dict(state=int(t.state[row]), pins=int(t.pins[row]), lease=float(t.lease_until[row]),
                   reuse=int(t.reuse[row]), checksum=int(t.checksum[row]))
        if got != r:
            fail(f"{h.hex()[:12]}: table {got} != model {r}")
    if t.lru_order() != list(m.lru.values()):
        fail("LRU order differs")


def run_check(steps: int, seed: int, key_column: bool) -> None:
    rng = random.Random(seed)
    universe = [os.urandom(32) for _ in range(48)]
    S, max_batch = 16, 10
    t = ArrayBlockTable(S, 4096, rows=S + max_batch, key_column=key_column)
    m = Model(S)
    now = 0.0
    open_stores: list[tuple[np.ndarray, list[bytes]]] = []  # (rows, hashes) reserved, not committed
    pinned: list[tuple[np.ndarray, list[bytes]]] = []
    counts: dict[str, int] = {}
    seen: dict = {}  # store statuses and victims met, to show the sequence reached them
    for step in range(steps):
        op = rng.choices(["store", "commit", "rollback", "load", "unpin", "lease", "evict", "lookup", "time"],
                         weights=[6, 6, 2, 4, 8, 1, 1, 2, 1])[0]
        if op == "store":
            n = rng.randint(1, max_batch)
            base = rng.randrange(len(universe))
            hs = [universe[(base + j) % len(universe)] for j in range(n)]
            if rng.random() < 0.2:  # a hash twice in the batch
                hs[rng.randrange(n)] = hs[rng.randrange(n)]
            st, rows, pos = t.store(b"".join(hs), now)
            mst, mnew, mvict = m.store(hs, now)
            if st.tolist() != mst:
                raise AuditError(f"step {step} store: status {st.tolist()} != model {mst}")
            if set(t.hash[t.last_victims].tolist()) != mvict and (len(t.last_victims) or mvict):
                raise AuditError(f"step {step} store: victims differ")
            t.last_victims = np.zeros(0, np.int64)
            if [hs[i] for i in pos.tolist()] != mnew:
                raise AuditError(f"step {step} store: reserved hashes differ")
            for x in mst:
                seen[x] = seen.get(x, 0) + 1
            seen["victims"] = seen.get("victims", 0) + len(mvict)
            if len(rows):
                open_stores.append((rows, mnew))
        elif op in ("commit", "rollback") and open_stores:
            rows, hs = open_stores.pop(rng.randrange(len(open_stores)))
            if op == "commit":
                sums = [rng.randrange(1 << 32) for _ in hs]
                t.commit(rows, np.array(sums, np.uint32))
                m.commit(hs, sums)
            else:
                t.rollback(rows)
                m.rollback(hs)
        elif op == "load":
            hs = [rng.choice(universe) for _ in range(rng.randint(1, 6))]
            st, rows, slots = t.load(b"".join(hs))
            mst, mhits = m.load(hs)
            if st.tolist() != mst:
                raise AuditError(f"step {step} load: status {st.tolist()} != model {mst}")
            if len(slots) and ((slots < 0).any() or (t.slot[rows] != slots).any()):
                raise AuditError(f"step {step} load: bad slots")
            if len(rows):
                pinned.append((rows, mhits))
        elif op == "unpin" and pinned:
            rows, hs = pinned.pop(rng.randrange(len(pinned)))
            t.unpin(rows)
            m.unpin(hs)
        elif op == "lease":
            ready = [h for h, r in m.rec.items() if r["state"] == READY]
            if ready:
                hs = rng.sample(ready, rng.randint(1, min(4, len(ready))))
                until = now + rng.choice([0.5, 1.0, 3.0])
                t.lease(np.array([t.index[h] for h in hs], np.int64), until)
                m.lease(hs, until)
        elif op == "evict":
            want = rng.randint(1, S)
            t.evict(want, now)
            mvict = m.evict(want, now)
            if set(t.hash[t.last_victims].tolist()) != mvict and (len(t.last_victims) or mvict):
                raise AuditError(f"step {step} evict: victims differ")
            t.last_victims = np.zeros(0, np.int64)
        elif op == "lookup":
            base = rng.randrange(len(universe))
            hs = [universe[(base + j) % len(universe)] for j in range(rng.randint(1, 8))]
            got, want_ = t.lookup_prefix(b"".join(hs)), m.lookup(hs)
            if got != want_:
                raise AuditError(f"step {step} lookup: {got} != model {want_}")
        elif op == "time":
            now += rng.choice([0.25, 1.0])
        else:
            continue
        counts[op] = counts.get(op, 0) + 1
        compare(t, m, step, op)
    print(f"--check (key column {'on' if key_column else 'off'}): {steps} steps, seed {seed}: the table and the model agree after every step "
          f"({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))})")
    names = {S_RESERVED: "reserved", S_ALREADY: "already", S_PENDING: "pending", S_DUP: "dup", S_NO_ROOM: "no room"}
    print("store statuses met: " + ", ".join(f"{names.get(k, k)} {v}" for k, v in seen.items()))
    for k in (S_PENDING, S_DUP, S_NO_ROOM, "victims"):
        assert seen.get(k), f"the sequence never met {names.get(k, k)}: change --steps or --seed"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="4096,32768")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--block-bytes", type=int, default=65536)
    p.add_argument("--check", action="store_true", help="the randomized model check instead of the timings")
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    if a.check:
        run_check(a.steps, a.seed, key_column=True)
        run_check(a.steps, a.seed, key_column=False)
        return
    assert a.rounds >= 5, "best of >= 5 rounds"
    from kvservice.core.cache import _tune_gc
    _tune_gc()  # the daemon's GC thresholds (BlockCache.start sets them) for the array table too
    batches = [int(x) for x in a.batches.split(",")]
    print(f"us per block, best of {a.rounds} rounds; {a.block_bytes // 1024} KiB blocks, host tier of 3 batches; "
          f"Python {sys.version.split()[0]}, numpy {np.__version__}")
    print("current: BlockCache with no-op copies (thread: copy jobs through its thread pool, as core_overhead.py; "
          "inline: run at submit on the loop's thread); array: ArrayBlockTable; ratio: current inline / array")
    print()
    print("| operation | batch | current (thread) | current (inline) | array | ratio |")
    print("|---|---|---|---|---|---|")
    all_parts = {}
    arr_store = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in batches:
            # the array table first: the core's runs leave its multi-GiB arena being unmapped behind them
            arr, parts = measure_array(n, a.rounds, a.block_bytes)
            arr_v32, parts_v32 = measure_array(n, a.rounds, a.block_bytes, key_column=False)
            all_parts[n] = (parts, parts_v32, arr_v32)
            cur = asyncio.run(measure_core(a.block_bytes, n, a.rounds, tmp, inline=False))
            inl = asyncio.run(measure_core(a.block_bytes, n, a.rounds, tmp, inline=True))
            arr_store[n] = arr["store"]
            for op, label, per in (("store", "Store, new (evicts a batch)", n), ("store_hit", "Store, already stored", n),
                                   ("load", "Load host hits + unpin", n),
                                   ("lookup", "Lookup 1024 (after an audit walk)", min(1024, n)),
                                   ("lookup_hot", "Lookup 1024 (repeated, cache-hot)", min(1024, n))):
                c, i, r = (x[op] / per * 1e6 for x in (cur, inl, arr))
                print(f"| {label} | {n} | {c:.3f} | {i:.3f} | {r:.3f} | {i / r:.1f}x |", flush=True)
    print()
    print("The array table's Store (store + commit), its parts: us per block, min over rounds of each part;")
    print("victims' keys from the object key column (the table above) / from the V32 hash column")
    print()
    names = list(all_parts[batches[0]][0])
    print("| part | " + " | ".join(f"batch {n}, key column | batch {n}, V32 column" for n in batches) + " |")
    print("|---|" + "---|---|" * len(batches))
    for k in names:
        print(f"| {k} | " + " | ".join(f"{all_parts[n][0][k] / n * 1e6:.3f} | {all_parts[n][1][k] / n * 1e6:.3f}"
                                       for n in batches) + " |")
    print("| sum of parts | " + " | ".join(f"{sum(all_parts[n][0].values()) / n * 1e6:.3f} | "
                                         f"{sum(all_parts[n][1].values()) / n * 1e6:.3f}" for n in batches) + " |")
    print("| Store, timed whole (table above) | " + " | ".join(
        f"{arr_store[n] / n * 1e6:.3f} | {all_parts[n][2]['store'] / n * 1e6:.3f}" for n in batches) + " |")


if __name__ == "__main__":
    main()
