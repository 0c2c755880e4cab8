"""The load-or-recompute cost model (model_runner/cost_model.py), driven by a fake clock.

Units in these scenarios: a block is 2 MiB of KV and 16 tokens; prefill runs at 1e12 FLOP/s against a
FLOP count of 1e9 per token, i.e. 1 ms per token, 16 ms per block recomputed.
"""

from __future__ import annotations

import pytest

from kvwire.v1 import kvcache_pb2
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
    cost (and a first load's one-time costs); bytes / seconds of it says 0.87 GB/s, at which a 200-block
    prefix (3200 tokens, 50 ms of prefill) looks slower to load (480 ms) than to recompute. The model
    trusts neither a first load nor a 7-block measurement for a 200-block load: it explores (with 128
    blocks, 256 MiB: EXPLORE_CAP_BYTES), and from then on loads large prefixes. A later small load that takes far longer than the fit says
    (fixed cost) teaches it the latency, and tiny prefixes are recomputed."""
    clock = Clock()
    cm = CostModel(flops, clock=clock)
    cm.observe_prefill(3200, 0, 0.05)  # 64 TFLOP/s: 15.6 us a token
    latency, bw = 0.0166, 32e9
    cm.observe_load([HOST] * 7, BLOCK, 0.0169)
    naive_bw = 7 * BLOCK / 0.0169
    assert 200 * BLOCK / naive_bw > 0.05  # what a one-number model concludes: recompute
    assert cm.plan([HOST] * 200, BLOCK, TPB, 0) == Plan(128, "explore")
    clock.t += 0.1
    cm.observe_load([HOST] * 128, BLOCK, true_load(latency, bw, 128))
    for n in (150, 200, 300):  # trusted now (within x2 of the size seen): loading wins on the estimate
        clock.t += 0.1
        assert cm.plan([HOST] * n, BLOCK, TPB, 0) == Plan(n, "load")
    clock.t += 0.1
    cm.observe_load([HOST] * 7, BLOCK, true_load(latency, bw, 7))  # far slower than bandwidth alone says
    fit = cm.fit(HOST)
    assert fit is not None
    assert fit.latency_s == pytest.approx(latency, rel=0.05)
    assert fit.bytes_per_s == pytest.approx(bw, rel=0.1)
    # 4 blocks: 1 ms of prefill against 16.6 ms of fixed load cost.
    assert cm.plan([HOST] * 4, BLOCK, TPB, 0) == Plan(0, "recompute")
    assert cm.plan([HOST] * 200, BLOCK, TPB, 0) == Plan(200, "load")


def test_a_cold_first_load_is_measured_again() -> None:
    """Scenario (the H200 run): a tier's first load is slow (one-time costs: 945 blocks took 1.5 s, the
    next 0.2 s, against 0.63 s of prefill). Explorations load 128 blocks (256 MiB) of it: the first, cold,
    is not trusted and the model explores again at once; the second measurement, not an average with the
    cold one, decides: the whole prefix is loaded from then on."""
    clock = Clock()
    cm = CostModel(flops, clock=clock)
    cm.observe_prefill(15120, 0, 0.63)
    n = 945
    assert cm.plan([HOST] * n, BLOCK, TPB, 0) == Plan(128, "explore")
    cm.observe_load([HOST] * 128, BLOCK, 1.5)
    clock.t += 3
    assert cm.plan([HOST] * n, BLOCK, TPB, 0) == Plan(128, "explore")
    cm.observe_load([HOST] * 128, BLOCK, 0.2 * 128 / n)
    for _ in range(10):
        clock.t += 1
        assert cm.plan([HOST] * n, BLOCK, TPB, 0) == Plan(n, "load")


def test_disk_slower_than_prefill_is_recomputed_and_measured_again_when_stale() -> None:
    """Scenario: the disk delivers 0.5 GB/s after 5 ms (9.2 ms for one 2 MiB block, 4.2 ms a block after
    that) and prefill takes 0.25 ms a token (4 ms a block): the disk loses at every size. Two loads measure
    it (the first one is a warm-up); a size far from the one seen is explored once; after that the model
    recomputes and, while the estimate is fresh, never loads again. Once stale_s has passed without a disk
    load it loads once more to re-measure (at most once per explore_gap_s), then recomputes again."""
    clock = Clock()
    cm = CostModel(flops, clock=clock, stale_s=30.0, explore_gap_s=2.0)
    cm.observe_prefill(1000, 0, 0.25)
    lat, bw = 0.005, 0.5e9
    assert cm.plan([DISK] * 4, BLOCK, TPB, 0) == Plan(4, "explore")  # never measured
    cm.observe_load([DISK] * 4, BLOCK, 3 * true_load(lat, bw, 4))  # cold
    clock.t += 3
    assert cm.plan([DISK] * 4, BLOCK, TPB, 0) == Plan(4, "explore")  # a first load alone is not trusted
    cm.observe_load([DISK] * 4, BLOCK, true_load(lat, bw, 4))
    clock.t += 1
    assert cm.plan([DISK] * 4, BLOCK, TPB, 0) == Plan(0, "recompute")  # measured at this size: slower
    clock.t += 2
    assert cm.plan([DISK] * 32, BLOCK, TPB, 0) == Plan(32, "explore")  # 8x the size seen: not trusted
    assert cm.plan([DISK] * 32, BLOCK, TPB, 0) == Plan(0, "recompute")  # explored < explore_gap_s ago
    cm.observe_load([DISK] * 32, BLOCK, true_load(lat, bw, 32))
    fit = cm.fit(DISK)
    assert fit is not None and fit.bytes_per_s == pytest.approx(bw, rel=0.01)
    assert fit.latency_s == pytest.approx(lat, rel=0.01)
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
    for n in (4, 4, 32):  # the first is a warm-up
        cm.plan([DISK] * n, BLOCK, TPB, 0)
        cm.observe_load([DISK] * n, BLOCK, true_load(lat, bw, n))
        clock.t += 1
    fit = cm.fit(DISK)
    assert fit is not None and fit.latency_s == pytest.approx(lat, rel=0.01)
    for n in (2, 8, 40, 64):
        assert cm.plan([DISK] * n, BLOCK, TPB, 0) == Plan(n, "load")


def test_exploring_a_small_uncertain_share_does_not_load_a_known_slow_tier() -> None:
    """Scenario (the H200 disk run): a prefix of 40 host blocks (host: a size never seen) and 900 disk
    blocks (disk: known, 20x slower than prefill). Exploring the host tier loads the host blocks only."""
    clock = Clock()
    cm = model(clock)
    for _ in range(2):  # each tier seen twice (the first is a warm-up): host at 900 blocks, disk at 1000
        cm.observe_load([HOST] * 900, BLOCK, 0.001 + 900 * BLOCK / 20e9)
        cm.observe_load([DISK] * 1000, BLOCK, 0.005 + 1000 * BLOCK / 0.02e9)
    clock.t += 3
    plan = cm.plan([HOST] * 40 + [DISK] * 900, BLOCK, TPB, 0)
    assert plan.blocks == 40


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


def test_short_prefill_tails_do_not_make_recompute_look_dear() -> None:
    """Replay of the H200 disk run (8B, 2026-12-01): one 15k-token prefill in 0.5 s, then thirty
    116-token tails after loads, 15 ms each (per-step overhead). An average rate over them fell to a
    third of the GPU's and 945 disk blocks at 1.15 GB/s (1.7 s) looked cheaper than their prefill
    (0.5 s); the marginal rate keeps recomputing them."""
    clock = Clock()
    cm = CostModel(flops, clock=clock)
    cm.observe_prefill(15120, 992, 0.5)
    for i in range(30):
        cm.observe_prefill(116 + i % 3, 15120 + 992, 0.015)
    bw = 1.15e9
    cm.seed(DISK, 0.01, bw, BLOCK)
    cm.seed(DISK, 0.01, bw, BLOCK)  # trusted around the size asked below
    cm.observe_load([DISK] * 945, BLOCK, 0.01 + 945 * BLOCK / bw)
    clock.t += 0.1
    assert cm.plan([DISK] * 945, BLOCK, TPB, 992) == Plan(0, "recompute")
    assert cm.tokens_per_s is not None and cm.tokens_per_s > 20000


def test_prefetch_reads_make_a_slow_disk_known_without_loading_from_it() -> None:
    """Scenario (the H200 disk setting): the prefetcher reports its jobs' disk reads -- 128 blocks in
    5.4 s, then 512 in 21.5 s (0.05 GB/s, 42 ms a block, against 16 ms of prefill) -- and host loads are
    known (seeded, 20 GB/s). Without a single Load from disk the model recomputes a disk prefix, even one
    8x longer than any read seen (the reads separated a small fixed cost from the bytes), and of a prefix
    whose head was staged into host memory it loads the host part and recomputes the disk tail."""
    clock = Clock()
    cm = model(clock)
    cm.seed(HOST, 0.001, 20e9, BLOCK)
    host_byte_s = BLOCK / 20e9
    for n in (64, 128, 512):  # the first report is a warm-up, dropped once the second arrives
        cm.observe_staged(DISK, HOST, n, BLOCK, 0.003 + n * BLOCK / 0.05e9)
        clock.t += 1
    fit = cm.fit(DISK)
    assert fit is not None
    assert fit.seconds_per_byte == pytest.approx(1 / 0.05e9 + 1 / 20e9, rel=0.01)  # the reads plus the host copy
    assert cm.plan([DISK] * 945, BLOCK, TPB, 0) == Plan(0, "recompute")
    assert cm.plan([DISK] * 4096, BLOCK, TPB, 0) == Plan(0, "recompute")  # 8x the largest read: extrapolated
    assert cm.plan([HOST] * 300 + [DISK] * 645, BLOCK, TPB, 0) == Plan(300, "load")
    est = cm.estimate([HOST] * 300, BLOCK)
    assert est is not None and est == pytest.approx(0.001 + 300 * host_byte_s, rel=0.01)


def test_a_fit_of_one_size_or_of_latency_dominated_loads_is_not_extrapolated() -> None:
    """Scenario: prefill at 0.1 ms a token (1.6 ms a block). Host loads of 7 blocks only, in 16.9 ms (the
    issue's latency-dominated first loads: 2.4 ms a block if it were all bytes), or of 7 and 14 blocks
    whose fixed cost is a quarter of the larger one (10 ms + 1 GB/s): neither says what 200 blocks cost
    (an estimate above their 320 ms of prefill), so 200 is explored rather than recomputed."""
    for loads in (((7, 0.0169), (7, 0.0169), (7, 0.0169)),
                  ((7, 0.010 + 7 * BLOCK / 1e9), (7, 0.010 + 7 * BLOCK / 1e9), (14, 0.010 + 14 * BLOCK / 1e9))):
        clock = Clock()
        cm = CostModel(flops, clock=clock)
        cm.observe_prefill(1000, 0, 0.1)
        for n, seconds in loads:
            cm.observe_load([HOST] * n, BLOCK, seconds)
            clock.t += 1
        assert cm.plan([HOST] * 200, BLOCK, TPB, 0).reason == "explore"
    assert cm.estimate([DISK], BLOCK) is None  # never measured


def test_one_tier_is_explored_at_a_time_shallowest_first_and_with_256_mib_at_most() -> None:
    """Scenario (the CPU reproduction of the disk setting): stored prefixes are 200 host blocks (a prefetch's
    staged head) then 745 disk blocks; neither tier measured; prefill 4 ms a block, host 20 GB/s, disk
    0.5 GB/s. A Load of both would be charged to the disk alone, leaving the host tier unmeasured (the
    prefetch-0 engine explored 20 of 20 requests that way). So the host part is explored alone (twice: a
    warm-up, 128 blocks or 256 MiB, and a measurement), then the host part and 128 disk blocks (not the
    whole 1.5 GB) to measure the disk (twice); from then on the host part is loaded and the disk tail
    recomputed. Once both are stale, each is re-measured in turn."""
    clock = Clock()
    cm = CostModel(flops, clock=clock, explore_gap_s=10.0, stale_s=30.0)
    cm.observe_prefill(1000, 0, 0.25)  # 4 ms a block
    mixed = [HOST] * 200 + [DISK] * 745
    for n in (128, 200):  # the second: an estimate exists (pessimistic, one size) and says load all 200
        assert cm.plan(mixed, BLOCK, TPB, 0) == Plan(n, "explore")
        cm.observe_load([HOST] * n, BLOCK, 0.001 + n * BLOCK / 20e9)
        clock.t += 1
    for _ in range(2):
        assert cm.plan(mixed, BLOCK, TPB, 0) == Plan(200 + 128, "explore")
        cm.observe_load(mixed[:328], BLOCK, 0.001 + 200 * BLOCK / 20e9 + 128 * BLOCK / 0.5e9)
        clock.t += 1
    fit = cm.fit(DISK)
    assert fit is not None and fit.bytes_per_s == pytest.approx(0.5e9, rel=0.05)
    for _ in range(5):
        assert cm.plan(mixed, BLOCK, TPB, 0) == Plan(200, "load")
        clock.t += 1
    clock.t += 40
    assert cm.plan(mixed, BLOCK, TPB, 0) == Plan(200, "explore")  # host first (all 200: loading them is best anyway)
    assert cm.plan(mixed, BLOCK, TPB, 0) == Plan(200 + 128, "explore")  # then the disk
    assert cm.plan(mixed, BLOCK, TPB, 0) == Plan(200, "load")  # both explored < 10 s ago
