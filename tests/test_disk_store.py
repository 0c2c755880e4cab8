"""Disk tier v2 (kvservice.disk) against real files: layout, reuse, restart, crash consistency."""

from __future__ import annotations

import hashlib
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from kvservice.checksum import checksum
from kvservice.disk import ALIGN, BlockWrite, DiskStore, FaultKind, aligned_buffer, make_loc, split_loc
from kvservice.disk import batch_io, segment
from kvservice.disk.metadata import MetadataError
from kvservice.disk.slots import SlotAllocator, slot_class

REPO = Path(__file__).resolve().parents[1]
KiB, MiB = 1 << 10, 1 << 20
NOW = 1_800_000_000.0


def key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


def content(i: int, n: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)


def spill(store: DiskStore, ids: list[int], n: int, *, ns: str = "ns", deadline: float = 0.0,
          aligned: bool = True) -> tuple[list[int], list]:
    """Reserve and write blocks `ids` of n bytes; returns (locs, faults)."""
    locs = store.reserve([n] * len(ids))
    assert all(loc is not None for loc in locs)
    bufs = []
    for i in ids:
        b = aligned_buffer(n) if aligned else np.empty(n + 1, dtype=np.uint8)[1:]
        b[:] = content(i, n)
        bufs.append(b)
    blocks = [BlockWrite(ns, key(i), checksum(b), deadline=deadline, stored_at=NOW + i) for i, b in zip(ids, bufs)]
    return locs, store.write(locs, blocks, bufs)


def read_back(store: DiskStore, locs: list[int], n: int) -> tuple[list[np.ndarray], list]:
    outs = [aligned_buffer(n) for _ in locs]
    return outs, store.read(locs, outs)


def open_store(root: Path, capacity: int = 64 * MiB, **kw) -> DiskStore:
    kw.setdefault("segment_bytes", 4 * MiB)
    kw.setdefault("now", lambda: NOW)
    return DiskStore(str(root), capacity, **kw)


def test_blocks_round_trip_across_a_restart_with_their_metadata(tmp_path):
    """Scenario: aligned 64 KiB blocks, odd-sized blocks from unaligned buffers and a retained
    block are spilled; after close and reopen every block comes back byte-exact with its key,
    length, CRC32C and deadline, from the metadata alone."""
    store = open_store(tmp_path / "disk")
    locs_a, faults = spill(store, list(range(40)), 64 * KiB)
    assert faults == [None] * 40
    locs_b, faults = spill(store, [100, 101, 102], 10_000, aligned=False, deadline=NOW + 3600)
    assert faults == [None] * 3
    assert {split_loc(loc)[0] for loc in locs_a}.isdisjoint({split_loc(loc)[0] for loc in locs_b})  # classes
    store.close()

    store = open_store(tmp_path / "disk")
    recs = {r.loc: r for r in store.recovered.records()}
    assert len(recs) == 43
    assert recs[locs_b[0]].deadline == NOW + 3600 and recs[locs_a[0]].deadline == 0.0
    assert recs[locs_a[5]].hash == key(5) and recs[locs_a[5]].namespace == "ns"
    assert recs[locs_b[1]].length == 10_000 and recs[locs_b[1]].crc == checksum(content(101, 10_000))
    outs, faults = read_back(store, locs_a, 64 * KiB)
    assert faults == [None] * 40
    assert all(np.array_equal(o, content(i, 64 * KiB)) for i, o in enumerate(outs))
    outs = [np.zeros(10_000, dtype=np.uint8) for _ in locs_b]
    assert store.read(locs_b, outs) == [None] * 3
    assert all(np.array_equal(o, content(100 + k, 10_000)) for k, o in enumerate(outs))
    store.close()


