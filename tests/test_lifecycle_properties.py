"""Property test of the block lifecycle (kvservice.core.lifecycle; DESIGN §5, "Lifecycle"): random
interleavings of Stores, Loads, Prefetches and Retains that run concurrently and end after a random
number of event-loop steps - cancelled, or their session closed under them (a dead client), or left
to finish - with admin evictions, clock advances (session and prefetch-lease reaping) and session
closes between them. Checked against a small model:
  - at every event-loop step of those calls (every await point they reach): the host tier's used
    bytes equal the slots of its reserved, rolled-back and ready blocks; staging and arena books
    add up; every lease has an open owner (BlockCache.audit(idle=False));
  - after every step, once copy threads and disk I/O have settled: nothing reserved or half-made,
    nothing pinned, no lease without an open session, every book adds up (BlockCache.audit());
  - every block a Load reports LOADED has exactly the bytes stored under its hash;
  - every Store and Load passes an answer hook (pipeline.Answer, as the frames channel does): what it
    sends is what the call returns, every status final, and the call returns in the same event-loop
    step (no await after its answer: it cannot be cancelled after it, nothing runs between);
  - with a disk tier under protect-unexpired, every block acknowledged as retained (a Store or a
    Retain answered a deadline) loads byte-exact until that deadline, or is reported FAILED.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvservice.core import pipeline
from kvservice.core.clock import FakeClock
from kvservice.core.types import CacheError, ErrorCode, LoadStatus, StoreStatus
from tests.corekit import Engine, Pool, content, h, small_config, started_cache

NUMBERS = st.lists(st.integers(0, 11), min_size=1, max_size=4, unique=True)
OPS = st.lists(st.tuples(st.sampled_from(["store", "store_ttl", "load", "prefetch", "retain"]), NUMBERS),
               min_size=1, max_size=3)
TTL = 60.0


class EarlyAnswer:
    """A pipeline.Answer for one call, checked: what it sent (a copy of the statuses and the rest at
    send time) must be what the call returns, and the call must have returned in the event-loop step
    that sent it (a callback queued at send time runs after that step; check() marks the return)."""

    def __init__(self) -> None:
        self.sent: tuple | None = None
        self.returned = False
        self.late: list[str] = []
        self.hook = pipeline.Answer(self._send)

    @staticmethod
    def _snapshot(results) -> tuple:
        return (bytes(results.status), bytes(getattr(results, "tier", b"")), list(getattr(results, "deadline", None) or ()),
                dict(results.messages))

    def _send(self, results) -> None:
        assert 0 not in results.status, "an answer with a block not answered"
        self.sent = self._snapshot(results)
        task = asyncio.current_task()

        def after_this_step() -> None:
            if not self.returned:
                where = " <- ".join(f"{f.f_code.co_name}:{f.f_lineno}" for f in task.get_stack())
                self.late.append(f"the call went on past an await after its answer was sent (at {where})")
        asyncio.get_running_loop().call_soon(after_this_step)

    def check(self, results) -> None:
        """Call as soon as the call returned (no await before): its results against the answer."""
        self.returned = True
        if self.sent is not None:
            assert self._snapshot(results) == self.sent, "the call returned other results than it answered"

    def check_late(self) -> None:
        """After the caller's next await: no call went on past its answer."""
        assert not self.late, self.late


