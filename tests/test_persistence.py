"""Persistence of the disk tier across daemon restarts (DESIGN §5): complete blocks and their
retention deadlines come back; torn writes are detected and discarded, never served.

A real daemon with a 16-block host tier streams spills to disk while an engine process stores
a burst of blocks (every other batch retained for an hour). The disk write cap
(--disk-write-bytes-per-second) keeps a backlog of spills queued, so a crash or a SIGTERM
lands in the middle of the disk traffic rather than after it.
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import pytest

from kvservice.disk.block_file import HEADER_BYTES
from tests.corekit import h
from tests.daemon_kit import Daemon
from tests.engine_kit import EngineProc

LOADED, MISSING = 1, 2
STORED = 1
DISK = 3
BATCH = 8
TTL = 3600.0
SPILL_FILE_BYTES = HEADER_BYTES + 4096
WRITE_CAP = "250KB"  # ~30 spills (header + payload) a second: the burst below lasts ~4 s


def daemon(files: bool = False, **kw) -> Daemon:
    """files: the one-file-per-block format (--disk-format files), for tests that plant torn block files."""
    return Daemon(host_capacity="64KiB", disk_capacity="4MiB",
                  extra=["--disk-write-bytes-per-second", WRITE_CAP, "--write-queue-depth", "16"]
                  + (["--disk-format", "files"] if files else []), **kw)


def batches(n_blocks: int) -> list[tuple[list[int], float]]:
    """Batches of 8 block numbers, every other one retained."""
    return [(list(range(k, k + BATCH)), TTL if (k // BATCH) % 2 else 0.0) for k in range(0, n_blocks, BATCH)]


def store_all(eng: EngineProc, plan: list[tuple[list[int], float]], out: dict[int, tuple[int, float]]) -> None:
    """Store each batch; record block -> (status, deadline) from the Store replies."""
    for numbers, ttl in plan:
        r = eng.call("store", numbers=numbers, ttl=ttl)
        out.update(zip(numbers, zip(r["status"], r["deadline"])))


def block_number(path: Path, n_blocks: int) -> int:
    return {h(i).hex(): i for i in range(n_blocks)}[path.stem]


def tmp_files(disk: str) -> list[Path]:
    return list(Path(disk).rglob("*.tmp"))


def load_everything(eng: EngineProc, n_blocks: int) -> dict[int, tuple[int, int, bool]]:
    """block -> (status, tier, exact), loading 32 at a time (the upper half of the engine's pool)."""
    out = {}
    for lo in range(0, n_blocks, 32):
        numbers = list(range(lo, min(n_blocks, lo + 32)))
        r = eng.call("load", numbers=numbers)
        out.update(zip(numbers, zip(r["status"], r["tier"], r["exact"])))
    return out


def deadlines(eng: EngineProc, numbers: list[int]) -> dict[int, float]:
    """Current deadlines, read with a TTL of 0 (which changes nothing)."""
    return dict(zip(numbers, eng.call("retain", numbers=numbers, ttl=0)["deadline"]))


@pytest.mark.parametrize("crash_after", [0.5, 1.5, 3.0])
def test_kill9_during_a_write_burst_never_serves_a_wrong_block(crash_after):
    """Scenario: an engine stores 160 blocks (every other batch of 8 retained for an hour) while
    spills stream to a rate-capped disk; the daemon is killed with SIGKILL `crash_after` seconds
    in. A torn write is planted as well (a half-written temp file, and a block file cut short
    under its real name, as a filesystem without atomic rename could leave). After a restart on
    the same disk: no temp file is left, the torn block is MISSING, every block the daemon
    recovered loads byte-exact from disk, every other block is MISSING (never FAILED, never
    wrong), and each surviving retained block has exactly the deadline its Store reply gave."""
    n_blocks = 160
    d = daemon(files=True)
    replies: dict[int, tuple[int, float]] = {}
    try:
        d.start()
        with EngineProc(d.target) as eng:
            ns = eng.hello["namespace"]
            burst = threading.Thread(target=store_all, args=(eng, batches(n_blocks), replies))
            burst.start()
            time.sleep(crash_after)
            d.kill9()
            burst.join(30)
            assert not burst.is_alive()
        stored = {i for i, (status, _) in replies.items() if status == STORED}
        assert 16 < len(stored) < n_blocks, "the crash should land mid-burst"

        files = sorted(Path(d.disk_path).rglob("*.kvb"))
        assert files, "some spills should have reached the disk before the crash"
        torn = block_number(files[0], n_blocks)
        os.truncate(files[0], HEADER_BYTES + 100)
        files[1].with_name(f"{files[1].name}.{os.getpid()}-0.tmp").write_bytes(files[1].read_bytes()[:5000])

        d.start()
        assert tmp_files(d.disk_path) == []
        recovered = {t.name: t for t in d.stats().tiers}["disk"].blocks
        assert recovered > 0
        m = re.findall(r"disk tier recovered (\d+) blocks \((\d+) torn, (\d+) corrupt removed\)", d.log())[-1]
        assert int(m[0]) == recovered and int(m[1]) >= 1 and int(m[2]) == 1
        with EngineProc(d.target) as eng:
            assert eng.hello["namespace"] == ns
            retained = [i for i, (status, deadline) in replies.items() if status == STORED and deadline > 0]
            assert retained
            now_deadlines = deadlines(eng, retained)
            survived = [i for i in retained if now_deadlines[i] > 0]
            assert {i: now_deadlines[i] for i in survived} == {i: replies[i][1] for i in survived}

            got = load_everything(eng, n_blocks)
        loaded = [i for i, (status, _, _) in got.items() if status == LOADED]
        assert {status for status, _, _ in got.values()} <= {LOADED, MISSING}
        assert all(got[i][2] and got[i][1] == DISK for i in loaded), "a loaded block must be byte-exact"
        assert len(loaded) == recovered and set(loaded) <= set(replies)
        assert got[torn][0] == MISSING
        assert d.proc.poll() is None and d.log().count("Traceback") == 0
    finally:
        d.close()


def test_sigterm_restart_keeps_every_spilled_block_and_its_deadline():
    """Scenario: an engine stores 64 blocks (every other batch retained for an hour) and the
    daemon gets SIGTERM while spills are still queued behind the write cap. It drains them, writes
    the retained blocks that lived only in host memory, and exits 0; after a restart every block
    that had left host memory (0-47) and every retained one of the last 16 loads byte-exact from
    disk with its deadline; the best-effort ones of the last 16 are gone with the host tier."""
    n_blocks, in_host = 64, 16
    d = daemon()
    replies: dict[int, tuple[int, float]] = {}
    try:
        d.start()
        with EngineProc(d.target) as eng:
            store_all(eng, batches(n_blocks), replies)
            assert {status for status, _ in replies.values()} == {STORED}
            s = d.stats()  # queued, or taken by a writer's batch and still being written
            assert s.write_queue_depth + s.writes_in_progress > 0, "SIGTERM should find spills not yet written"
        assert d.stop() == 0
        assert tmp_files(d.disk_path) == []

        spilled = list(range(n_blocks - in_host))
        host_only = range(n_blocks - in_host, n_blocks)
        kept = spilled + [i for i in host_only if replies[i][1] > 0]
        assert len(kept) > len(spilled), "some of the last 16 blocks should be retained"
        d.start()
        assert {t.name: t for t in d.stats().tiers}["disk"].blocks == len(kept)
        with EngineProc(d.target) as eng:
            retained = [i for i in spilled if replies[i][1] > 0]
            assert deadlines(eng, kept) == {i: replies[i][1] for i in kept}
            assert len(retained) == len(spilled) // 2
            got = load_everything(eng, n_blocks)
        assert {i: got[i] for i in kept} == {i: (LOADED, DISK, True) for i in kept}
        assert {got[i][0] for i in host_only if i not in kept} == {MISSING}
    finally:
        d.close()


def test_deadlines_set_on_disk_blocks_survive_kill9():
    """Scenario: blocks 0-7 are on disk, 0-3 stored plainly and 4-7 retained for an hour. A
    Retain for two hours then retains 0-1 for the first time and extends 4-5, which rewrites
    their headers in place. After SIGKILL and a restart, every block reads back exactly the
    deadline the last reply gave: new for 0-1 and 4-5, none for 2-3, the original for 6-7."""
    d = daemon()
    try:
        d.start()
        with EngineProc(d.target) as eng:
            plain = eng.call("store", numbers=[0, 1, 2, 3])
            kept = eng.call("store", numbers=[4, 5, 6, 7], ttl=TTL)
            assert plain["status"] == kept["status"] == [STORED] * 4
            assert eng.call("store", numbers=list(range(8, 24)))["status"] == [STORED] * 16
            deadline = time.monotonic() + 10
            while eng.call("lookup", numbers=list(range(8)))["tiers"] != [DISK] * 8:
                assert time.monotonic() < deadline, "blocks 0-7 should reach the disk"
                time.sleep(0.05)
            extended = eng.call("retain", numbers=[0, 1, 4, 5], ttl=2 * TTL)["deadline"]
            assert all(new > old for new, old in zip(extended[2:], kept["deadline"][:2]))
            expected = dict(zip(range(8), plain["deadline"] + kept["deadline"]))
            expected.update(zip([0, 1, 4, 5], extended))
            assert expected[2] == expected[3] == 0.0
        d.kill9()
        d.start()
        with EngineProc(d.target) as eng:
            assert deadlines(eng, list(range(8))) == expected
            r = eng.call("load", numbers=list(range(8)))
            assert r["status"] == [LOADED] * 8 and all(r["exact"])
    finally:
        d.close()