def test_a_batch_becomes_few_large_requests_of_adjacent_slots(tmp_path):
    """Scenario: 64 adjacent aligned 1 MiB blocks plan as 4 direct requests of 16 MiB whose iovecs
    are the caller's buffers; an unaligned buffer breaks out into a request of its own that
    bounces through an aligned staging buffer (still direct); an odd-sized block is buffered."""
    store = open_store(tmp_path / "disk", 256 * MiB, segment_bytes=128 * MiB)
    locs = store.reserve([MiB] * 64)
    assert [split_loc(loc)[1] for loc in locs] == list(range(64))  # lowest free first: adjacent
    store._create_planned({split_loc(locs[0])[0]})
    files = dict(store._files)
    bufs = [aligned_buffer(MiB) for _ in locs]
    runs = batch_io.plan(list(zip(range(64), locs, bufs)), files, 16 * MiB, reading=False)
    direct = files[split_loc(locs[0])[0]].dfd is not None
    assert len(runs) == 4 and all(r.nbytes == 16 * MiB and r.direct == direct for r in runs)
    assert all(v is bufs[i] for r in runs for i, v in zip(r.blocks, r.views))  # no copies
    unaligned = np.empty(MiB + 1, dtype=np.uint8)[1:]
    runs = batch_io.plan([(0, locs[0], bufs[0]), (1, locs[1], unaligned), (2, locs[2], bufs[2])], files,
                         16 * MiB, reading=False)
    assert [(r.direct, r.bounce) for r in runs] == ([(True, False), (True, True), (True, False)] if direct
                                                    else [(False, False)])
    odd = np.empty(MiB - 100, dtype=np.uint8)
    runs = batch_io.plan([(0, locs[0], odd)], files, 16 * MiB, reading=False)
    assert [(r.direct, len(r.views)) for r in runs] == [(False, 2)]  # data + pad iovec
    store.cancel(locs)
    store.close()


def test_freed_slots_are_reused_only_after_their_delete_commits():
    """Scenario: a retired slot stays out of the free list (its row may still be on disk) until
    settle() says the delete committed; then the next allocation gets it back, lowest first."""
    alloc = SlotAllocator(lambda slots, nbytes: nbytes <= 8 * 4096, segment_target=4 * 4096)
    locs = alloc.allocate(4096, 6)
    assert [split_loc(loc) for loc in locs] == [(1, 0), (1, 1), (1, 2), (1, 3), (2, 0), (2, 1)]
    assert alloc.allocate(4096, 3) is None  # 8 slots in the budget, 6 used: all or nothing
    alloc.retire(locs[:2])
    assert alloc.allocate(4096, 2) == [make_loc(2, 2), make_loc(2, 3)]
    assert alloc.allocate(4096, 1) is None  # the retired two are quarantined
    alloc.settle(locs[:2])
    assert alloc.allocate(4096, 2) == locs[:2]
    alloc.release([make_loc(2, 3)])  # a write that never committed: free at once
    assert alloc.allocate(4096, 1) == [make_loc(2, 3)]


def test_a_quarantined_slot_is_reserved_pending_and_never_handed_out_free():
    """Scenario: with no free slot and no budget left, allocate_retired hands out a quarantined
    slot (lowest first) as pending; plain allocate still refuses it; a pending reservation that
    is cancelled goes back to the quarantine, not the free list; once the delete commits
    (settle) a pending slot is an ordinary reservation and the used count is unchanged."""
    alloc = SlotAllocator(lambda slots, nbytes: nbytes <= 4 * 4096, segment_target=4 * 4096)
    locs = alloc.allocate(4096, 4)
    alloc.retire([locs[2], locs[1]])
    assert alloc.allocate(4096, 1) is None and alloc.quarantined() == 2
    assert alloc.allocate_retired(4096, 3) is None  # two quarantined, no free: all or nothing
    got = alloc.allocate_retired(4096, 1)
    assert got == [locs[1]] and alloc.pending(locs[1]) and not alloc.pending(locs[2])
    assert alloc.quarantined() == 1 and alloc.segments[1].used == 4
    alloc.release(got)  # the write never happened: its old row may still be on disk
    assert not alloc.pending(locs[1]) and alloc.quarantined() == 2 and alloc.allocate(4096, 1) is None
    assert alloc.allocate_retired(4096, 2) == [locs[1], locs[2]]
    alloc.settle([locs[1], locs[2]])
    assert not alloc.pending(locs[1]) and alloc.quarantined() == 0 and alloc.segments[1].used == 4
    assert alloc.allocate(4096, 1) is None  # both are reservations now, not free slots
    alloc.release([locs[1]])
    assert alloc.allocate(4096, 1) == [locs[1]]