class SlotSafeEngine(Engine):
    """Concurrent calls of one engine never share a pool slot, as an engine's must not (a Store's
    blocks stay unchanged until it returns, a Load's targets are its own): block i is always
    stored from slot i, with block i's bytes; each Load of a rule lands in a window of slots of
    its own (LOAD_BASE + 4 x k), which no Store reads. Every call passes an EarlyAnswer: checked
    when the call returns, and a call cancelled after its answer was sent fails the test."""

    LOAD_BASE = 16

    def __init__(self, cache, pool) -> None:
        super().__init__(cache, pool)
        self._loads = 0
        self.answers: list[EarlyAnswer] = []  # checked (check_late) by the machine after every step

    async def store(self, numbers: list[int], ttl: float = 0.0):
        for i in numbers:
            self.pool.write(i, content(i, self.pool.block_bytes))
        early = EarlyAnswer()
        self.answers.append(early)
        try:
            res = await self.cache.store(self.sid, [h(i) for i in numbers], list(numbers), ttl, answer=early.hook)
        except BaseException:
            assert early.sent is None, "a Store that answered failed or was cancelled after it"
            raise
        early.check(res)
        return res

    async def load(self, numbers: list[int]):
        base = self.LOAD_BASE + 4 * (self._loads % 4)
        self._loads += 1
        for k in range(len(numbers)):
            self.pool.write(base + k, bytes(self.pool.block_bytes))
        early = EarlyAnswer()
        self.answers.append(early)
        try:
            res = await self.cache.load(self.sid, [h(i) for i in numbers], [base + k for k in range(len(numbers))],
                                        answer=early.hook)
        except BaseException:
            assert early.sent is None, "a Load that answered failed or was cancelled after it"
            raise
        early.check(res)
        for k, (i, r) in enumerate(zip(numbers, res)):
            if r.status == LoadStatus.LOADED:
                assert self.pool.read(base + k) == content(i, self.pool.block_bytes), f"wrong bytes for block {i}"
        return res


