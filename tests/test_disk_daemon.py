"""The daemon on disk tier v2 (--disk-format segments): real daemon processes, real engine
processes, real files. Spill and cold load, restart, kill -9 during a spill storm, a damaged slot,
a filesystem that fills up or turns read-only, and the capacity bound on what is under the disk path.
(A daemon refuses to start on a disk path it cannot write: config validation; the read-only
open itself is covered in test_disk_faults.)"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import sqlite3
import threading
import time
from pathlib import Path

import numpy as np

from engine_client import AsyncKVClient, Namespace, ShmKVPool
from kvservice.checksum import checksum
from kvservice.core.clock import FakeClock
from kvservice.ops.config import Config
from kvservice.disk import segment as segment_mod
from kvservice.disk import split_loc
from kvservice.api.server import running_server
from kvservice.disk.metadata import REC
from kvservice.disk.segment import segment_name
from tests.corekit import content, h
from tests.daemon_kit import Daemon, short_tmpdir
from tests.engine_kit import EngineProc
from harness.wait import wait_until
from test_disk_faults import files_bytes, small_fs  # noqa: F401 (fixture)

LOADED, MISSING, FAILED = 1, 2, 3
STORED, NOT_STORED = 1, 5
BLOCK = 4096
HOST, DISK = 2, 3
SEGMENTS = ["--disk-format", "segments"]




def settled(d: Daemon) -> bool:
    s = d.stats()
    return s.write_queue_depth == 0 and s.writes_in_progress == 0


def load_all(eng: EngineProc, n: int) -> dict[int, tuple[int, int, bool, str]]:
    out = {}
    for lo in range(0, n, 32):
        numbers = list(range(lo, min(n, lo + 32)))
        r = eng.call("load", numbers=numbers)
        out.update(zip(numbers, zip(r["status"], r["tier"], r["exact"], r["message"])))
    return out


def store_all(eng: EngineProc, n: int, ttl_every: int = 2, out: dict | None = None) -> dict[int, int]:
    out = {} if out is None else out
    for lo in range(0, n, 8):
        numbers = list(range(lo, min(n, lo + 8)))
        r = eng.call("store", numbers=numbers, ttl=3600.0 if (lo // 8) % ttl_every else 0.0)
        out.update(zip(numbers, r["status"]))
    return out


def block_slot(disk: str, i: int) -> tuple[Path, int]:
    """(segment file, byte offset) of block i, from the tier's metadata."""
    db = sqlite3.connect(f"file:{disk}/meta.sqlite3?mode=ro", uri=True)
    try:
        for (blob,) in db.execute("select rec from blocks"):
            rec = np.frombuffer(blob, REC)[0]
            if bytes(rec["hash"]) == h(i):
                seg, slot = split_loc(int(rec["loc"]))
                (slot_bytes,) = db.execute("select slot_bytes from segments where id=?", (seg,)).fetchone()
                return Path(disk) / segment_name(seg, slot_bytes), slot * slot_bytes
    finally:
        db.close()
    raise KeyError(i)


def test_spills_load_back_exactly_and_survive_a_restart():
    """Scenario: 96 blocks through a 16-block host tier: 80 spill to segment files. Every block
    loads byte-exact (the early ones from disk), and after a SIGTERM restart the disk blocks come
    back from the metadata and load exactly again; the files never exceed --disk-capacity."""
    with Daemon(host_capacity="64KiB", disk_capacity="2MiB", extra=SEGMENTS) as d:
        with EngineProc(d.target, "--blocks", "128") as eng:
            assert set(store_all(eng, 96).values()) == {STORED}
            wait_until(lambda: settled(d) and d.stats().counters.spills >= 80, what="spills")
            got = load_all(eng, 96)
            assert all(s == LOADED and exact for s, _, exact, _ in got.values())
            assert [got[i][1] for i in range(8)] == [DISK] * 8
        assert "segments" in d.log()
        assert d.stop() == 0
        d.start()
        disk = {t.name: t for t in d.stats().tiers}["disk"]
        assert disk.blocks >= 80
        with EngineProc(d.target, "--blocks", "128") as eng:
            got = load_all(eng, 96)
            assert all(s == LOADED and exact for s, _, exact, _ in got.values()), got
        size, alloc = files_bytes(Path(d.disk_path))
        assert size <= 2 * 1024 * 1024 and alloc <= 2 * 1024 * 1024
        assert "Traceback" not in d.log()