def test_slot_states_stay_consistent_under_random_reuse():
    """Scenario: a random mix of allocations (plain and reusing quarantined slots), cancels,
    retirements and delete commits on a small full-ish tier, checked against a model after every
    step: a slot is free, held (written or reserved), quarantined or pending - never two at once;
    only free slots are handed out by allocate, pending ones only from the quarantine; every
    segment's used count and the running totals match."""
    import random

    rng = random.Random(13)
    alloc = SlotAllocator(lambda slots, nbytes: nbytes <= 24 * 4096, segment_target=4 * 4096)
    held: set[int] = set()  # reserved or committed, no delete queued
    quarantined: set[int] = set()
    pending: set[int] = set()
    for _ in range(2000):
        op = rng.random()
        if op < 0.3:
            k = rng.randint(1, 4)
            got = alloc.allocate_retired(4096, k) if rng.random() < 0.5 else alloc.allocate(4096, k)
            for seg in alloc.planned():  # their files are made by the first write
                alloc.created(seg.id)
            if got is not None:
                assert len(set(got)) == k and not set(got) & held and not set(got) & pending
                for loc in got:
                    if loc in quarantined:
                        pending.add(loc)
                    held.add(loc)
        elif op < 0.5 and held - pending:
            loc = rng.choice(sorted(held - pending))
            held.discard(loc)
            quarantined.add(loc)
            alloc.retire([loc])
        elif op < 0.7 and quarantined:
            done = rng.sample(sorted(quarantined), rng.randint(1, len(quarantined)))
            alloc.settle(done)
            for loc in done:
                quarantined.discard(loc)
                pending.discard(loc)  # a pending reservation is a plain one now
        elif held:
            loc = rng.choice(sorted(held))
            alloc.release([loc])  # a write that never committed
            held.discard(loc)
            if loc in pending:
                pending.discard(loc)  # back to the quarantine
        for loc in held - pending:
            assert not alloc.pending(loc)
        assert all(alloc.pending(loc) for loc in pending)
        assert alloc.quarantined() == len(quarantined - pending)
        for sid, seg in alloc.segments.items():
            mine = {loc for loc in held | quarantined if split_loc(loc)[0] == sid}
            assert seg.used == len(mine), (sid, seg.used, len(mine))
        assert {s.id for s in alloc.reclaimable()} == {s.id for s in alloc.segments.values() if s.on_disk and s.used == 0}
        assert alloc.segment_bytes == sum(s.nbytes for s in alloc.segments.values())
        assert alloc.total_slots == sum(s.slots for s in alloc.segments.values())


def test_a_full_tier_reuses_a_freed_slot_committing_its_delete_before_the_write(tmp_path, monkeypatch):
    """Scenario: a full tier frees a block and reserves its slot at once (no metadata commit on the
    reserving thread); the write commits the old row's delete before any byte lands, so a restart
    shows the new block there, byte-exact, and never the old key. When that delete cannot commit
    (MetadataError injected at the SQLite boundary: a failing commit cannot be caused reliably on
    a real filesystem here), the block is a per-block fault, the slot's old bytes are untouched and
    the old key still reads back exact after a restart."""
    root = tmp_path / "disk"
    store = open_store(root, 6 * MiB, segment_bytes=MiB)
    n = store.room(256 * KiB)
    locs, res = spill(store, list(range(n)), 256 * KiB)
    assert res == [None] * n and store.reserve([256 * KiB]) == [None]
    commits = []
    real_commit = store._meta.commit
    monkeypatch.setattr(store, "_pool", _NoBackground(store._pool))  # keep free()'s background commit from racing
    monkeypatch.setattr(store._meta, "commit", lambda **kw: (commits.append(kw), real_commit(**kw))[1])
    store.free([locs[0]])
    again = store.reserve([256 * KiB])
    assert again == [locs[0]] and not commits  # reserved before the delete committed
    _, res = spill_at(store, again, [1000], 256 * KiB)
    assert res == [None]
    assert any(locs[0] in list(c.get("deletes", ())) for c in commits[:1])  # the delete came first
    # the delete cannot commit: the next reuse is refused per block, nothing written
    def failing(**kw):
        if list(kw.get("deletes", ())):
            raise MetadataError("injected: database is locked")
        return real_commit(**kw)
    monkeypatch.setattr(store._meta, "commit", failing)
    store.free([locs[1]])
    again = store.reserve([256 * KiB])
    assert again == [locs[1]]
    _, res = spill_at(store, again, [2000], 256 * KiB)
    assert res[0] is not None and res[0].kind == FaultKind.IO_ERROR and "did not commit" in res[0].message
    assert store.reserve([256 * KiB]) == [locs[1]]  # back in the quarantine, reservable again (pending)
    store.cancel([locs[1]])
    monkeypatch.undo()
    store._deletes.remove(locs[1])  # the crash: the delete of locs[1] never reaches the database
    store.close()
    store = open_store(root, 6 * MiB, segment_bytes=MiB)
    recs = {r.loc: int.from_bytes(r.hash[:8], "little") for r in store.recovered.records()}
    assert recs[locs[0]] == _key_id(1000) and recs[locs[1]] == _key_id(1)
    outs, res = read_back(store, [locs[0], locs[1]], 256 * KiB)
    assert res == [None, None]
    assert np.array_equal(outs[0], content(1000, 256 * KiB)) and np.array_equal(outs[1], content(1, 256 * KiB))
    store.close()


