"""The load-or-recompute cost model (model_runner/cost_model.py), driven by a fake clock.

Units in these scenarios: a block is 2 MiB of KV and 16 tokens; prefill runs at 1e12 FLOP/s against a
FLOP count of 1e9 per token, i.e. 1 ms per token, 16 ms per block recomputed.
"""

from __future__ import annotations

import pytest

from kvservice.v1 import kvcache_pb2
from model_runner.cost_model import CostModel, Plan

HOST, DISK = kvcache_pb2.TIER_HOST, kvcache_pb2.TIER_DISK
TPB = 16
BLOCK = 2 << 20
FLOPS_PER_S = 1e12


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def flops(n: int, ctx: int) -> float:
    return n * 1e9


def model(clock: Clock, **kw: float) -> CostModel:
    cm = CostModel(flops, clock=clock, **kw)
    cm.observe_prefill(1000, 0, 1000 * 1e9 / FLOPS_PER_S)  # 1 ms a token
    return cm


def true_load(latency_s: float, bytes_per_s: float, blocks: int) -> float:
    return latency_s + blocks * BLOCK / bytes_per_s


def test_latency_dominated_first_load_does_not_stop_later_large_loads() -> None:
    """Scenario (as measured on the H200): the first host load is 7 blocks in 16.9 ms, nearly all fixed
    cost; bytes / seconds of it says 0.87 GB/s, at which a 200-block prefix (3200 tokens, 50 ms of
    prefill) looks slower to load (480 ms) than to recompute. The model does not trust a 7-block
    measurement for a 200-block load: it loads (explores), fits latency and bandwidth from the two
    sizes, and from then on loads large prefixes because they are cheaper, and recomputes tiny ones."""
    clock = Clock()
    cm = CostModel(flops, clock=clock)
    cm.observe_prefill(3200, 0, 0.05)  # 64 TFLOP/s: 15.6 us a token
    latency, bw = 0.0166, 32e9
    cm.observe_load([HOST] * 7, BLOCK, 0.0169)
    naive_bw = 7 * BLOCK / 0.0169
    assert 200 * BLOCK / naive_bw > 0.05  # what a one-number model concludes: recompute
    assert cm.plan([HOST] * 200, BLOCK, TPB, 0) == Plan(200, "explore")
    clock.t += 0.1
    cm.observe_load([HOST] * 200, BLOCK, true_load(latency, bw, 200))
    fit = cm.fit(HOST)
    assert fit is not None
    assert fit.latency_s == pytest.approx(latency, rel=0.05)
    assert fit.bytes_per_s == pytest.approx(bw, rel=0.1)
    for n in (150, 200, 300):  # trusted now (within x2 of the sizes seen): loading wins on the estimate
        clock.t += 0.1
        assert cm.plan([HOST] * n, BLOCK, TPB, 0) == Plan(n, "load")
    # 4 blocks: 1 ms of prefill against 16.6 ms of fixed load cost.
    assert cm.plan([HOST] * 4, BLOCK, TPB, 0) == Plan(0, "recompute")


def test_disk_slower_than_prefill_is_recomputed_and_measured_again_when_stale() -> None:
    """Scenario: the disk delivers 0.5 GB/s after 5 ms (9.2 ms for one 2 MiB block, 4.2 ms a block after
    that) and prefill takes 0.25 ms a token (4 ms a block): the disk loses at every size. The first load
    measures it; a size far from the one seen is explored once; after that the model recomputes and,
    while the estimate is fresh, never loads again. Once stale_s has passed without a disk load it
    loads once more to re-measure (at most once per explore_gap_s), then recomputes again."""
    clock = Clock()
    cm = CostModel(flops, clock=clock, stale_s=30.0, explore_gap_s=2.0)
    cm.observe_prefill(1000, 0, 0.25)
    lat, bw = 0.005, 0.5e9
    assert cm.plan([DISK] * 4, BLOCK, TPB, 0) == Plan(4, "explore")  # never measured
    cm.observe_load([DISK] * 4, BLOCK, true_load(lat, bw, 4))
    clock.t += 1
    assert cm.plan([DISK] * 4, BLOCK, TPB, 0) == Plan(0, "recompute")  # measured at this size: slower
    assert cm.plan([DISK] * 32, BLOCK, TPB, 0) == Plan(32, "explore")  # 8x any size seen: not trusted
    assert cm.plan([DISK] * 32, BLOCK, TPB, 0) == Plan(0, "recompute")  # explored < explore_gap_s ago
    cm.observe_load([DISK] * 32, BLOCK, true_load(lat, bw, 32))
    fit = cm.fit(DISK)
    assert fit is not None and fit.bytes_per_s == pytest.approx(bw, rel=0.01)
    for _ in range(20):  # fresh and trusted: recompute, no more exploring
        clock.t += 1
        assert cm.plan([DISK] * 16, BLOCK, TPB, 0) == Plan(0, "recompute")
    clock.t += 31  # stale: one exploratory load, then back to recomputing
    assert cm.plan([DISK] * 16, BLOCK, TPB, 0) == Plan(16, "explore")
    assert cm.plan([DISK] * 16, BLOCK, TPB, 0) == Plan(0, "recompute")
    cm.observe_load([DISK] * 16, BLOCK, true_load(lat, bw, 16))
    clock.t += 1
    assert cm.plan([DISK] * 16, BLOCK, TPB, 0) == Plan(0, "recompute")


