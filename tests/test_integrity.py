"""Integrity of the disk tier (DESIGN §5): damaged block files are reported, counted and
discarded, never served, and an engine block is never written with wrong bytes.

Faults are injected into the real block files of a real daemon (a flipped byte, a truncated or
vanished file, a damaged header found at restart), and at the I/O boundary of an in-process
server for a short read. The host tier holds 16 blocks of 4096 bytes: storing blocks 0-7 and
then 8-23 pushes 0-7 to disk, one file each at <disk>/<namespace>/<xx>/<hash hex>.kvb: these
tests are about the one-file-per-block format (--disk-format files); the same faults on the
default segments format are in test_disk_daemon and test_disk_faults.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from engine_client import AsyncKVClient, Namespace, ShmKVPool
from kvservice.disk.block_file import HEADER_BYTES
from kvservice.core.cache import BlockCache
from kvservice.checksum import byte_view
from kvservice.core.clock import FakeClock
from kvservice.ops.config import Config
from kvservice.disk.io_backend import PosixIO, ShortReadError
from kvservice.api.server import running_server
from tests.corekit import content, h
from tests.daemon_kit import Daemon, short_tmpdir
from tests.engine_kit import EngineProc
from harness.wait import wait_until

BLOCK = 4096
LOADED, MISSING, FAILED = 1, 2, 3
STORED = 1
DISK = 3
ON_DISK = list(range(8))  # spilled by storing 8-23 after them
TARGET = 32  # engine_proc lands load #k in pool block 32 + k, zeroed first
ZEROS = hashlib.sha256(bytes(BLOCK)).hexdigest()




def block_file(disk_path: str, namespace: str, i: int) -> Path:
    hx = h(i).hex()
    return Path(disk_path) / namespace / hx[:2] / f"{hx}.kvb"


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ 0xFF]))


def spill_to_disk(d: Daemon, eng: EngineProc) -> None:
    """Store 0-7, then 8-23; wait until 0-7 are complete files on disk and indexed as such."""
    assert eng.call("store", numbers=ON_DISK)["status"] == [STORED] * 8
    assert eng.call("store", numbers=list(range(8, 24)))["status"] == [STORED] * 16
    wait_until(lambda: d.stats().counters.spills >= 8 and d.stats().write_queue_depth == 0, what="spills")
    assert eng.call("lookup", numbers=ON_DISK)["tiers"] == [DISK] * 8


@pytest.fixture
def daemon():
    d = Daemon(host_capacity="64KiB", disk_capacity="4MiB", extra=["--disk-format", "files"]).start()
    yield d
    d.close()


def _truncate(path: Path) -> None:
    os.truncate(path, HEADER_BYTES + 1000)


@pytest.mark.parametrize("damage, counter, what", [
    pytest.param(lambda p: flip_byte(p, HEADER_BYTES + 100), "checksum_failures", "checksum",
                 id="flipped-payload-byte"),
    pytest.param(_truncate, "io_errors", "short read", id="truncated-file"),
    pytest.param(os.unlink, "io_errors", "No such file", id="file-vanished"),
])
def test_a_damaged_disk_block_fails_alone_is_counted_and_discarded(daemon, damage, counter, what):
    """Scenario: blocks 0-7 are on disk; block 3's file is damaged behind the daemon's back.
    Loading 0-7 reports block 3 FAILED with a message saying why and counts it; the other seven
    load byte-exact from disk. Block 3's target engine block still holds the zeros it had (never
    the damaged bytes), the block is discarded (its file removed; a second load says MISSING and
    a lookup of the chain stops at it), and the daemon keeps serving."""
    with EngineProc(daemon.target) as eng:
        spill_to_disk(daemon, eng)
        path = block_file(daemon.disk_path, eng.hello["namespace"], 3)
        damage(path)

        r = eng.call("load", numbers=ON_DISK)
        assert r["status"] == [LOADED] * 3 + [FAILED] + [LOADED] * 4
        assert r["exact"] == [True] * 3 + [False] + [True] * 4
        assert r["tier"][:3] + r["tier"][4:] == [DISK] * 7
        assert what in r["message"][3] and "discarded" in r["message"][3]
        assert eng.call("read", blocks=[TARGET + 3])["sha256"] == [ZEROS]

        c = daemon.stats().counters
        assert (getattr(c, counter), c.load_failures, c.loads_disk) == (1, 1, 7)
        assert c.checksum_failures + c.io_errors == 1
        assert not path.exists()
        again = eng.call("load", numbers=[3])
        assert again["status"] == [MISSING] and eng.call("read", blocks=[TARGET])["sha256"] == [ZEROS]
        assert eng.call("lookup", numbers=ON_DISK)["prefix"] == 3

        assert eng.call("store", numbers=[3])["status"] == [STORED]  # the engine recomputes and stores it again
        assert eng.call("load", numbers=[3])["exact"] == [True]
    assert daemon.proc.poll() is None and "Traceback" not in daemon.log()


def test_a_damaged_header_is_discarded_by_recovery_at_restart(daemon):
    """Scenario: blocks 0-7 are on disk; the headers of blocks 2, 4 and 6 are damaged (format
    version, hash field, the header's own CRC) while the daemon runs, then it restarts. Recovery
    removes those three files; they are never served (MISSING), the other five come back from
    disk byte-exact, and the disk tier holds exactly five blocks."""
    with EngineProc(daemon.target) as eng:
        ns = eng.hello["namespace"]
        spill_to_disk(daemon, eng)
    damaged = {2: 8, 4: 100, 6: HEADER_BYTES - 2}  # block -> header offset flipped
    for i, offset in damaged.items():
        flip_byte(block_file(daemon.disk_path, ns, i), offset)
    assert daemon.stop() == 0
    daemon.start()

    disk = {t.name: t for t in daemon.stats().tiers}["disk"]
    assert disk.blocks == 5
    assert "recovered 5 blocks (0 torn, 3 corrupt removed)" in daemon.log()
    for i in damaged:
        assert not block_file(daemon.disk_path, ns, i).exists()
    with EngineProc(daemon.target) as eng:
        r = eng.call("load", numbers=ON_DISK)
        assert r["status"] == [LOADED if i not in damaged else MISSING for i in ON_DISK]
        assert r["exact"] == [i not in damaged for i in ON_DISK]
        assert eng.call("read", blocks=[TARGET + i for i in damaged])["sha256"] == [ZEROS] * 3
    assert daemon.proc.poll() is None and "Traceback" not in daemon.log()


class ShortReadIO(PosixIO):
    """PosixIO whose reads of files named in `short` stop halfway, as a read that meets the
    end of the file does: the first half of `out` is filled, then ShortReadError."""

    def __init__(self) -> None:
        super().__init__()
        self.short: set[str] = set()  # hash hex of blocks whose reads come back short
        self.short_reads = 0

    def read_into(self, path: str, offset: int, out) -> None:
        if not any(hx in path for hx in self.short):
            return super().read_into(path, offset, out)
        view = byte_view(out, writable=True)
        got = view.nbytes // 2
        super().read_into(path, offset, view[:got])
        self.short_reads += 1
        raise ShortReadError(path, offset, view.nbytes, got)


async def test_a_short_read_fails_the_block_and_never_reaches_the_engine():
    """Scenario: the in-process server's disk backend returns a short read for block 5 (half its
    payload, then end of file). Over the real socket, Load reports block 5 FAILED ("short
    read") while 0-4 and 6-7 load byte-exact; io_errors counts it, the block is discarded, and
    the engine block it was headed for still holds zeros, not half a payload."""
    workdir = short_tmpdir()
    config = Config(socket_path=str(workdir / "kv.sock"), host_capacity_bytes=16 * BLOCK,
                    disk_path=str(workdir / "disk"), disk_capacity_bytes=64 * BLOCK,
                    writer_threads=2, reader_threads=2, io_backend="posix", disk_format="files")
    os.makedirs(config.disk_path)
    clock = FakeClock()
    io = ShortReadIO()
    pool = ShmKVPool(64, BLOCK)
    try:
        async with running_server(config, clock, cache=BlockCache(config, clock, io=io)) as srv:
            async with AsyncKVClient(config.socket_path, Namespace("m", "float32", 16, "block-contiguous", 0, 1, ""),
                                     pool, client_name="short-read test") as client:
                for batch in (ON_DISK, list(range(8, 24))):
                    for slot, i in enumerate(batch):
                        pool.write_block(slot, content(i))
                    rs = await client.store([h(i) for i in batch], list(range(len(batch))))
                    assert [r.status for r in rs] == [STORED] * len(batch)
                await srv.cache.tiers.drain()
                io.short.add(h(5).hex())
                for k in range(8):
                    pool.write_block(TARGET + k, bytes(BLOCK))

                rs = await client.load([h(i) for i in ON_DISK], [TARGET + k for k in range(8)])
                assert [r.status for r in rs] == [LOADED] * 5 + [FAILED] + [LOADED] * 2
                assert "short read" in rs[5].message
                assert [pool.read_block(TARGET + k) == content(i) for k, i in enumerate(ON_DISK)] == \
                    [i != 5 for i in ON_DISK]
                assert pool.read_block(TARGET + 5) == bytes(BLOCK)
                assert io.short_reads == 1
                c = srv.cache.counters
                assert (c.io_errors, c.checksum_failures, c.load_failures, c.loads_disk) == (1, 0, 1, 7)
                assert [r.status for r in await client.load([h(5)], [TARGET])] == [MISSING]
                assert (await client.lookup([h(i) for i in ON_DISK]))[0] == 5
    finally:
        pool.close()
        pool.unlink()
        shutil.rmtree(workdir, ignore_errors=True)