class _NoBackground:
    """The store's I/O pool, minus the background metadata commits free() submits."""

    def __init__(self, pool) -> None:
        self._inner = pool

    def submit(self, fn, *a, **k):
        if getattr(fn, "__name__", "") == "_background_flush":
            import concurrent.futures
            f = concurrent.futures.Future()
            f.set_result(None)
            with fn.__self__._lock:
                fn.__self__._flushing = False
            return f
        return self._inner.submit(fn, *a, **k)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _key_id(i: int) -> int:
    return int.from_bytes(key(i)[:8], "little")


def spill_at(store: DiskStore, locs: list[int], ids: list[int], n: int) -> tuple[list[int], list]:
    bufs = []
    for i in ids:
        b = aligned_buffer(n)
        b[:] = content(i, n)
        bufs.append(b)
    return locs, store.write(locs, [BlockWrite("ns", key(i), checksum(b), stored_at=NOW + i) for i, b in zip(ids, bufs)], bufs)


def test_an_empty_segment_of_another_class_gives_its_budget_back(tmp_path):
    """Scenario: the tier is full of 64 KiB segments; once their blocks are freed, a 1 MiB spill
    gets room because the empty segment files are removed."""
    capacity = 8 * MiB
    store = open_store(tmp_path / "disk", capacity, segment_bytes=2 * MiB)
    locs = store.reserve([64 * KiB] * 200)
    got = [loc for loc in locs if loc is not None]
    assert 0 < len(got) < 200  # as many as fit
    store.cancel(got)
    locs, faults = spill(store, list(range(len(got))), 64 * KiB)
    assert store.reserve([MiB]) == [None]
    store.free(locs)
    store.flush()
    big = store.reserve([MiB] * 3)
    assert all(loc is not None for loc in big)
    assert store.committed_bytes() <= capacity
    store.cancel(big)
    store.close()


def test_reserve_places_as_many_blocks_as_fit(tmp_path):
    """Scenario: a batch larger than the free room gets slots for its first blocks only, and
    room() said beforehand how many would fit."""
    store = open_store(tmp_path / "disk", 6 * MiB, segment_bytes=MiB)
    room = store.room(256 * KiB)
    locs = store.reserve([256 * KiB] * 40)
    placed = [loc for loc in locs if loc is not None]
    assert 0 < len(placed) == room < 40
    assert locs[:len(placed)] == placed
    store.close()


def test_the_same_key_written_twice_restarts_with_the_newer_copy(tmp_path):
    """Scenario: a crash between a rewrite and the delete of the old copy leaves two rows for a key;
    the reopened store keeps the later write and deletes the older row."""
    store = open_store(tmp_path / "disk")
    old, _ = spill(store, [7], 8 * KiB)
    locs = store.reserve([8 * KiB])
    buf = aligned_buffer(8 * KiB)
    buf[:] = 9
    assert store.write(locs, [BlockWrite("ns", key(7), checksum(buf))], [buf]) == [None]
    store.close()
    store = open_store(tmp_path / "disk")
    assert len(store.recovered) == 1 and store.recovered.duplicate_rows == 1
    assert next(store.recovered.records()).loc == locs[0]
    out, faults = read_back(store, locs, 8 * KiB)
    assert faults == [None] and np.array_equal(out[0], buf)
    store.close()


