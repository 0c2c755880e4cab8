"""The disk bandwidth cap (kvservice.disk.io_throttle): token buckets with an injected clock and
sleep, so every test asserts the exact pauses requested for the bytes moved, never wall time."""

from __future__ import annotations

import hashlib

import pytest
import torch

from kvservice.disk import block_file
from kvservice.ops.cli import build_parser
from kvservice.ops.config import MiB, ConfigError, load_config
from kvservice.disk.io_backend import PosixIO
from kvservice.disk.io_throttle import ThrottledIO, TokenBucket, throttled
from kvservice.core.types import LoadStatus, StoreStatus
from tests.corekit import Engine, Pool, small_config, started_cache


class FakeTime:
    """A monotonic clock that a sleep advances, so a sequence of transfers can be timed exactly."""

    def __init__(self, advance_on_sleep: bool = True) -> None:
        self.t = 1000.0
        self.slept: list[float] = []
        self.advance_on_sleep = advance_on_sleep

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        if self.advance_on_sleep:
            self.t += seconds


def bucket(ft: FakeTime, rate: int, burst: int = 0) -> TokenBucket:
    return TokenBucket(rate, burst, sleep=ft.sleep, now=ft.now)


def test_back_to_back_transfers_sleep_their_bytes_over_the_rate():
    """Scenario: three transfers at 1000 B/s, one after the other: 2250 bytes cost 2.25 s of
    sleep in total, each transfer paying for its own bytes."""
    ft = FakeTime()
    b = bucket(ft, 1000)
    for n in (500, 1500, 250):
        b.take(n)
    assert ft.slept == pytest.approx([0.5, 1.5, 0.25])


def test_concurrent_transfers_queue_behind_each_other():
    """Scenario: two reader threads reserve at the same instant (the clock does not move between
    them): the second waits for the first one's bytes too, so together they stay at the cap."""
    ft = FakeTime(advance_on_sleep=False)
    b = bucket(ft, 1000)
    b.take(1000)
    b.take(3000)
    assert ft.slept == pytest.approx([1.0, 4.0])


def test_idle_time_earns_at_most_the_burst():
    """Scenario: after a long idle period a burst-sized transfer goes through without a pause,
    and the next one pays in full: idle time never banks more than `burst` bytes."""
    ft = FakeTime()
    b = bucket(ft, 1000, burst=500)
    ft.t += 60
    b.take(500)
    assert ft.slept == []
    b.take(1000)
    assert ft.slept == pytest.approx([1.0])

    no_burst = bucket(ft, 1000)
    ft.t += 60
    no_burst.take(1000)
    assert ft.slept[-1] == pytest.approx(1.0)


def test_throttled_posix_charges_block_reads_and_writes_to_their_own_caps(tmp_path):
    """Scenario: a block file is written, its header rewritten, its payload read back and the
    file removed through a ThrottledIO (read cap 4096 B/s, write cap 8192 B/s). The bytes
    round-trip exactly; writes (header + payload, then the header rewrite) sleep on the write
    cap, the payload read on the read cap, and removal is free."""
    ft = FakeTime()
    io = ThrottledIO(PosixIO(), read=bucket(ft, 4096), write=bucket(ft, 8192))
    assert (io.name, io.fsync) == ("posix+throttled", False)
    payload = torch.arange(8192, dtype=torch.int32).to(torch.uint8)
    meta = block_file.meta_for("ns", hashlib.sha256(b"x").digest(), payload, stored_at=1.0)

    path = block_file.write_block(io, str(tmp_path), meta, payload)
    assert ft.slept == pytest.approx([(4096 + 8192) / 8192])
    meta.deadline = 99.0
    block_file.rewrite_header(io, path, meta)
    assert ft.slept[-1] == pytest.approx(4096 / 8192)
    out = torch.empty(8192, dtype=torch.uint8)
    block_file.read_payload(io, path, meta, out)
    assert torch.equal(out, payload) and block_file.read_header(path).deadline == 99.0
    assert ft.slept[-1] == pytest.approx(8192 / 4096)
    io.remove(path)
    assert len(ft.slept) == 3


def test_zero_caps_leave_the_backend_as_it_is(tmp_path):
    """Scenario: both caps 0 (the default) hand back the backend itself; a read-only cap leaves
    writes unthrottled."""
    posix = PosixIO()
    assert throttled(posix, 0, 0) is posix
    read_only = throttled(posix, read_bytes_per_second=1 << 30)
    assert isinstance(read_only, ThrottledIO) and read_only.inner is posix
    assert read_only.write_bucket is None and read_only.read_bucket.rate == 1 << 30


def test_caps_are_settings_with_flags_units_and_validation(tmp_path):
    """Scenario: an operator caps the disk with `--disk-read-bytes-per-second 200MiB` or
    KVSERVICE_DISK_WRITE_BYTES_PER_SECOND=50MB; a negative cap is refused, naming the setting."""
    args = build_parser().parse_args(
        ["serve", "--socket-path", str(tmp_path / "kv.sock"), "--disk-read-bytes-per-second", "200MiB"])
    cfg = load_config(None, {"KVSERVICE_DISK_WRITE_BYTES_PER_SECOND": "50MB"},
                      {"socket_path": args.socket_path, "disk_read_bytes_per_second": args.disk_read_bytes_per_second})
    assert (cfg.disk_read_bytes_per_second, cfg.disk_write_bytes_per_second) == (200 * MiB, 50_000_000)
    with pytest.raises(ConfigError, match="disk_write_bytes_per_second"):
        load_config(None, {}, {"socket_path": str(tmp_path / "kv.sock"), "disk_write_bytes_per_second": "-1"})


async def test_a_capped_cache_reports_the_throttled_backend_and_serves_disk_blocks(tmp_path):
    """Scenario: a cache started with both caps reports "posix+throttled" (Stats shows it) and
    still stores, spills and loads blocks back from disk byte-exact."""
    pool = Pool(num_blocks=16)
    try:
        config = small_config(tmp_path, disk_read_bytes_per_second=64 * MiB, disk_write_bytes_per_second=64 * MiB)
        async with started_cache(config) as cache:
            assert cache.io_backend_name == "posix+throttled"
            eng = Engine(cache, pool)
            for batch in ([0, 1, 2, 3], [4, 5, 6, 7]):  # the host tier holds 4: the first four spill
                assert {r.status for r in await eng.store(batch)} == {StoreStatus.STORED}
            await cache.tiers.drain()
            res = await eng.load([0, 1, 2, 3])
            assert [r.status for r in res] == [LoadStatus.LOADED] * 4
            assert cache.counters.loads_disk == 4
    finally:
        pool.close()