class LifecycleMachine(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(["wait", "shed"]), disk=st.booleans(), protect=st.booleans())
    def start(self, policy: str, disk: bool, protect: bool) -> None:
        self.loop = asyncio.new_event_loop()
        self.tmp = Path(tempfile.mkdtemp())
        self.clock = FakeClock()
        cfg = small_config(self.tmp, host_capacity_bytes=3 * 4096, disk_blocks=6 if disk else 0,
                           write_queue_depth=1, writer_threads=1, write_queue_policy=policy,
                           lease_seconds=30.0, pin_lease_seconds=5.0, prefetch_share=0.5,
                           protect_unexpired=protect)
        self.ctx = started_cache(cfg, self.clock)
        self.cache = self.loop.run_until_complete(self.ctx.__aenter__())
        self.pool = Pool(num_blocks=32)
        self.eng = SlotSafeEngine(self.cache, self.pool)
        # the model: block number -> the latest retention deadline the cache acknowledged for it
        self.retained: dict[int, float] = {}
        # a retained block must survive only where it can be kept: a disk tier, protect-unexpired
        self.guarded = disk and protect

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    async def _settle(self) -> None:
        """Until every copy thread is idle (a cancelled call's rollback runs when its copy ends),
        every disk read has settled and every disk write is done."""
        loop = asyncio.get_running_loop()
        pool = self.cache._copy_pool
        barrier = threading.Barrier(pool._max_workers)
        for _ in range(2):
            await self.cache.tiers.drain()
            for _ in range(10000):  # disk reads settle in their done callbacks (a cancelled Load's too)
                if not self.cache.tiers.reads_in_flight:
                    break
                await asyncio.sleep(0.001)
            await asyncio.gather(*(loop.run_in_executor(pool, barrier.wait) for _ in range(pool._max_workers)))
            barrier.reset()
            if self.cache._background:  # disk hits onboarded after a Load's reply
                await asyncio.gather(*list(self.cache._background), return_exceptions=True)
            for _ in range(5):
                await asyncio.sleep(0)

    def _reopen_if_closed(self) -> None:
        try:
            self.cache.heartbeat(self.eng.sid)
        except CacheError:  # reaped: the engine opens a new session, as engine_client would
            self.eng = SlotSafeEngine(self.cache, self.pool)

    def _acknowledge(self, numbers, deadlines) -> None:
        for i, d in zip(numbers, deadlines):
            if d > 0:
                self.retained[i] = max(self.retained.get(i, 0.0), d)

    def _start(self, op: str, nums: list[int]) -> asyncio.Future:
        if op == "store":
            return asyncio.ensure_future(self.eng.store(nums))
        if op == "store_ttl":
            return asyncio.ensure_future(self.eng.store(nums, ttl=TTL))
        if op == "load":  # SlotSafeEngine.load checks the bytes of every LOADED block
            return asyncio.ensure_future(self.eng.load(nums))
        if op == "retain":
            return asyncio.ensure_future(self.cache.retain(self.eng.sid, [h(i) for i in nums], TTL))
        return asyncio.ensure_future(self.cache.prefetch(self.eng.sid, [h(i) for i in nums]))

    @rule(ops=OPS, steps=st.integers(0, 12), end=st.sampled_from(["cancel", "cancel", "close_session", "finish"]))
    def concurrent_calls(self, ops, steps, end):
        """Calls in flight together; after `steps` loop steps (the books checked at each) they are
        cancelled, or their session is closed under them, or they run to their end."""
        async def go():
            tasks = [self._start(op, nums) for op, nums in ops]
            for _ in range(steps):
                await asyncio.sleep(0)
                assert self.cache.audit(idle=False) == []
            if end == "cancel":
                for t in tasks:
                    t.cancel()
            elif end == "close_session":
                await self.cache.close_session(self.eng.sid)
            for (op, nums), t in zip(ops, tasks):
                try:
                    res = await t
                except asyncio.CancelledError:
                    assert end == "cancel"
                    continue
                except CacheError as err:  # its pool was unmapped under it, or its session was gone
                    assert end == "close_session" and err.code == ErrorCode.NOT_FOUND, err
                    continue
                if op.startswith("store"):
                    assert all(r.status != StoreStatus.FAILED for r in res), [r.message for r in res]
                    self._acknowledge(nums, [r.deadline for r in res])
                elif op == "load":
                    bad = [r for r in res if r.status not in (LoadStatus.LOADED, LoadStatus.MISSING)]
                    assert not bad, [r.message for r in bad]
                elif op == "retain":
                    self._acknowledge(nums, res)
            await self._settle()
        self.run(go())
        if end == "close_session":
            self.eng = SlotSafeEngine(self.cache, self.pool)

    @rule(nums=NUMBERS, ttl=st.sampled_from([0.0, TTL]))
    def store(self, nums, ttl):
        res = self.run(self.eng.store(nums, ttl))
        assert all(r.status != StoreStatus.FAILED for r in res), [r.message for r in res]
        self._acknowledge(nums, [r.deadline for r in res])
        self.run(self._settle())

    @rule()
    def retained_blocks_load_exact(self):
        # no precondition on the model: what was acknowledged depends on thread timing, and a
        # precondition must not (hypothesis replays rule choices)
        if not self.guarded:
            return
        now = self.clock.now()
        live = sorted(i for i, d in self.retained.items() if d > now)
        if not live:
            return
        res = self.run(self.eng.load(live[:4]))  # checks the bytes of every LOADED block
        for i, r in zip(live, res):
            assert r.status == LoadStatus.LOADED or (r.status == LoadStatus.FAILED and r.message), \
                f"retained block {i} (deadline {self.retained[i] - now:.0f} s ahead) answered {r.status.name}"
        self.run(self._settle())

    @rule(seconds=st.sampled_from([1.0, 6.0, 40.0]))
    def advance_and_reap(self, seconds):
        if seconds < 30:
            self._reopen_if_closed()  # a heartbeat (or a new session if the last one was reaped)
        self.clock.advance(seconds)

        async def reap():  # on the cache's loop: closing a session starts its unmapping there
            self.cache.reap_sessions()
            await self._settle()
            await asyncio.gather(*self.cache._background, return_exceptions=True)
        self.run(reap())
        self._reopen_if_closed()

    @rule()
    def close_and_reopen(self):
        self.run(self.cache.close_session(self.eng.sid))
        self.run(self._settle())
        self.eng = SlotSafeEngine(self.cache, self.pool)

    @rule(which=st.sampled_from(["all", "expired"]))
    def admin_evict(self, which):
        self.run(self.cache.evict(all=True) if which == "all" else self.cache.evict(expired=True))
        if which == "all":
            self.retained.clear()  # the operator's call: nothing is owed any more

    @invariant()
    def audit_is_clean(self):
        if hasattr(self, "cache"):
            self.run(self._settle())
            assert self.cache.audit() == []
            for early in self.eng.answers:
                early.check_late()
            self.eng.answers.clear()

    def teardown(self):
        if hasattr(self, "ctx"):
            self.run(self.ctx.__aexit__(None, None, None))
            self.pool.close()
            self.loop.close()
            shutil.rmtree(self.tmp, ignore_errors=True)


LifecycleMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=20, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
test_lifecycle_properties = LifecycleMachine.TestCase
