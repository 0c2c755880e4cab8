"""Scheduler: which requests run, which wait for their KV, and the GPU tier's block bookkeeping.

Everything here runs on the engine's loop thread and never waits on a Store, Load or Prefetch: they
go out as futures (KVClient.submit_*). The Lookup of a request is sent when it is enqueued, so its
round trip overlaps the model step in progress and the queueing; admission reads the answer, waits
for it at most LOOKUP_BLOCK_S on the spot (a round trip is a millisecond or two; running a model step
without the request would delay it by the whole step), and beyond that only while waiting still
costs less than a fraction of the prefill a hit could save (lookup_deadline): a slow answer never
costs a miss more than that.
Per loop iteration the engine calls:

  enqueue(seq)    hash the prompt; send the Lookup of the blocks past the GPU tier's hit
  reclaim()       evicted blocks whose offload landed become free; finished stores drop their refs
  admit()         waiting -> parked or running, in arrival order, up to max_running:
                  GPU radix hit -> the Lookup's answer for the rest -> load or recompute (CostModel)
                  -> allocate (evict LRU leaves, offload them before reuse) -> submit_load, park
  prefetch()      for the first N still-waiting requests whose Lookup found blocks on disk, once each: a
                  prefetcher.py job over the stored prefix (its host part leased, its disk part staged)
                  head first in chunks, off the loop thread (a Lookup's
                  answer starts one itself while fewer than N are staging: no wait for the model step);
                  at admission the job's staged prefix counts as host-resident (laid over the Lookup, which
                  a stale answer asks again), so the request loads that from host memory and recomputes
                  its disk blocks past it (no disk read on the path of a prefetched request); the
                  jobs' disk read rate feeds the cost model's disk estimate (no disk load needed to learn it)
  poll_parked()   parked -> running once the Load finished; recompute from the first block not loaded
  join_landing()  before a step with a long prefill, wait (briefly) for a parked Load expected to land
                  within LOAD_JOIN_S, so that its request joins this step instead of the next
and, around the model step, prefilled(seq) and finish(seq): full blocks into the radix tree,
write-through Store (with the request's TTL), references and blocks released.

A request reserves blocks for its whole budget (prompt + max_tokens) at admission, so a running
request never waits for memory and nothing needs preempting. With max_prefill_tokens, one iteration
admits requests until that many prompt tokens are to be computed (at least one request): the rest
stay queued -- prefetchable -- instead of waiting inside one long step of back-to-back prefills.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any

from engine_client.client import UNREACHABLE
from engine_client.errors import KVClientError
from engine_client.hashing import BlockHasher
from engine_client.results import LoadResults, StoreResults
from engine_client.sync_client import KVClient
from kvwire.ids import BlockHash
from kvwire.v1 import kvcache_pb2
from model_runner.allocator import BlockAllocator
from model_runner.config import EngineConfig
from model_runner.cost_model import CostModel
from model_runner.metrics import EngineMetrics
from model_runner.prefetcher import Prefetcher, refusal_reason
from model_runner.radix import BlockId, Node, RadixCache
from model_runner.requests import PendingLoad, Phase, Seq

log = logging.getLogger(__name__)

TIER_NAMES = {kvcache_pb2.TIER_HOST: "host", kvcache_pb2.TIER_DISK: "disk"}
LOAD_POLICIES = ("auto", "always", "never")
LOOKUP_PATIENCE_S = 1.0  # a Lookup unanswered this long counts as a miss: the request recomputes
LOOKUP_PATIENCE_SHARE = 0.05  # ... or unanswered for this share of the prefill it could save, if less
# (a miss pays at most 5% of its prefill for asking, whatever the daemon is busy with),
LOOKUP_PATIENCE_MIN_S = 0.05  # but never less than this: a busy daemon's normal answer is not a miss
LOOKUP_BLOCK_S = 0.025  # the loop waits this long at most for the head's Lookup before it runs a step
LOOKUP_REFRESH_S = 0.05  # a partial answer older than this, for a request that queued, is asked again
LOOKUP_PATIENCE_ALWAYS_S = 10.0  # load_policy "always" asked for loads: wait for the answer, however busy the host
LOAD_JOIN_S = 0.1  # a parked Load expected to land this soon is waited for before a step with a longer prefill


class Scheduler:
    def __init__(self, cfg: EngineConfig, *, client: KVClient | None, hasher: BlockHasher, block_bytes: int,
                 flops: Callable[[int, int], float], metrics: EngineMetrics,
                 before_store: Callable[[], None] = lambda: None, wake: Callable[[], None] = lambda: None) -> None:
        """before_store: called before every Store, to order the engine's writes to the pool before the
        daemon's copy (CudaKVPool.record_ready); wake: nudges the loop (called from KVClient's thread)."""
        if cfg.load_policy not in LOAD_POLICIES:
            raise ValueError(f"load_policy {cfg.load_policy!r} is not one of {LOAD_POLICIES}")
        self.cfg = cfg
        self.tpb = cfg.tokens_per_block
        self.client = client
        self.hasher = hasher
        self.block_bytes = block_bytes
        self.metrics = metrics
        self.before_store = before_store
        self.wake = wake
        self.radix = RadixCache()
        self.alloc = BlockAllocator(cfg.num_gpu_blocks)
        self.cost = CostModel(flops)
        self.waiting: deque[Seq] = deque()
        self.parked: list[Seq] = []
        self.running: list[Seq] = []
        self._stores: list[tuple[concurrent.futures.Future[Any], list[Node]]] = []  # write-through in flight
        # Hashes of cached blocks the daemon has (written through, or loaded from it): evicting one frees
        # its block at once, with no offload Store (a second copy of bytes the daemon has) holding the
        # block until it returns.
        self._in_service: set[BlockHash] = set()
        self.prefetcher: Prefetcher | None = None
        self._prefetch_lock = threading.Lock()  # prefetch decisions: the loop's and Lookup callbacks'
        self._staging: deque[tuple[int, float]] = deque()  # (blocks, seconds) of prefetch jobs' disk reads
        if client is not None:
            self.prefetcher = Prefetcher(client, on_statuses=self._count_prefetched, on_chunk=wake,
                                         on_rate=lambda blocks, seconds: self._staging.append((blocks, seconds)),
                                         on_stop=self._prefetch_stopped)

    # --- sizes
    def blocks_needed(self, prompt_len: int, max_tokens: int) -> int:
        """Blocks for every position that gets KV: the prompt and all output tokens but the last."""
        return -(-(prompt_len + max_tokens - 1) // self.tpb)

    # --- per iteration
    def enqueue(self, seq: Seq) -> None:
        seq.prompt_hashes = self.hasher.hash_blocks(seq.tokens[: seq.prompt_len])
        self._send_lookup(seq)
        self.waiting.append(seq)

    def _send_lookup(self, seq: Seq) -> None:
        client = self.client
        if client is None or self.cfg.load_policy == "never" or not client.attached:
            return
        hashes = seq.prompt_hashes[: self._usable_blocks(seq)]
        start = self.radix.peek(hashes)
        if start >= len(hashes):
            return
        try:
            seq.lookup = fut = client.submit_lookup(hashes[start:])
        except KVClientError as err:
            log.warning("lookup not sent: %s", err)
            return
        seq.lookup_from = start
        seq.lookup_sent = sent = time.monotonic()

        def answered(f: concurrent.futures.Future[Any]) -> None:  # on the KVClient's thread
            self.metrics.lookup_seconds.observe(time.monotonic() - sent)
            if self.prefetcher is not None and 0 < self.cfg.prefetch_reqs and seq.phase is Phase.WAITING:
                # Stage its disk blocks now, not at the loop's next iteration (after the model step in
                # progress, when the request may already be admitted), while fewer than prefetch_reqs
                # requests are being prefetched; the loop's prefetch() takes the others as they come up.
                with self._prefetch_lock:
                    if self.prefetcher.pending() < self.cfg.prefetch_reqs:
                        self._start_prefetch(seq, f)
            self.wake()

        fut.add_done_callback(answered)

    def _refresh_stale_lookup(self, seq: Seq, min_age: float = LOOKUP_REFRESH_S) -> bool:
        """A request that queued behind others may find blocks stored since its enqueue-time Lookup
        (another engine's, or its own offloads, or staged by its prefetch): ask once more, overlapped
        with the running batch. True when a new Lookup is in flight."""
        fut = seq.lookup
        if fut is None or not fut.done() or fut.cancelled() or fut.exception() is not None:
            return False
        if seq.lookup_refreshed:
            return False  # once
        # Also with a prefetch job: its staged count (laid over the new answer in _stored) says what it moved
        # to host memory, not where the rest of the chain is now; a plan from an enqueue-time answer reads
        # from disk, on the request's path, blocks that other requests pushed out of the host tier meanwhile.
        if time.monotonic() - seq.lookup_sent < min_age:
            return False
        stored, _ = fut.result()
        if seq.lookup_from + stored >= self._usable_blocks(seq):
            return False  # the answer covers the whole prompt
        seq.lookup_refreshed = True
        old_from = seq.lookup_from
        self._send_lookup(seq)
        if seq.lookup is fut or seq.lookup is None:
            return False
        seq.lookup_prev = (fut, old_from)  # the answer to fall back on if the new one is late
        return True

    def reclaim(self) -> None:
        self.alloc.reclaim()
        if self._stores:
            pending = []
            for fut, nodes in self._stores:
                if fut.done():
                    self.radix.release(nodes)
                else:
                    pending.append((fut, nodes))
            self._stores = pending

    def admit(self) -> None:
        while self._staging:  # prefetch jobs' disk read rates (appended on the prefetch thread)
            blocks, seconds = self._staging.popleft()
            self.cost.observe_staged(kvcache_pb2.TIER_DISK, kvcache_pb2.TIER_HOST, blocks, self.block_bytes, seconds)
        budget = self.cfg.max_prefill_tokens
        planned = 0
        while self.waiting and len(self.running) + len(self.parked) < self.cfg.max_running:
            if budget and planned >= budget:
                break  # this step's prefill work is full: the rest stays queued (and prefetchable)
            seq = self.waiting[0]
            if not self._admit(seq):
                break  # in order: the head waits for blocks, the rest waits behind it
            self.waiting.popleft()
            self._end_prefetch(seq)
            planned += seq.planned_prefill
        if self.waiting:
            # The head waits for this step: ask its Lookup again now, so that the answer lands during
            # the step and its admission after it need not wait for a round trip.
            self._refresh_stale_lookup(self.waiting[0], min_age=0.0)

    def prefetch(self) -> None:
        n = self.cfg.prefetch_reqs
        client = self.client
        if n <= 0 or client is None or self.cfg.load_policy == "never" or not client.attached:
            return
        for seq in itertools.islice(self.waiting, n):
            fut = seq.lookup
            if seq.prefetched or fut is None or not fut.done():
                continue  # an unanswered Lookup: decided on a later iteration
            with self._prefetch_lock:
                self._start_prefetch(seq, fut)

    def _start_prefetch(self, seq: Seq, fut: concurrent.futures.Future[Any]) -> None:
        """Once per request, under _prefetch_lock (loop thread or a Lookup's callback): a prefetcher job
        for what its Lookup found, when some of it is on disk."""
        if seq.prefetched or fut is not seq.lookup:
            return  # decided already, or a newer Lookup replaced this one
        seq.prefetched = True
        if fut.cancelled() or fut.exception() is not None:
            return
        stored, tiers = fut.result()
        first_disk = next((i for i, t in enumerate(tiers[:stored]) if t == kvcache_pb2.TIER_DISK), None)
        if first_disk is None:
            return  # nothing on disk (or nothing at all): a Prefetch would be a wasted round trip
        # The whole stored prefix, head first, for as long as the request is queued: the part already in
        # host memory is answered ALREADY_IN_HOST and leased (no read), so it stays there while the request
        # queues -- unleased, a host tier churned by other requests' loads evicted it, and the Load, planned
        # from a Lookup seconds old, read it from disk (H200 v4 disk setting: 900+-block disk reads on the
        # critical path). A job over host blocks only would be a wasted round trip.
        lo = seq.lookup_from
        assert self.prefetcher is not None
        seq.prefetch_from = lo
        seq.prefetch_job = self.prefetcher.submit(seq.prompt_hashes[lo: seq.lookup_from + stored],
                                                  wanted=lambda: seq.phase is Phase.WAITING)
        self.metrics.prefetches.inc()

    def poll_parked(self) -> None:
        for seq in [s for s in self.parked if s.load is not None and s.load.future.done()]:
            self.parked.remove(seq)
            load, seq.load = seq.load, None
            assert load is not None
            try:
                res = load.future.result()
                # the reply's arrays, not a LoadResult object per block (the loop thread's time)
                statuses, tiers = ((res.statuses, res.tiers) if isinstance(res, LoadResults)
                                   else ([r.status for r in res], [r.tier for r in res]))
            except Exception as err:  # noqa: BLE001  # a refused load is a miss: recompute
                log.warning("load for %s failed: %s", seq.req.request_id, err)
                res, statuses, tiers = None, [], []
            ok = next((i for i, st in enumerate(statuses) if st != kvcache_pb2.LOADED), len(statuses))
            for t, n in Counter(tiers[:ok]).items():
                tier = TIER_NAMES.get(t, "host")
                seq.cached_by_tier[tier] += n * self.tpb
                self.metrics.loaded_blocks.labels(tier).inc(n)
            asked = len(load.tiers)
            if ok == asked:
                seq.kv_source = "loaded"
                seconds = (load.t_done or time.monotonic()) - load.t_start
                self.cost.observe_load(tiers, self.block_bytes, seconds)
                for tier, bw in self.cost.bandwidth.items():
                    self.metrics.load_bandwidth.labels(TIER_NAMES.get(tier, str(tier))).set(bw)
            else:
                down = not statuses or any(res[i].message == UNREACHABLE for i in range(ok, len(statuses)))
                seq.kv_source = "recomputed:service-down" if down else "recomputed:load-failed"
                self.metrics.load_failures.inc(asked - ok)
            if ok:
                self._in_service.update(seq.prompt_hashes[seq.reused_blocks: seq.reused_blocks + ok])
            seq.reused_blocks += ok
            if ok:
                self._insert(seq, seq.prompt_hashes[: seq.reused_blocks])
            self._run(seq)

    def join_landing(self) -> None:
        """Before a step: a parked request whose Load lands within LOAD_JOIN_S (and well within the
        step's prefill time) is waited for, so that it runs in this step rather than after it -- a
        20 ms host load must not cost its request a whole 0.6 s step of another request's prefill."""
        tps = self.cost.tokens_per_s
        if not self.parked or not tps:
            return
        step_s = sum(s.prompt_len - s.n_cached for s in self.running) / tps
        bound = min(LOAD_JOIN_S, step_s / 2)
        now = time.monotonic()
        soon = [s.load.future for s in self.parked if s.load is not None and s.load.t_expect
                and not s.load.future.done() and s.load.t_expect - now <= bound]
        if soon:
            concurrent.futures.wait(soon, timeout=bound)
        if soon or any(s.load is not None and s.load.future.done() for s in self.parked):
            self.poll_parked()

    # --- around the model step
    def prefilled(self, seq: Seq, n_tokens: int, ctx: int, seconds: float) -> None:
        """The prompt's KV is complete: cache its full blocks and write them through."""
        self.cost.observe_prefill(n_tokens, ctx, seconds)
        if self.cost.tokens_per_s is not None:
            self.metrics.prefill_rate.set(self.cost.tokens_per_s)
        self.metrics.prefill_tokens.inc(n_tokens)
        self._commit(seq, seq.prompt_hashes[: seq.prompt_len // self.tpb], "prefill")

    def finish(self, seq: Seq) -> None:
        """Cache the full blocks of prompt + output, write them through, drop references and blocks."""
        full = seq.n_cached // self.tpb
        hashes = seq.prompt_hashes[:full]
        if full > len(hashes):
            parent = hashes[-1] if hashes else None
            start = len(hashes) * self.tpb
            hashes = hashes + self.hasher.hash_blocks(seq.tokens[start: full * self.tpb], parent)
        self._commit(seq, hashes, "finish")
        self.drop(seq)

    def drop(self, seq: Seq) -> None:
        """Forget a request in any phase, releasing what it holds."""
        for queue in (self.running, self.parked):
            if seq in queue:
                queue.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._end_prefetch(seq)
        self.radix.release(seq.held)
        if seq.load is not None and not seq.load.future.done():
            self.alloc.hold(sorted(seq.private), seq.load.future)  # the daemon may still write into them
        else:
            self.alloc.free(seq.private)
        seq.held, seq.private, seq.load = [], set(), None
        seq.phase = Phase.DONE

    def pending_stores(self) -> list[concurrent.futures.Future[Any]]:
        """Write-through and offload stores in flight."""
        return [f for f, _ in self._stores] + self.alloc.held_until()

    def close(self) -> None:
        """Stop prefetching (before the client closes)."""
        if self.prefetcher is not None:
            self.prefetcher.close()

    def _end_prefetch(self, seq: Seq) -> None:
        """The request left the queue: what its prefetch staged so far is loaded from host memory, the
        rest is no longer staged (its Load, or its prefill, would race the reads)."""
        if seq.prefetch_job is not None:
            seq.prefetch_job.cancel()

    # --- internals: admission
    def _usable_blocks(self, seq: Seq) -> int:
        # At least the last prompt token is computed: its logits give the first output token.
        return (seq.prompt_len - 1) // self.tpb

    def lookup_deadline(self, seq: Seq) -> float:
        """When admission stops waiting for seq's Lookup and counts it as a miss (monotonic seconds)."""
        start = max(seq.t_submit, seq.lookup_sent)
        if self.cfg.load_policy == "always":
            return start + LOOKUP_PATIENCE_ALWAYS_S
        patience = LOOKUP_PATIENCE_S
        tps = self.cost.tokens_per_s
        if tps:
            saved = (self._usable_blocks(seq) - seq.lookup_from) * self.tpb
            patience = min(patience, max(LOOKUP_PATIENCE_MIN_S, LOOKUP_PATIENCE_SHARE * saved / tps))
        return start + patience

    def next_deadline(self) -> float | None:
        """The earliest lookup_deadline of a waiting request whose Lookup is unanswered (the loop's wake-up)."""
        if self.waiting and self.waiting[0].lookup is not None and not self.waiting[0].lookup.done():
            return self.lookup_deadline(self.waiting[0])
        return None

    def _admit(self, seq: Seq) -> bool:
        self._refresh_stale_lookup(seq)
        if seq.lookup is not None and not seq.lookup.done():
            now = time.monotonic()
            seq.lookup_wait_since = seq.lookup_wait_since or now
            deadline = self.lookup_deadline(seq)
            if now < deadline:
                # A Lookup's round trip is a millisecond or two: wait for it here, briefly, rather than
                # run a whole model step (another request's prefill) without this one -- which would
                # delay its prefill by that step, a miss paying for the service after all.
                concurrent.futures.wait([seq.lookup], timeout=min(deadline - now, LOOKUP_BLOCK_S))
                if not seq.lookup.done():
                    return False  # its done-callback (or the deadline) wakes the loop
            elif seq.lookup_prev is not None:
                seq.lookup.cancel()  # a late second answer: the first one stands
                seq.lookup, seq.lookup_from = seq.lookup_prev
                self.metrics.decisions.labels("lookup-refresh-late").inc()
            else:
                seq.lookup.cancel()
                self.metrics.decisions.labels("lookup-timeout").inc()
        seq.lookup_prev = None
        if seq.lookup_wait_since:
            self.metrics.lookup_wait.observe(time.monotonic() - seq.lookup_wait_since)
            seq.lookup_wait_since = 0.0
        hashes = seq.prompt_hashes[: self._usable_blocks(seq)]
        hits = self.radix.match(hashes)
        self.radix.acquire(hits)  # before allocating: eviction must not take our own hit
        need = self.blocks_needed(seq.prompt_len, seq.req.max_tokens) - len(hits)
        own = self.alloc.allocate(need) if self._make_room(need) else None
        if own is None:
            self.radix.release(hits)
            return False
        m = len(hits)
        seq.t_admit = time.monotonic()
        seq.table = [n.block for n in hits] + own
        seq.held, seq.private = list(hits), set(own)
        seq.reused_blocks = m
        seq.cached_by_tier["gpu"] = m * self.tpb
        seq.kv_source = "gpu" if m else "none"
        job = seq.prefetch_job
        staged = job.staged if job is not None else 0
        if job is not None:  # where its staging's time went (the job's fields are written on its thread)
            seq.plan.update(prefetch_wait=round(((job.t_start or seq.t_admit) - job.t_submit) * 1e3, 1),
                            prefetch_first=round((job.t_first - job.t_start) * 1e3, 1) if job.t_first else -1.0,
                            prefetch_answered=job.answered,
                            prefetch_read=job.read, prefetch_paused=round(job.paused_s * 1e3, 1),
                            prefetch_refusals=job.refusals)
        k, tiers = self._plan_load(seq, hashes[m:])
        seq.plan.update(load_host=sum(1 for t in tiers[:k] if t == kvcache_pb2.TIER_HOST),
                        load_disk=sum(1 for t in tiers[:k] if t == kvcache_pb2.TIER_DISK), staged=staged)
        seq.planned_prefill = seq.prompt_len - (m + k) * self.tpb
        if k == 0:
            self._run(seq)
            return True
        assert self.client is not None
        try:
            fut = self.client.submit_load(hashes[m: m + k], own[:k])
        except KVClientError as err:
            log.warning("load not sent: %s", err)
            seq.kv_source = "recomputed:service-down"
            self._run(seq)
            return True
        now = time.monotonic()
        expect = self.cost.estimate(tiers[:k], self.block_bytes)
        load = seq.load = PendingLoad(fut, tiers[:k], now, t_expect=now + expect if expect is not None else 0.0)

        def landed(_: concurrent.futures.Future[Any]) -> None:
            load.t_done = time.monotonic()
            self.wake()

        fut.add_done_callback(landed)
        seq.phase = Phase.PARKED
        self.parked.append(seq)
        return True

    def _stored(self, seq: Seq, rest: list[BlockHash]) -> tuple[int, list[int]]:
        """(how many of `rest` -- the blocks past the GPU hit -- the daemon holds, tier of each)."""
        assert self.client is not None
        fut, seq.lookup = seq.lookup, None
        m = seq.reused_blocks
        try:
            if fut is not None and m >= seq.lookup_from and not fut.cancelled():
                stored, tiers = fut.result()
                tiers = list(tiers)
                job = seq.prefetch_job
                if job is not None and job.staged:  # staged since the Lookup (leased: they stay in host memory)
                    lo = seq.prefetch_from - seq.lookup_from
                    for i in range(max(0, lo), min(stored, lo + job.staged)):
                        tiers[i] = kvcache_pb2.TIER_HOST
                skip = m - seq.lookup_from  # the GPU tier grew since the Lookup: those blocks are ours
                return max(0, stored - skip), tiers[skip:]
            if fut is not None and fut.cancelled():
                return 0, []  # unanswered in time: a miss
            # No Lookup in flight (the service was down at enqueue) or GPU blocks evicted since: ask now.
            return self.client.lookup(rest)
        except KVClientError as err:  # unanswered: the client detaches (asynchronously) and re-attaches
            log.warning("lookup failed: %s", err)
            seq.kv_source = "recomputed:service-down"
            return 0, []

    def _plan_load(self, seq: Seq, rest: list[BlockHash]) -> tuple[int, list[int]]:
        """(blocks to load from the daemon, tier of each stored block); sets kv_source when recomputing."""
        client = self.client
        if not rest or client is None or self.cfg.load_policy == "never":
            seq.lookup = None
            return 0, []
        if seq.lookup is None and not client.attached:
            seq.kv_source = "recomputed:service-down"
            return 0, []
        stored, tiers = self._stored(seq, rest)
        if stored and seq.prefetch_job is not None and self.cfg.load_policy == "auto":
            # A prefetched request's disk blocks reach the GPU through its staging only (SGLang HiCache's
            # best_effort prefetch): what was staged while it queued loads from host memory, the rest past
            # the first unstaged disk block is recomputed. A disk read on the request's path would hold its
            # GPU blocks -- a third of this engine's GPU tier for a 16k history -- for the whole read, behind
            # the staging reads of the requests queued after it (H200, 8B: 944 disk blocks took 3.0 s
            # against 0.65 s of prefill, and the queue behind it never drained).
            host = next((i for i, t in enumerate(tiers[:stored]) if t == kvcache_pb2.TIER_DISK), stored)
            if host < stored:
                seq.plan["unstaged"] = stored - host
                stored, tiers = host, tiers[:host]
                if stored == 0:
                    self.metrics.decisions.labels("unstaged").inc()
                    seq.plan["plan"] = "unstaged"
                    seq.kv_source = "recomputed:unstaged"
                    return 0, tiers
        if stored == 0:
            if not client.attached:
                seq.kv_source = "recomputed:service-down"
            return 0, []
        if self.cfg.load_policy == "always":
            k, reason = stored, "load"
        else:
            k, reason = self.cost.plan(tiers, self.block_bytes, self.tpb, seq.reused_blocks * self.tpb)
        self.metrics.decisions.labels(reason).inc()
        seq.plan["plan"] = reason
        # What the model believed, for the record (timings): the whole stored prefix loaded vs recomputed.
        est = self.cost.estimate(tiers[:stored], self.block_bytes)
        rec = self.cost.recompute_seconds(stored * self.tpb, seq.reused_blocks * self.tpb)
        if est is not None:
            seq.plan["est_load_all_ms"] = round(est * 1e3, 1)
        if rec is not None:
            seq.plan["est_recompute_all_ms"] = round(rec * 1e3, 1)
        disk = self.cost.fit(kvcache_pb2.TIER_DISK)
        if disk is not None:
            seq.plan["disk_fit"] = f"{disk.latency_s * 1e3:.0f} ms + {disk.bytes_per_s / 1e9:.2f} GB/s"
        if k == 0:
            seq.kv_source = "recomputed:cheaper"
        return k, tiers

    def _run(self, seq: Seq) -> None:
        seq.phase = Phase.RUNNING
        seq.t_run = time.monotonic()
        seq.n_cached = seq.reused_blocks * self.tpb
        # With a TTL, every block of the request is (re)stored so the daemon retains it.
        seq.stored_blocks = 0 if seq.req.kv_cache_ttl_seconds > 0 else seq.reused_blocks
        for tier, n in seq.cached_by_tier.items():
            if n:
                self.metrics.reused_tokens.labels(tier).inc(n)
        self.running.append(seq)

    # --- internals: blocks
    def _make_room(self, n: int) -> bool:
        """True when n blocks are free; else evicts what it can (offloading it) and the caller retries later."""
        self.alloc.reclaim()
        short = n - self.alloc.free_count - self.alloc.held_count
        if short > 0:
            victims = self.radix.evict(short)
            if victims:
                self.metrics.evictions.inc(len(victims))
                self._offload(victims)
        return self.alloc.free_count >= n

    def _offload(self, victims: list[tuple[BlockHash, BlockId]]) -> None:
        """Store evicted blocks in the daemon; the blocks stay unusable until the bytes have left them."""
        has = self._in_service
        written = [b for h, b in victims if h in has]
        if written:
            has.difference_update(h for h, _ in victims)  # they leave the GPU tier
            self.alloc.free(written)  # the daemon has them already
            written_set = set(written)
            victims = [(h, b) for h, b in victims if b not in written_set]
            if not victims:
                return
        blocks = [b for _, b in victims]
        client = self.client
        if client is None or not client.attached:
            self.alloc.free(blocks)  # nowhere to keep them: they are just gone
            return
        victims = victims[::-1]  # evict() goes tail first; Store wants chain segments head first
        self.before_store()  # the daemon copies on its own streams: order our kernels' writes first
        try:
            fut = client.submit_store([h for h, _ in victims], [b for _, b in victims], 0.0)
        except KVClientError as err:
            log.warning("offload not sent: %s", err)
            self.alloc.free(blocks)
            return
        fut.add_done_callback(self._store_done("evict"))
        self.alloc.hold(blocks, fut)

    def _insert(self, seq: Seq, hashes: list[BlockHash]) -> list[Node]:
        """Put the request's leading blocks into the radix tree; the tree takes the blocks it did not have."""
        nodes = self.radix.insert(hashes, seq.table[: len(hashes)])
        took = [n for n, b in zip(nodes, seq.table) if n.block == b and b in seq.private]
        for n in took:
            seq.private.discard(n.block)
        self.radix.acquire(took)
        seq.held.extend(took)
        return nodes

    def _commit(self, seq: Seq, hashes: list[BlockHash], reason: str) -> None:
        nodes = self._insert(seq, hashes)
        ttl = seq.req.kv_cache_ttl_seconds
        client = self.client
        lo, hi = seq.stored_blocks, len(nodes)
        if client is None or not (self.cfg.write_through or ttl > 0) or hi <= lo:
            return
        part = nodes[lo:hi]
        self.before_store()  # the daemon copies on its own streams: order our kernels' writes first
        try:
            fut = client.submit_store([n.hash for n in part], [n.block for n in part], ttl)
        except KVClientError as err:
            log.warning("write-through not sent: %s", err)
            return
        self.radix.acquire(part)  # no eviction (and no reuse of the block) until the bytes have left
        self._in_service.update(n.hash for n in part)
        fut.add_done_callback(self._store_done(reason))
        self._stores.append((fut, part))
        seq.stored_blocks = hi

    # --- internals: callbacks (run on the KVClient's thread: metrics and wake-ups only)
    def _store_done(self, reason: str) -> Callable[[concurrent.futures.Future[Any]], None]:
        def done(fut: concurrent.futures.Future[StoreResults]) -> None:
            try:
                # counted, not a metric call per block: this runs on the KVClient's thread, and ~1000
                # labels().inc() calls (a 16k-token prompt) hold the GIL for milliseconds the engine
                # loop waits for
                for status, n in Counter(fut.result().statuses).items():
                    self.metrics.stored_blocks.labels(reason, kvcache_pb2.StoreStatus.Name(status)).inc(n)
            except Exception as err:  # noqa: BLE001
                log.warning("%s store failed: %s", reason, err)
            self.wake()
        return done

    def _count_prefetched(self, statuses: Sequence[int]) -> None:  # on the prefetch thread, once a chunk
        for status, n in Counter(statuses).items():
            self.metrics.prefetched_blocks.labels(kvcache_pb2.PrefetchStatus.Name(status)).inc(n)

    def _prefetch_stopped(self, status: int, message: str) -> None:  # on the prefetch thread
        reason = refusal_reason(status, message)
        self.metrics.prefetch_stops.labels(reason).inc()
        log.debug("prefetch refused (%s): %s", reason, message or kvcache_pb2.PrefetchStatus.Name(status))