def test_kill9_during_a_spill_storm_ten_cycles_never_serves_a_wrong_byte():
    """Scenario: ten times, an engine stores bursts (every other batch retained) while spills
    stream to a rate-capped disk, and the daemon is killed with SIGKILL mid-burst. After each
    restart on the same disk, every block either loads byte-exact or is MISSING: never FAILED
    (a torn slot served or caught) and never wrong bytes; the disk tier recovers what it had."""
    d = Daemon(host_capacity="64KiB", disk_capacity="4MiB",
               extra=SEGMENTS + ["--disk-write-bytes-per-second", "400KB", "--write-queue-depth", "16"])
    rng = np.random.default_rng(9)
    recovered = []
    try:
        d.start()
        for cycle in range(10):
            replies: dict[int, int] = {}
            with EngineProc(d.target, "--blocks", "256") as eng:
                burst = threading.Thread(target=store_all, args=(eng, 160, 2, replies))
                burst.start()
                time.sleep(float(rng.uniform(0.3, 1.5)))
                d.kill9()
                burst.join(30)
            d.start()
            recovered.append({t.name: t for t in d.stats().tiers}["disk"].blocks)
            with EngineProc(d.target, "--blocks", "256") as eng:
                got = load_all(eng, 160)
            assert all(s in (LOADED, MISSING) for s, _, _, _ in got.values()), \
                (cycle, [g for g in got.values() if g[0] not in (LOADED, MISSING)][:3])
            assert all(exact for s, _, exact, _ in got.values() if s == LOADED), cycle
        assert sum(recovered) > 0
        c = d.stats().counters
        assert c.checksum_failures == 0
        assert "Traceback" not in d.log()
    finally:
        d.close()


def test_a_damaged_slot_fails_alone_is_counted_and_discarded():
    """Scenario: blocks 0-7 are on disk; one byte of block 3's slot is flipped behind the
    daemon's back. Loading 0-7: block 3 FAILED ("checksum", "discarded"), counted in
    checksum_failures, the others exact from disk; then block 3 is MISSING."""
    with Daemon(host_capacity="64KiB", disk_capacity="2MiB", extra=SEGMENTS) as d:
        with EngineProc(d.target) as eng:
            assert set(store_all(eng, 24, ttl_every=10**6).values()) == {STORED}
            wait_until(lambda: settled(d) and d.stats().counters.spills >= 8, what="spills")
            seg, offset = block_slot(d.disk_path, 3)
            with open(seg, "r+b") as f:
                f.seek(offset + 100)
                b = f.read(1)[0]
                f.seek(offset + 100)
                f.write(bytes([b ^ 0xFF]))
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            r = eng.call("load", numbers=list(range(8)))
            assert r["status"] == [LOADED] * 3 + [FAILED] + [LOADED] * 4
            assert "checksum" in r["message"][3] and "discarded" in r["message"][3]
            assert r["exact"][:3] + r["exact"][4:] == [True] * 7
            assert d.stats().counters.checksum_failures == 1
            assert eng.call("load", numbers=[3])["status"] == [MISSING]
        assert "Traceback" not in d.log()


