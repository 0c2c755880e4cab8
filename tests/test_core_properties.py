"""Property test: random sequences of store / load / prefetch / evict / clock advance / drain
against the core, checking after every step that
  - the host and disk tiers never hold more than their capacity (and their accounting adds up;
    slots an onboarding still fills after its Load answered are loose until it ends, and none is
    left loose once it has: the drain rule),
  - a loaded block always has exactly the bytes that were stored under its hash,
  - under protect-unexpired, no retained block disappears before its deadline (admin evicts aside).
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvservice.core.clock import FakeClock
from kvservice.placement.index import DiskState
from kvservice.core.types import LoadStatus, StoreStatus, Tier
from tests.corekit import Engine, Pool, h, small_config, started_cache

NUMBERS = st.lists(st.integers(0, 15), min_size=1, max_size=4, unique=True)


class CacheMachine(RuleBasedStateMachine):
    @initialize(gate=st.sampled_from(["all", "retained-only", "min-reuse=2"]),
                policy=st.sampled_from(["wait", "shed"]))
    def start(self, gate: str, policy: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.tmp = Path(tempfile.mkdtemp())
        self.clock = FakeClock()
        cfg = small_config(self.tmp, host_capacity_bytes=2 * 4096, disk_blocks=4, protect_unexpired=True, admission_gate=gate,
                           write_queue_depth=2, write_queue_policy=policy, lease_seconds=1e6)
        self.ctx = started_cache(cfg, self.clock)
        self.cache = self.loop.run_until_complete(self.ctx.__aenter__())
        self.pool = Pool(num_blocks=16)
        self.eng = Engine(self.cache, self.pool)
        self.deadlines: dict[int, float] = {}  # block number -> retention deadline promised

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    @rule(numbers=NUMBERS, ttl=st.sampled_from([0.0, 5.0, 60.0]))
    def store(self, numbers, ttl):
        for i, r in zip(numbers, self.run(self.eng.store(numbers, ttl))):
            if r.deadline > 0:
                self.deadlines[i] = max(self.deadlines.get(i, 0.0), r.deadline)
            assert r.status != StoreStatus.FAILED

    @rule(numbers=NUMBERS, ttl=st.sampled_from([0.0, 60.0]))
    def store_again(self, numbers, ttl):  # a second store rule: pressure is what finds bugs
        self.store(numbers, ttl)

    @rule(numbers=NUMBERS)
    def load(self, numbers):
        for r in self.run(self.eng.load(numbers)):  # Engine.load asserts the bytes of every LOADED block
            assert r.status in (LoadStatus.LOADED, LoadStatus.MISSING)

    @rule(numbers=NUMBERS)
    def prefetch(self, numbers):
        self.run(self.cache.prefetch(self.eng.sid, [h(i) for i in numbers]))

    @rule(seconds=st.sampled_from([1.0, 4.0, 30.0]))
    def advance(self, seconds):
        self.clock.advance(seconds)
        self.cache.reap_sessions()  # ends prefetch leases that ran out

    @rule()
    def drain(self):
        self.run(self.cache.tiers.drain())
        if self.cache._background:  # a Load's onboarding after its reply (onboard_disk_hits "always")
            self.run(asyncio.gather(*self.cache._background, return_exceptions=True))
            assert self.cache.tiers.host.loose_bytes == 0, "slots taken for an onboarding never given back"

    @rule()
    def evict_expired(self):
        self.run(self.cache.evict(expired=True))

    @rule()
    def evict_all(self):
        self.run(self.cache.evict(all=True))
        self.deadlines.clear()

    @invariant()
    def capacities_hold(self):
        t = self.cache.tiers
        assert 0 <= t.host.used_bytes <= t.host.capacity_bytes
        assert 0 <= t.disk.used_bytes <= t.disk.capacity_bytes
        host = sum(e.size for e in t.index.values() if e.host_buf is not None)
        disk = sum(e.size for e in t.index.values() if e.disk != DiskState.NONE)
        # loose: slots a Load's onboarding (still running after the Load answered) fills off the loop
        assert host + t.host.loose_bytes == t.host.used_bytes and t.host.loose_bytes >= 0
        assert disk == t.disk.used_bytes

    @invariant()
    def retained_blocks_survive_until_deadline(self):
        now = self.clock.now()
        for i, deadline in self.deadlines.items():
            if deadline > now:
                assert self.cache.lookup(self.eng.sid, [h(i)]) != [], f"retained block {i} lost before its deadline"
                assert self.cache.lookup(self.eng.sid, [h(i)])[0] in (Tier.HOST, Tier.DISK)

    def teardown(self):
        if hasattr(self, "ctx"):
            self.run(self.ctx.__aexit__(None, None, None))
            self.pool.close()
            self.loop.close()
            shutil.rmtree(self.tmp, ignore_errors=True)


CacheMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
test_cache_properties = CacheMachine.TestCase