def test_a_smaller_capacity_at_restart_drops_segments_until_it_fits(tmp_path):
    """Scenario: the operator lowers the capacity between runs; the newest segment files go (their
    blocks dropped, counted) until files plus metadata fit, and the rest still load exactly."""
    store = open_store(tmp_path / "disk", 64 * MiB, segment_bytes=4 * MiB)
    spill(store, list(range(200)), 64 * KiB)  # 12.5 MiB: four segment files
    store.close()
    store = open_store(tmp_path / "disk", 10 * MiB, segment_bytes=4 * MiB)
    assert store.recovered.segments_dropped >= 2
    assert store.committed_bytes() <= 10 * MiB
    left = list(store.recovered.records())
    outs, faults = read_back(store, [r.loc for r in left], 64 * KiB)
    assert faults == [None] * len(left)
    index = {key(i): i for i in range(200)}
    assert all(np.array_equal(o, content(index[r.hash], 64 * KiB)) for o, r in zip(outs, left))
    store.close()
    assert sum(p.stat().st_size for p in (tmp_path / "disk").iterdir()) <= 10 * MiB


def test_an_orphan_segment_file_from_a_crash_is_removed(tmp_path):
    """Scenario: a segment file exists whose row never committed (kill -9 right after it was made):
    the next open removes it."""
    store = open_store(tmp_path / "disk")
    spill(store, [1], 64 * KiB)
    store.close()
    orphan = tmp_path / "disk" / segment.segment_name(99, 4096)
    orphan.write_bytes(b"\0" * 8192)
    store = open_store(tmp_path / "disk")
    assert store.recovered.orphans_removed == 1 and not orphan.exists() and len(store.recovered) == 1
    store.close()


def test_o_direct_refused_by_the_filesystem_falls_back_to_buffered_io(tmp_path, monkeypatch):
    """Scenario: a filesystem that refuses O_DIRECT (EINVAL at open, as tmpfs did before Linux 6.6)
    is used through the buffered descriptor; the bytes are the same."""
    real = segment.os_open

    def no_direct(path, flags, *mode):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real(path, flags, *mode)

    monkeypatch.setattr(segment, "os_open", no_direct)
    store = open_store(tmp_path / "disk")
    locs, faults = spill(store, list(range(8)), 64 * KiB)
    assert faults == [None] * 8 and all(f.dfd is None for f in store._files.values())
    outs, faults = read_back(store, locs, 64 * KiB)
    assert faults == [None] * 8 and all(np.array_equal(o, content(i, 64 * KiB)) for i, o in enumerate(outs))
    store.close()


def test_a_damaged_slot_is_a_checksum_fault(tmp_path):
    store = open_store(tmp_path / "disk")
    locs, _ = spill(store, [1, 2, 3], 64 * KiB)
    f = store._files[split_loc(locs[1])[0]]
    with open(f.path, "r+b") as fh:
        fh.seek(f.offset(split_loc(locs[1])[1]) + 777)
        fh.write(b"\xff")
    os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)
    outs, faults = read_back(store, locs, 64 * KiB)
    assert faults[0] is None and faults[2] is None
    assert faults[1].kind == FaultKind.CHECKSUM and "fails its checksum" in faults[1].message
    assert store.stats()["faults_checksum"] == 1
    store.close()


def test_a_damaged_slot_read_into_host_slots_is_a_checksum_fault(tmp_path):
    """The same through HostSlots (the daemon's read into its arena), at the sizes whose check runs
    with the GIL released (64 KiB) and below it (4 KiB): only the damaged block faults."""
    from kvservice.disk.batch_io import HostSlots
    for size in (64 * KiB, 4 * KiB):
        store = open_store(tmp_path / f"disk-{size}")
        locs, _ = spill(store, [1, 2, 3], size)
        f = store._files[split_loc(locs[1])[0]]
        with open(f.path, "r+b") as fh:
            fh.seek(f.offset(split_loc(locs[1])[1]) + size - 5)
            fh.write(b"\x00\xff")
        os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        out = aligned_buffer(3 * size)
        faults = store.read(locs, HostSlots(out, np.arange(3, dtype=np.int64) * size, np.full(3, size, np.int64)))
        assert faults[0] is None and faults[2] is None, faults
        assert faults[1].kind == FaultKind.CHECKSUM and "fails its checksum" in faults[1].message
        assert np.array_equal(out[:size], content(1, size)) and np.array_equal(out[2 * size:], content(3, size))
        store.close()


# --- crash consistency: real kill -9 of a writer process