def test_disk_faster_than_prefill_is_loaded() -> None:
    """Scenario: a fast disk (2 ms + 6 GB/s: 2.3 ms for one block, 0.35 ms a block after that) against
    16 ms of prefill a block: every stored prefix is loaded, all of it."""
    clock = Clock()
    cm = model(clock)
    lat, bw = 0.002, 6e9
    for n in (4, 32):
        cm.plan([DISK] * n, BLOCK, TPB, 0)
        cm.observe_load([DISK] * n, BLOCK, true_load(lat, bw, n))
        clock.t += 1
    fit = cm.fit(DISK)
    assert fit is not None and fit.latency_s == pytest.approx(lat, rel=0.01)
    for n in (2, 8, 40, 64):
        assert cm.plan([DISK] * n, BLOCK, TPB, 0) == Plan(n, "load")


def test_mixed_prefix_loads_the_host_part_and_recomputes_the_slow_disk_tail() -> None:
    """Scenario: host 1 ms + 20 GB/s, disk 20 ms + 0.1 GB/s (21 ms a block) against 16 ms of prefill a
    block: the best prefix is the host blocks; a prefix that starts on disk is recomputed."""
    clock = Clock()
    cm = model(clock)
    cm.seed(HOST, 0.001, 20e9, BLOCK)
    cm.seed(DISK, 0.020, 0.1e9, BLOCK)
    for n_disk in (2, 8, 30):
        assert cm.plan([HOST] * 10 + [DISK] * n_disk, BLOCK, TPB, 0) == Plan(10, "load")
    assert cm.plan([DISK] * 4 + [HOST], BLOCK, TPB, 0) == Plan(0, "recompute")  # 104 ms to load, 80 to compute
    assert cm.plan([DISK] * 4 + [HOST] * 4, BLOCK, TPB, 0) == Plan(8, "load")  # 104 ms against 128


def test_mixed_load_is_charged_to_the_deepest_tier_after_the_known_host_share() -> None:
    """Scenario: host is known (seeded); a load of 4 host + 4 disk blocks took 50 ms: the host bytes'
    time comes off and the remainder is one disk observation of 4 blocks."""
    clock = Clock()
    cm = model(clock)
    cm.seed(HOST, 0.001, 20e9, BLOCK)
    host_bytes_s = 4 * BLOCK / 20e9
    cm.observe_load([HOST] * 4 + [DISK] * 4, BLOCK, 0.050)
    fit = cm.fit(DISK)
    assert fit is not None and fit.seconds(4 * BLOCK) == pytest.approx(0.050 - host_bytes_s)
    fresh = CostModel(flops, clock=clock)
    fresh.observe_load([HOST, DISK], BLOCK, 0.002)  # nothing known: all of it is disk's
    assert fresh.fit(HOST) is None and fresh.fit(DISK) is not None


def test_before_any_prefill_is_measured_everything_stored_is_loaded() -> None:
    cm = CostModel(flops, clock=Clock())
    assert cm.flops_per_s is None and cm.bandwidth == {}
    assert cm.plan([HOST, DISK], BLOCK, TPB, 0) == Plan(2, "explore")
    assert cm.plan([], BLOCK, TPB, 0) == Plan(0, "recompute")
