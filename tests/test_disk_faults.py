"""Disk tier v2 under faults: a full or read-only filesystem (real, on a small tmpfs), EIO and short
transfers (injected at the segment I/O boundary, the one thing a test cannot make the kernel do
on demand), planted FIFOs and symlinks, crafted metadata rows, and the capacity bound."""

from __future__ import annotations

import errno
import os
import sqlite3
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvservice.checksum import checksum
from kvservice.disk import BlockWrite, DiskStore, FaultKind, aligned_buffer, split_loc
from kvservice.disk import segment
from kvservice.disk.metadata import REC, MetadataError

from test_disk_store import NOW, content, key, open_store, read_back, spill

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def small_fs(tmp_path):
    """mount(size) -> a fresh tmpfs of that size, unmounted afterwards."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        if os.geteuid() != 0:
            pytest.skip("needs root to mount a small tmpfs (ENOSPC / read-only scenarios); CI runs as root")
        mnt = tmp_path / f"fs{len(mounted)}"
        mnt.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mnt)],
                           capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"mount -t tmpfs is not permitted here: {r.stderr.strip()}")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def remount(mnt: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(mnt)], check=True, capture_output=True)


def files_bytes(root: Path) -> tuple[int, int]:
    """(sum of st_size, sum of allocated bytes) of every file under root."""
    size = alloc = 0
    for dirpath, _, names in os.walk(root):
        for n in names:
            st = os.lstat(os.path.join(dirpath, n))
            size += st.st_size
            alloc += st.st_blocks * 512
    return size, alloc


# --- a full filesystem


def test_enospc_growing_a_segment_is_a_per_block_fault_and_lowers_the_ceiling(small_fs):
    """Scenario: --disk-capacity says 64 MiB but the filesystem holds 6 MiB. Spills succeed until
    a new segment file cannot be made: those blocks get NO_SPACE with the OS's message, the tier
    stops growing (reserve refuses, refusal() says why), and every block acknowledged before
    reads back exactly, also after a restart."""
    root = small_fs("6m") / "disk"
    store = open_store(root, 64 * MiB, segment_bytes=MiB)
    good: dict[int, int] = {}
    faults = []
    i = 0
    while not faults and i < 400:
        locs = store.reserve([64 * KiB] * 8)
        if None in locs:
            break
        bufs = [aligned_buffer(64 * KiB) for _ in locs]
        for k, b in enumerate(bufs):
            b[:] = content(i + k, 64 * KiB)
        res = store.write(locs, [BlockWrite("ns", key(i + k), checksum(b)) for k, b in enumerate(bufs)], bufs)
        for k, (loc, f) in enumerate(zip(locs, res)):
            if f is None:
                good[i + k] = loc
            else:
                faults.append(f)
        i += 8
    assert faults and all(f.kind == FaultKind.NO_SPACE for f in faults)
    assert "No space left on device" in faults[0].message and ".kvseg" in faults[0].message
    assert store.reserve([64 * KiB] * 64).count(None) > 0
    assert "ENOSPC" in store.refusal()
    assert store.stats()["faults_no_space"] == len(faults)
    outs, res = read_back(store, list(good.values()), 64 * KiB)
    assert res == [None] * len(good)
    assert all(np.array_equal(o, content(i, 64 * KiB)) for i, o in zip(good, outs))
    store.close()
    store = open_store(root, 64 * MiB, segment_bytes=MiB)
    assert {r.loc for r in store.recovered.records()} == set(good.values())
    store.close()


def test_enospc_in_the_metadata_commit_fails_the_batch_and_loses_nothing_acknowledged(small_fs):
    """Scenario: the segment file exists, then something else fills the filesystem; the data
    writes land in preallocated slots but SQLite cannot grow its WAL: the batch fails NO_SPACE
    ("metadata commit"), its slots are free again, and once space is back spills succeed and a
    restart shows exactly the acknowledged blocks."""
    mnt = small_fs("4m")
    root = mnt / "disk"
    store = open_store(root, 64 * MiB, segment_bytes=2 * MiB)
    locs, res = spill(store, [0], 4 * KiB)
    acked = {0: locs[0]} if res == [None] else {}
    junk = mnt / "junk"
    with open(junk, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC
    failed = []
    for batch in range(40):
        ids = list(range(1 + batch * 64, 1 + (batch + 1) * 64))
        room_before = store.room(4 * KiB)
        locs, res = spill(store, ids, 4 * KiB)
        for i, loc, f in zip(ids, locs, res):
            if f is None:
                acked[i] = loc
            else:
                failed.append(f)
        if failed:
            assert store.room(4 * KiB) >= room_before - sum(r is None for r in res)  # failed slots came back
            break
    assert failed, "the WAL never needed to grow"
    assert all(f.kind == FaultKind.NO_SPACE and "metadata commit failed" in f.message for f in failed)
    junk.unlink()
    locs, res = spill(store, [10_000], 4 * KiB)
    assert res == [None]
    acked[10_000] = locs[0]
    store.close()
    store = open_store(root, 64 * MiB, segment_bytes=2 * MiB)
    recs = {r.loc: r for r in store.recovered.records()}
    assert set(recs) == set(acked.values())
    outs, res = read_back(store, list(acked.values()), 4 * KiB)
    assert res == [None] * len(acked)
    assert all(np.array_equal(o, content(i, 4 * KiB)) for i, o in zip(acked, outs))
    store.close()


# --- a read-only filesystem


def test_a_read_only_filesystem_serves_reads_and_refuses_writes(small_fs):
    """Scenario: the disk is remounted read-only between runs. The store opens, every block
    reads back exactly, reservations are refused with a message that says why, frees and
    deadline changes do not raise, and after a read-write remount the blocks are all there."""
    mnt = small_fs("16m")
    root = mnt / "disk"
    store = open_store(root)
    locs, res = spill(store, list(range(20)), 64 * KiB, deadline=NOW + 60)
    assert res == [None] * 20
    store.close()
    remount(mnt, "ro")
    try:
        store = open_store(root)
        assert store.readonly and len(store.recovered) == 20
        outs, res = read_back(store, locs, 64 * KiB)
        assert res == [None] * 20 and all(np.array_equal(o, content(i, 64 * KiB)) for i, o in enumerate(outs))
        assert store.reserve([64 * KiB] * 3) == [None] * 3
        assert "read-only" in store.refusal()
        assert store.room(64 * KiB) == 0
        store.free(locs[:2])
        store.set_deadline(locs[3], NOW + 999)
        store.close()
    finally:
        remount(mnt, "rw")
    store = open_store(root)
    assert len(store.recovered) == 20 and not store.readonly
    store.close()


def test_a_filesystem_gone_read_only_while_running_fails_spills_as_read_only(tmp_path, monkeypatch):
    """Scenario: the filesystem turns read-only under a running daemon (ext4 errors=remount-ro).
    Linux refuses a manual remount while the tier holds files open for writing, so the EROFS is
    injected at the write syscall. Spills fail READ_ONLY with the OS's message, their slots come
    back, and the blocks written before still read exactly."""
    store = open_store(tmp_path / "disk")
    before, _ = spill(store, list(range(8)), 64 * KiB)
    room = store.room(64 * KiB)

    def erofs(fd, bufs, offset):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(segment, "os_pwritev", erofs)
    locs, res = spill(store, list(range(8, 16)), 64 * KiB)
    assert all(f is not None and f.kind == FaultKind.READ_ONLY and "Read-only file system" in f.message for f in res)
    assert store.room(64 * KiB) == room
    outs, res = read_back(store, before, 64 * KiB)
    assert res == [None] * 8 and all(np.array_equal(o, content(i, 64 * KiB)) for i, o in enumerate(outs))
    store.close()
    store = open_store(tmp_path / "disk")
    assert {r.loc for r in store.recovered.records()} == set(before)
    store.close()


# --- EIO and short transfers (injected at the I/O boundary)


def test_eio_on_read_fails_only_the_blocks_of_that_request(tmp_path, monkeypatch):
    store = open_store(tmp_path / "disk", segment_bytes=MiB)
    locs, _ = spill(store, list(range(32)), 64 * KiB)  # two segment files of 16 slots
    sick = store._files[split_loc(locs[0])[0]]
    real = segment.os_preadv

    def eio(fd, bufs, offset):
        if fd in (sick.fd, sick.dfd):
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, bufs, offset)

    monkeypatch.setattr(segment, "os_preadv", eio)
    outs, res = read_back(store, locs, 64 * KiB)
    bad = [i for i, f in enumerate(res) if f is not None]
    assert bad == list(range(16))
    assert all(res[i].kind == FaultKind.IO_ERROR and "Input/output error" in res[i].message
               and sick.path in res[i].message for i in bad)
    assert all(np.array_equal(outs[i], content(i, 64 * KiB)) for i in range(16, 32))
    assert store.stats()["faults_io_error"] == 16
    store.close()


def test_short_read_and_short_write_are_short_io_faults(tmp_path, monkeypatch):
    store = open_store(tmp_path / "disk")
    locs, _ = spill(store, [1, 2], 64 * KiB)
    monkeypatch.setattr(segment, "os_preadv", lambda fd, bufs, off: 0)  # end of file at once
    _, res = read_back(store, locs, 64 * KiB)
    assert all(f.kind == FaultKind.SHORT_IO and "short read" in f.message for f in res)
    monkeypatch.undo()

    real = segment.os_pwritev
    calls = []

    def half_then_nothing(fd, bufs, offset):
        calls.append(1)
        if len(calls) == 1:
            return real(fd, [bufs[0][: bufs[0].nbytes // 2]], offset)
        return 0

    monkeypatch.setattr(segment, "os_pwritev", half_then_nothing)
    new, res = spill(store, [3], 64 * KiB)
    assert res[0].kind == FaultKind.SHORT_IO and "short write" in res[0].message
    monkeypatch.undo()
    store.close()
    store = open_store(tmp_path / "disk")
    assert {r.loc for r in store.recovered.records()} == set(locs)  # the torn write left no row
    store.close()


# --- planted files


def test_a_fifo_in_place_of_a_segment_is_refused_without_hanging(tmp_path):
    """Scenario: someone replaced a segment file with a FIFO and planted another FIFO under a
    segment name: open neither waits nor reads; the FIFOs are removed, the blocks of that segment
    are dropped (counted), the other segments load, and new spills work."""
    root = tmp_path / "disk"
    store = open_store(root, segment_bytes=MiB)
    locs, _ = spill(store, list(range(20)), 64 * KiB)  # segments 1 (16 blocks) and 2 (4)
    victim = Path(store._files[1].path)
    store.close()
    victim.unlink()
    os.mkfifo(victim)
    stray = root / segment.segment_name(77, 4096)
    os.mkfifo(stray)
    store = open_store(root, segment_bytes=MiB)
    assert any(str(victim) in u and "not a regular file" in u for u in store.recovered.unsafe_files)
    assert any(str(stray) in u for u in store.recovered.unsafe_files)
    assert not victim.exists() and not stray.exists()
    assert {r.loc for r in store.recovered.records()} == set(locs[16:])
    outs, res = read_back(store, locs[16:], 64 * KiB)
    assert res == [None] * 4 and all(np.array_equal(o, content(16 + k, 64 * KiB)) for k, o in enumerate(outs))
    _, res = spill(store, [500], 64 * KiB)
    assert res == [None]
    store.close()


def test_a_symlinked_segment_or_database_is_never_followed(tmp_path):
    """Scenario: a segment file is replaced by a symlink to a same-sized copy outside the disk
    path: it is refused (its blocks dropped), the outside file is neither read nor changed. A
    symlinked metadata database refuses to open with a message."""
    root = tmp_path / "disk"
    store = open_store(root, segment_bytes=MiB)
    locs, _ = spill(store, list(range(4)), 64 * KiB)
    seg = Path(store._files[1].path)
    store.close()
    outside = tmp_path / "outside.bin"
    outside.write_bytes(seg.read_bytes())
    before = outside.stat()
    seg.unlink()
    seg.symlink_to(outside)
    store = open_store(root, segment_bytes=MiB)
    assert len(store.recovered) == 0 and any("not a regular file" in u for u in store.recovered.unsafe_files)
    assert not seg.is_symlink() and outside.read_bytes()[:16] and outside.stat().st_mtime == before.st_mtime
    store.close()

    db = root / "meta.sqlite3"
    real = tmp_path / "real.sqlite3"
    os.replace(db, real)
    db.symlink_to(real)
    with pytest.raises(MetadataError, match="not a regular file"):
        open_store(root)


# --- crafted metadata


def _edit_row(root: Path, loc: int, **fields) -> None:
    db = sqlite3.connect(root / "meta.sqlite3")
    (blob,) = db.execute("select rec from blocks where loc=?", (loc,)).fetchone()
    rec = np.frombuffer(blob, REC).copy()
    for name, value in fields.items():
        rec[name] = value
    db.execute("update blocks set rec=? where loc=?", (rec.tobytes(), loc))
    db.commit()
    db.close()


def test_a_wrong_size_slot_is_a_wrong_size_fault_not_an_error(tmp_path):
    """Scenario: a row says a slot holds 1000 bytes where the namespace's blocks are 4 KiB (and
    another claims more than its slot): the first loads as WRONG_SIZE with both sizes in the
    message, the batch's other blocks load; the second is dropped at open."""
    root = tmp_path / "disk"
    store = open_store(root)
    locs, _ = spill(store, [1, 2, 3], 4 * KiB)
    store.close()
    _edit_row(root, locs[0], length=1000)
    _edit_row(root, locs[2], length=8192)
    store = open_store(root)
    assert store.recovered.dropped_rows == 1 and len(store.recovered) == 2
    outs, res = read_back(store, locs[:2], 4 * KiB)
    assert res[0].kind == FaultKind.WRONG_SIZE and "1000-byte" in res[0].message and "4096 bytes" in res[0].message
    assert res[1] is None and np.array_equal(outs[1], content(2, 4 * KiB))
    store.close()