_WRITER = textwrap.dedent("""
    import hashlib, os, signal, sys, time
    import numpy as np
    sys.path.insert(0, {repo!r})
    from kvservice.checksum import checksum
    from kvservice.disk import BlockWrite, DiskStore, aligned_buffer
    from kvservice.disk import metadata
    root, start, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    store = DiskStore(root, 48 << 20, segment_bytes=4 << 20)
    n = 16 << 10
    def block(i):
        b = aligned_buffer(n)
        b.view(np.uint64)[:] = np.arange(i * n // 8, (i + 1) * n // 8, dtype=np.uint64)
        return b
    if mode == "die-before-commit":  # data written, then killed before its metadata commit
        live = [r.loc for r in store.recovered.records()]
        freed = 0
        locs = store.reserve([n] * 8)
        while None in locs:  # the storm left the store full: free the oldest blocks first, as the storm does
            store.cancel([l for l in locs if l is not None])
            store.free(live[:64]); freed += len(live[:64]); live = live[64:]
            locs = store.reserve([n] * 8)
        print("freed", freed, flush=True)
        bufs = [block(start + k) for k in range(8)]
        real = metadata.Metadata.commit
        def die(self, **kw):
            if kw.get("puts"):
                os.kill(os.getpid(), signal.SIGKILL)
            return real(self, **kw)
        metadata.Metadata.commit = die
        store.write(locs, [BlockWrite("ns", (start + k).to_bytes(32, "little"), checksum(b)) for k, b in enumerate(bufs)], bufs)
    live = [r.loc for r in store.recovered.records()]
    i = start
    print("ready", flush=True)
    while True:  # a spill storm: batches of new blocks, freeing old ones so slots are reused
        k = 1 + i % 13
        locs = [l for l in store.reserve([n] * k) if l is not None]
        if len(locs) < k:
            store.free(live[:64]); live = live[64:]; store.cancel(locs); continue
        bufs = [block(i + j) for j in range(k)]
        res = store.write(locs, [BlockWrite("ns", (i + j).to_bytes(32, "little"), checksum(b)) for j, b in enumerate(bufs)], bufs)
        assert res == [None] * k, res
        live += locs
        i += k
""")