def test_a_filesystem_filled_by_someone_else_degrades_to_what_is_left(small_fs):
    """Scenario: the daemon starts with --disk-capacity 6 MiB on an 8 MiB filesystem, then another
    tenant writes 5 MiB there. Stores never fail with an internal error; the tier learns the real
    room from ENOSPC (counted as io_errors, logged with the OS's message), evicts to fit and keeps
    spilling; every block loads exact or is MISSING, and the tier's files stay within capacity."""
    mnt = small_fs("8m")
    root = mnt / "disk"
    with Daemon(host_capacity="64KiB", disk_capacity="6MiB", disk_path=str(root), extra=SEGMENTS) as d:
        with open(mnt / "other-tenant", "wb") as f:
            f.write(b"\0" * (5 << 20))
        with EngineProc(d.target, "--blocks", "1024") as eng:
            statuses = store_all(eng, 1024, ttl_every=10**6)
            assert set(statuses.values()) == {STORED}
            wait_until(lambda: settled(d), what="writes")
            got = load_all(eng, 1024)
        assert all(s in (LOADED, MISSING) for s, _, _, _ in got.values())
        assert all(exact for s, _, exact, _ in got.values() if s == LOADED)
        assert sum(s == LOADED for s, _, _, _ in got.values()) > 100
        c = d.stats().counters
        assert c.io_errors >= 1 and c.spills > 100
        assert "No space left on device" in d.log() and "Traceback" not in d.log()
        size, _ = files_bytes(root)
        assert size <= 6 * 1024 * 1024


async def test_a_disk_gone_read_only_keeps_retained_blocks_in_host_memory(monkeypatch):
    """Scenario: the filesystem turns read-only under a running daemon (injected as EROFS at the
    segment write syscall: Linux refuses a manual remount while files are open for writing).
    Over the real socket: the blocks already on disk still load exactly; spills fail (io_errors,
    logged as read-only), never an internal error; once the tier knows, retained blocks stay in
    host memory, so a retained block stored afterwards still loads exactly, and a Store that
    finds the host tier full of them is refused with a message, not failed."""
    workdir = short_tmpdir()
    config = Config(socket_path=str(workdir / "kv.sock"), host_capacity_bytes=16 * BLOCK,
                    disk_path=str(workdir / "disk"), disk_capacity_bytes=4 << 20,
                    writer_threads=2, reader_threads=2, io_backend="posix", disk_format="segments")
    os.makedirs(config.disk_path)
    pool = ShmKVPool(128, BLOCK)
    ns = Namespace("m", "float32", 16, "block-contiguous", 0, 1, "")

    async def store(client, numbers, ttl=0.0):
        for k, i in enumerate(numbers):
            pool.write_block(k, content(i))
        return await client.store([h(i) for i in numbers], list(range(len(numbers))), ttl_seconds=ttl)

    try:
        async with running_server(config, FakeClock()) as srv:
            async with AsyncKVClient(config.socket_path, ns, pool, client_name="erofs test") as client:
                for batch in (list(range(8)), list(range(8, 24))):
                    assert [r.status for r in await store(client, batch)] == [STORED] * len(batch)
                await srv.cache.tiers.drain()

                def erofs(fd, bufs, offset):
                    raise OSError(errno.EROFS, "Read-only file system")

                monkeypatch.setattr(segment_mod, "os_pwritev", erofs)
                rs = await store(client, list(range(24, 40)), ttl=3600.0)  # retained; spills 8-23 fail
                assert all(r.status in (STORED, NOT_STORED) for r in rs) and rs[0].status == STORED
                await srv.cache.tiers.drain()
                c = srv.cache.counters
                assert c.io_errors >= 1
                rs = await client.load([h(i) for i in range(8)], [64 + k for k in range(8)])
                assert [r.status for r in rs] == [LOADED] * 8
                assert all(pool.read_block(64 + k) == content(i) for k, i in enumerate(range(8)))
                stored_retained = [i for i, r in zip(range(24, 40), rs) if r.status == STORED]
                rs = await client.load([h(i) for i in stored_retained], [64 + k for k in range(len(stored_retained))])
                assert [r.status for r in rs] == [LOADED] * len(stored_retained)
                more = await store(client, list(range(40, 56)), ttl=3600.0)
                await srv.cache.tiers.drain()
                assert srv.cache.audit() == []  # no room, pin or half-made entry left by the failed spills
                on_disk = [e for e in srv.cache.tiers.index.values() if e.disk == 2]
                assert srv.cache.tiers.segments.store.stats()["blocks"] == len(on_disk)
                refused = [r for r in more if r.status == NOT_STORED]
                assert refused and all("disk tier cannot be written" in r.message and "read-only" in r.message
                                       for r in refused), refused[:1]
    finally:
        pool.close()
        pool.unlink()
        shutil.rmtree(workdir, ignore_errors=True)