def test_a_deadline_beyond_max_ttl_is_clamped_on_load_and_stays_clamped(tmp_path):
    root = tmp_path / "disk"
    store = open_store(root)
    locs, _ = spill(store, [1, 2], 4 * KiB, deadline=NOW + 60)
    store.set_deadline(locs[1], NOW + 120)  # an override, folded in at open
    store.close()
    _edit_row(root, locs[0], deadline=32_503_680_000.0)  # the year 3000
    store = open_store(root, max_ttl_seconds=3600)
    recs = {r.loc: r for r in store.recovered.records()}
    assert recs[locs[0]].deadline == NOW + 3600 and store.recovered.clamped_deadlines == 1
    assert recs[locs[1]].deadline == NOW + 120
    store.close()
    store = open_store(root, max_ttl_seconds=3600)
    recs = {r.loc: r for r in store.recovered.records()}
    assert recs[locs[0]].deadline == NOW + 3600 and store.recovered.clamped_deadlines == 0
    assert recs[locs[1]].deadline == NOW + 120
    store.close()


# --- capacity


@pytest.mark.parametrize("capacity", [3 * MiB, 24 * MiB])
def test_files_under_the_disk_path_never_exceed_the_capacity(tmp_path, capacity):
    """Scenario: blocks of three sizes fill the tier, then churn (free a third, refill) for a
    while; after every step the files under the disk path - segments, database, WAL, shared
    memory - sum to at most the capacity, counted as sizes and as allocated blocks."""
    root = tmp_path / "disk"
    store = open_store(root, capacity, segment_bytes=MiB)
    rng = np.random.default_rng(3)
    live: list[int] = []
    sizes = [4 * KiB, 64 * KiB, 100_000]
    i = 0
    for step in range(60):
        n = int(rng.choice(sizes))
        want = int(rng.integers(1, 24))
        locs = [loc for loc in store.reserve([n] * want) if loc is not None]
        bufs = [aligned_buffer(n) for _ in locs]
        res = store.write(locs, [BlockWrite(f"ns{n}", key(i + k), checksum(b)) for k, b in enumerate(bufs)], bufs)
        assert res == [None] * len(locs)
        live += locs
        i += len(locs)
        if len(locs) < want:  # full: churn
            drop = rng.choice(len(live), size=max(1, len(live) // 3), replace=False)
            store.free([live[j] for j in drop])
            live = [loc for j, loc in enumerate(live) if j not in set(drop.tolist())]
        size, alloc = files_bytes(root)
        assert size <= capacity and alloc <= capacity, (step, size, alloc, capacity)
        assert store.committed_bytes() <= capacity
    assert i > 0
    store.close()
    size, alloc = files_bytes(root)
    assert size <= capacity and alloc <= capacity