def _verify_all(root: Path) -> int:
    """Every recovered block reads without fault and holds exactly its own pattern."""
    store = DiskStore(str(root), 48 << 20, segment_bytes=4 << 20)
    recs = list(store.recovered.records())
    n = 16 << 10
    outs = [aligned_buffer(n) for _ in recs]
    faults = store.read([r.loc for r in recs], outs)
    assert faults == [None] * len(recs), [f for f in faults if f][:3]
    for r, o in zip(recs, outs):
        i = int.from_bytes(r.hash, "little")
        assert np.array_equal(o.view(np.uint64), np.arange(i * n // 8, (i + 1) * n // 8, dtype=np.uint64)), i
    store.close()
    return len(recs)


def test_kill_during_the_data_write_loses_the_spill_never_maps_unwritten_bytes(tmp_path):
    """Scenario: a writer is killed after its data write, before the metadata commit: on restart the
    spill is simply absent (never a key naming bytes that were not committed), earlier blocks exact."""
    root = tmp_path / "disk"
    script = tmp_path / "writer.py"
    script.write_text(_WRITER.format(repo=str(REPO)))
    first = subprocess.Popen([sys.executable, str(script), str(root), "0", "storm"], stdout=subprocess.PIPE)
    assert first.stdout.readline().strip() == b"ready"
    time.sleep(0.5)
    first.send_signal(signal.SIGKILL)
    first.wait()
    before = _verify_all(root)
    second = subprocess.run([sys.executable, str(script), str(root), str(10**9), "die-before-commit"], timeout=60,
                            stdout=subprocess.PIPE)
    assert second.returncode == -signal.SIGKILL
    # a storm killed with the store full leaves no free slot: the writer freed its oldest blocks first (their
    # deletes commit before a byte lands in a reused slot), so those are gone too, and only those
    freed = int(second.stdout.split()[1])
    store = DiskStore(str(root), 48 << 20, segment_bytes=4 << 20)
    hashes = {int.from_bytes(r.hash, "little") for r in store.recovered.records()}
    store.close()
    assert not any(h >= 10**9 for h in hashes) and len(hashes) == before - freed
    assert _verify_all(root) == before - freed


def test_kill_9_during_a_spill_storm_ten_cycles_zero_wrong_bytes(tmp_path):
    """Scenario: ten times, a process spilling batches (and freeing old blocks, so slots are reused)
    is killed with SIGKILL at a random moment; after each, every block the store recovers reads back
    exactly its own bytes, and no read faults (no torn slot is ever served)."""
    root = tmp_path / "disk"
    script = tmp_path / "writer.py"
    script.write_text(_WRITER.format(repo=str(REPO)))
    rng = np.random.default_rng(13)
    start = 0
    total = 0
    for cycle in range(10):
        p = subprocess.Popen([sys.executable, str(script), str(root), str(start), "storm"], stdout=subprocess.PIPE)
        assert p.stdout.readline().strip() == b"ready"
        time.sleep(float(rng.uniform(0.05, 0.6)))
        p.send_signal(signal.SIGKILL)
        p.wait()
        total = _verify_all(root)
        start += 10**6
    assert total > 0


def test_metadata_rows_are_80_byte_blobs_a_restart_decodes_at_once(tmp_path):
    """Scenario: the on-disk row format is what the restart path decodes with one frombuffer, deadline inside."""
    store = open_store(tmp_path / "disk")
    spill(store, [1, 2], 4 * KiB, deadline=NOW + 5)
    store.close()
    db = sqlite3.connect(tmp_path / "disk" / "meta.sqlite3")
    rows = db.execute("select loc, length(rec) from blocks").fetchall()
    assert db.execute("pragma journal_mode").fetchone()[0] == "wal"
    db.close()
    assert sorted(r[1] for r in rows) == [80, 80]
    assert slot_class(1) == ALIGN and slot_class(ALIGN + 1) == 2 * ALIGN


def test_host_slots_plan_one_iovec_per_run_and_round_trip(tmp_path):
    """Scenario: a batch handed over as HostSlots (the arena and slot offsets, as the daemon does)
    plans as arrays: 16 blocks adjacent on disk and in memory are one request with one iovec; a gap
    in memory splits the iovecs (not the request); the bytes written that way read back exactly into
    HostSlots of another buffer, CRC-verified, and a wrong-length slot is a per-block fault."""
    from kvservice.disk.batch_io import HostSlots
    store = open_store(tmp_path / "disk", 64 * MiB, segment_bytes=16 * MiB)
    n, size = 16, 64 * KiB
    arena = aligned_buffer(2 * n * size)
    offsets = np.arange(n, dtype=np.int64) * size
    offsets[8:] += size  # blocks 8.. one slot further on in memory: two stretches
    for i, o in enumerate(offsets):
        arena[o:o + size] = content(i, size)
    slots = HostSlots(arena, offsets, np.full(n, size, dtype=np.int64))
    locs = store.reserve([size] * n)
    store._create_planned({split_loc(locs[0])[0]})
    files = dict(store._files)
    runs = batch_io.plan_slots(np.arange(n), np.array(locs), slots, files, 16 * MiB, reading=False)
    assert len(runs) == 1 and runs[0].blocks == list(range(n)) and runs[0].nbytes == n * size
    if runs[0].direct:
        assert [v.nbytes for v in runs[0].views] == [8 * size, 8 * size]
    blocks = [BlockWrite("ns", key(i), checksum(slots.view(i)), stored_at=NOW) for i in range(n)]
    assert store.write(locs, blocks, slots) == [None] * n
    out = aligned_buffer(2 * n * size)
    assert store.read(locs, HostSlots(out, offsets, slots.lengths)) == [None] * n
    assert all(np.array_equal(out[o:o + size], content(i, size)) for i, o in enumerate(offsets))
    short = HostSlots(out, offsets[:2], np.array([size, size - ALIGN], dtype=np.int64))
    faults = store.read(locs[:2], short)
    assert faults[0] is None and faults[1].kind == FaultKind.WRONG_SIZE
    store.close()


def test_unaligned_full_slot_buffers_bounce_and_round_trip(tmp_path):
    """Scenario: host buffers that fill their slots but do not start page-aligned (as slices of a
    malloc'd slab are) go O_DIRECT through the staging buffer; the bytes round-trip exactly."""
    store = open_store(tmp_path / "disk")
    locs, faults = spill(store, list(range(12)), 64 * KiB, aligned=False)
    assert faults == [None] * 12
    outs = [np.empty(64 * KiB + 8, dtype=np.uint8)[8:] for _ in locs]
    assert store.read(locs, outs) == [None] * 12
    assert all(np.array_equal(o, content(i, 64 * KiB)) for i, o in enumerate(outs))
    store.close()