def test_a_full_disk_tier_keeps_its_files_within_the_capacity():
    """Scenario: 640 blocks (2.5 MiB) go through a daemon whose disk tier has 1 MiB: the disk
    fills and evicts in its usual order; at the end, every file under the disk path - segment
    files, the SQLite database and WAL, the namespace canary - sums to at most 1 MiB, and the
    newest blocks still load exactly."""
    with Daemon(host_capacity="64KiB", disk_capacity="1MiB", extra=SEGMENTS) as d:
        with EngineProc(d.target, "--blocks", "128") as eng:
            assert set(store_all(eng, 640, ttl_every=10**6).values()) == {STORED}
            wait_until(lambda: settled(d), what="writes")
            c = d.stats().counters
            assert c.spills > 100 and c.disk_evictions_unmarked > 0
            size, alloc = files_bytes(Path(d.disk_path))
            assert size <= 1 << 20 and alloc <= 1 << 20, (size, alloc)
            r = eng.call("load", numbers=list(range(600, 632)))
            assert r["status"] == [LOADED] * 32 and all(r["exact"])
        assert "Traceback" not in d.log()


def test_planted_files_and_crafted_rows_degrade_per_block_after_a_restart(tmp_path):
    """Scenario: blocks 0-7 are on disk and the daemon stops. Behind its back: a FIFO and a symlink
    (to a file outside the disk path) are planted under segment names, block 2's row is crafted to
    a consistent 2 KiB block (its slot's first 2 KiB, with their CRC32C) in a 4 KiB namespace, and
    block 4's row gets a deadline in the year 3000. The daemon restarts without hanging, removes
    both planted entries without following the link (the outside file is intact), clamps the
    deadline to max_ttl, and a Load of 0-7 gives block 2 FAILED (wrong size, discarded, counted
    in checksum_failures, then MISSING) and the others exact from disk - no INTERNAL."""
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"keep me" * 100)
    max_ttl = 3600.0
    with Daemon(host_capacity="64KiB", disk_capacity="2MiB", extra=SEGMENTS + ["--max-ttl", "1h"]) as d:
        with EngineProc(d.target) as eng:
            assert set(store_all(eng, 24, ttl_every=10**6).values()) == {STORED}
            wait_until(lambda: settled(d) and d.stats().counters.spills >= 8, what="spills")
        assert d.stop() == 0
        disk = Path(d.disk_path)
        os.mkfifo(disk / segment_name(90, BLOCK))
        os.symlink(outside, disk / segment_name(91, BLOCK))
        seg, offset = block_slot(d.disk_path, 2)
        with open(seg, "rb") as f:
            f.seek(offset)
            half = f.read(BLOCK // 2)
        db = sqlite3.connect(f"file:{disk}/meta.sqlite3", uri=True)
        try:
            for rowid, blob in db.execute("select rowid, rec from blocks").fetchall():
                rec = np.frombuffer(blob, REC).copy()
                if bytes(rec[0]["hash"]) == h(2):
                    rec[0]["length"], rec[0]["crc"] = BLOCK // 2, checksum(half)
                elif bytes(rec[0]["hash"]) == h(4):
                    rec[0]["deadline"] = 32503680000.0  # 3000-01-01
                else:
                    continue
                db.execute("update blocks set rec=? where rowid=?", (rec.tobytes(), rowid))
            db.commit()
        finally:
            db.close()
        d.start()
        assert not os.path.lexists(disk / segment_name(90, BLOCK))
        assert not os.path.lexists(disk / segment_name(91, BLOCK))
        assert outside.read_bytes() == b"keep me" * 100
        log = d.log()
        assert "not a regular file" in log or "refused" in log
        with EngineProc(d.target) as eng:
            (deadline,) = eng.call("retain", numbers=[4], ttl=0)["deadline"]
            assert 0 < deadline <= time.time() + max_ttl + 5
            r = eng.call("load", numbers=list(range(8)))
            assert r["status"] == [LOADED] * 2 + [FAILED] + [LOADED] * 5, r["message"]
            assert "2048 bytes" in r["message"][2] and "discarded" in r["message"][2]
            assert r["exact"][:2] + r["exact"][3:] == [True] * 7 and set(r["tier"][3:]) == {DISK}
            assert d.stats().counters.checksum_failures == 1
            assert eng.call("load", numbers=[2])["status"] == [MISSING]
        assert "Traceback" not in d.log()


async def test_eio_on_a_disk_read_fails_that_block_alone_over_the_socket(monkeypatch):
    """Scenario: blocks 0-7 are on disk (segments, in-process server, real socket); the disk
    answers EIO for any read that touches block 3's slot (injected at the segment read syscall).
    A Load of 3 gives FAILED with the OS's message ("Input/output error", "discarded"), counted in
    io_errors and load_failures, the engine block untouched; a Load of the other seven (their
    requests do not touch that slot) is exact from disk; block 3 is then MISSING and the core's
    audit is clean: no INTERNAL, no pin or half-made entry left."""
    workdir = short_tmpdir()
    config = Config(socket_path=str(workdir / "kv.sock"), host_capacity_bytes=16 * BLOCK,
                    disk_path=str(workdir / "disk"), disk_capacity_bytes=4 << 20,
                    writer_threads=2, reader_threads=2, io_backend="posix")
    assert config.disk_format == "segments"  # the default
    os.makedirs(config.disk_path)
    pool = ShmKVPool(128, BLOCK)
    ns = Namespace("m", "float32", 16, "block-contiguous", 0, 1, "")
    try:
        async with running_server(config, FakeClock()) as srv:
            async with AsyncKVClient(config.socket_path, ns, pool, client_name="eio test") as client:
                for batch in (list(range(8)), list(range(8, 24))):
                    for k, i in enumerate(batch):
                        pool.write_block(k, content(i))
                    rs = await client.store([h(i) for i in batch], list(range(len(batch))))
                    assert [r.status for r in rs] == [STORED] * len(batch)
                await srv.cache.tiers.drain()
                _, bad = block_slot(config.disk_path, 3)
                real = segment_mod.os_preadv

                def eio(fd, bufs, offset):
                    if offset <= bad < offset + sum(len(memoryview(b).cast("B")) for b in bufs):
                        raise OSError(errno.EIO, "Input/output error")
                    return real(fd, bufs, offset)

                monkeypatch.setattr(segment_mod, "os_preadv", eio)
                pool.write_block(64, b"\x5a" * BLOCK)
                (r,) = await client.load([h(3)], [64])
                assert r.status == FAILED and "Input/output error" in r.message and "discarded" in r.message
                assert pool.read_block(64) == b"\x5a" * BLOCK
                c = srv.cache.counters
                assert c.io_errors == 1 and c.load_failures == 1
                others = [0, 1, 2, 4, 5, 6, 7]
                rs = await client.load([h(i) for i in others], [70 + k for k in range(7)])
                assert [r.status for r in rs] == [LOADED] * 7 and {r.tier for r in rs} == {DISK}
                assert all(pool.read_block(70 + k) == content(i) for k, i in enumerate(others))
                (r,) = await client.load([h(3)], [64])
                assert r.status == MISSING
                # the seven went to scratch buffers (the host tier was full): their onboarding spills
                # host victims in the background; once that is done, nothing is left over
                await asyncio.gather(*srv.cache._background)
                await srv.cache.tiers.drain()
                assert srv.cache.audit() == []
    finally:
        pool.close()
        pool.unlink()
        shutil.rmtree(workdir, ignore_errors=True)
