"""Liveness across process deaths (DESIGN §5, "Clients and isolation"): a killed engine is
noticed within seconds and everything it held is released; a killed daemon is ridden out by
its engines, which answer as an empty cache would and re-attach on their own after a restart.

Real daemon and engine processes over the real Unix socket. The daemon's lease is 2 s
(tests/daemon_kit); blocks 0-7 are pushed to disk by storing 8-23 into a 16-block host tier.
"""

from __future__ import annotations

import time
from pathlib import Path

from tests.daemon_kit import Daemon
from tests.engine_kit import EngineProc
from harness.wait import wait_until

LOADED, MISSING = 1, 2
STORED, NOT_STORED = 1, 5
HOST, DISK = 2, 3
STAGED, NOT_FOUND = 1, 3  # PrefetchStatus
ON_DISK = list(range(8))




def spill_to_disk(d: Daemon, eng: EngineProc) -> None:
    assert eng.call("store", numbers=ON_DISK)["status"] == [STORED] * 8
    assert eng.call("store", numbers=list(range(8, 24)))["status"] == [STORED] * 16
    wait_until(lambda: d.stats().counters.spills >= 8 and d.stats().write_queue_depth == 0, 10, "spills")
    assert eng.call("lookup", numbers=ON_DISK)["tiers"] == [DISK] * 8


def pinned_blocks(d: Daemon) -> int:
    return sum(t.pinned_blocks for t in d.stats().tiers)


def sessions(d: Daemon) -> dict[str, int]:
    """session id -> prefetch-pinned blocks, from Admin.ListSessions."""
    return {s.label: s.pinned_blocks for s in d.admin("ListSessions").sessions}


def maps_pool_of(d: Daemon, eng: EngineProc) -> bool:
    """Whether the daemon process still maps the engine's shared-memory pool (kvpool_<pid>_*)."""
    maps = Path(f"/proc/{d.proc.pid}/maps").read_text()
    return f"/dev/shm/kvpool_{eng.hello['pid']}_" in maps


def round_trip(eng: EngineProc, numbers: list[int]) -> None:
    assert eng.call("store", numbers=numbers)["status"] == [STORED] * len(numbers)
    r = eng.call("load", numbers=numbers)
    assert r["status"] == [LOADED] * len(numbers) and all(r["exact"])


def test_a_killed_engine_with_leases_and_a_load_in_flight_is_released_within_seconds():
    """Scenario: on a daemon whose disk reads are capped at 10 kB/s, engine A prefetches blocks
    0-1 (pinned for 60 s by their lease) and issues a Load of disk blocks 2-7, which takes
    seconds; while it is in flight A is killed with SIGKILL. Within a few seconds (lease 2 s)
    ListSessions no longer shows A, the daemon no longer maps A's pool, nothing is pinned any
    more (long before the 60 s prefetch lease would run out), A's unused prefetches count as
    wasted, and A's load was cancelled (nothing of it was counted as loaded or onboarded after
    its reads would have finished). Engine B, connected throughout, stores and loads byte-exact
    before and after. The daemon never falters."""
    d = Daemon(host_capacity="64KiB", extra=["--disk-read-bytes-per-second", "10000", "--pin-lease-seconds", "60"])
    try:
        d.start()
        assert d.stats().io_backend == "posix+throttled"
        with EngineProc(d.target) as b:
            a = EngineProc(d.target)
            try:
                spill_to_disk(d, a)
                assert maps_pool_of(d, a) and maps_pool_of(d, b)
                assert a.call("prefetch", numbers=[0, 1])["status"] == [STAGED, STAGED]
                assert sessions(d)[a.hello["label"]] == 2
                a.send("load", numbers=list(range(2, 8)))  # 24 KiB at 10 kB/s: ~2.4 s of reads
                sent_at = time.monotonic()
                wait_until(lambda: d.stats().read_queue_depth > 0, 5, "A's disk reads in flight")
                assert pinned_blocks(d) >= 3  # 0-1 by their lease, 2-7 by the reads
                round_trip(b, [100, 101])  # B is served while A's load crawls
                assert d.stats().read_queue_depth > 0, "A must die with its load in flight"
                a.kill9()
            finally:
                a.close()
            killed_at = time.monotonic()

            wait_until(lambda: a.hello["label"] not in sessions(d), 6, "A's session to be reaped")
            wait_until(lambda: pinned_blocks(d) == 0, 6, "A's pins to be released")
            wait_until(lambda: not maps_pool_of(d, a), 6, "A's pool to be unmapped")
            assert maps_pool_of(d, b)
            assert time.monotonic() - killed_at < 8
            assert list(sessions(d)) == [b.hello["label"]]
            time.sleep(max(0.0, sent_at + 3.0 - time.monotonic()))  # A's reads would be done by now
            c = d.stats().counters
            assert (c.prefetch_staged, c.prefetch_wasted, c.prefetch_used) == (2, 2, 0)
            assert (c.loads_disk, c.disk_onboards) == (0, 2)

            round_trip(b, [102, 103])
            r = b.call("load", numbers=[0, 1])  # what A prefetched is still stored: it belongs to the namespace
            assert r["status"] == [LOADED, LOADED] and all(r["exact"])
        assert d.proc.poll() is None
        assert "Traceback" not in d.log()
    finally:
        d.close()


def test_an_engine_rides_out_a_daemon_crash_and_reattaches_by_itself():
    """Scenario: an engine has blocks 0-7 on disk when the daemon is killed with SIGKILL. While
    it is down the engine's calls do not raise: Load answers MISSING, Store NOT_STORED, Lookup
    an empty prefix, Prefetch NOT_FOUND, Retain no deadline, and the engine reports itself
    detached. The daemon restarts on the same socket and disk; the engine re-attaches without
    being told, a store + load round trip is byte-exact, and blocks 0-7 load byte-exact from the
    recovered disk tier."""
    d = Daemon(host_capacity="64KiB")
    try:
        d.start()
        with EngineProc(d.target) as eng:
            spill_to_disk(d, eng)
            first_session = eng.hello["session"]
            d.kill9()

            r = eng.call("load", numbers=[0, 1])
            assert "error" not in r and r["status"] == [MISSING, MISSING] and r["exact"] == [False, False]
            r = eng.call("store", numbers=[50, 51])
            assert "error" not in r and r["status"] == [NOT_STORED, NOT_STORED]
            assert eng.call("lookup", numbers=ON_DISK) == {"prefix": 0, "tiers": []}
            assert eng.call("prefetch", numbers=[0, 1]) == {"status": [NOT_FOUND, NOT_FOUND]}
            assert eng.call("retain", numbers=[0], ttl=60) == {"deadline": [0.0]}
            assert eng.call("state")["attached"] is False

            d.start()
            state = wait_until(lambda: (s := eng.call("state"))["attached"] and s, 10, "the engine to re-attach")
            assert state["reattachments"] >= 1 and state["session"] != first_session
            assert state["label"] in {s.label for s in d.admin("ListSessions").sessions}

            round_trip(eng, [60, 61, 62, 63])
            r = eng.call("load", numbers=ON_DISK)
            assert r["status"] == [LOADED] * 8 and all(r["exact"]) and r["tier"] == [DISK] * 8
        assert "Traceback" not in d.log()
    finally:
        d.close()
