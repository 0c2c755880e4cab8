"""DiskStore: the disk tier's bytes and metadata (segments, slots, SQLite), faults as results.

Primitives (locations are ints, see slots.make_loc; the daemon keeps them in its block table):
  DiskStore(root, capacity, max_ttl_seconds=..)  open: check files, load metadata -> .recovered
  reserve(lengths) -> [loc | None]        slots for a batch, no I/O (None: no room, evict first)
  write(locs, blocks, bufs) -> [fault]    blocking: data (batched, direct), then one metadata
                                          commit; consumes the reservations (a failed one is freed);
                                          bufs: a buffer per block, or HostSlots (one host buffer +
                                          offsets: planned as arrays, the daemon's arena slots)
  cancel(locs)                            reservations that will not be written
  read(locs, outs) -> [fault]             blocking: coalesced reads into the callers' buffers (or
                                          HostSlots), CRC32C verified; a faulted block should be free()d
  free(locs)                              committed blocks leave (their delete commits soon)
  set_deadline(loc, deadline)             persisted with the next commit
  flush() / close()
  room(length), stats()                   what fits now; bytes, counts, faults
A fault is a DiskFault(kind, message, errno) in the block's place; None means done.

Thread model: reserve/cancel/free/set_deadline are cheap and may run on the event loop;
write/read/flush block and belong on worker threads. One lock guards the bookkeeping (never held
across I/O), one serialises the SQLite connection.
"""

from __future__ import annotations

import errno as errnos
import enum
import logging
import os
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvservice.checksum import Buffer, _extend_gil_free, byte_view, checksum
from kvservice.disk import batch_io
from kvservice.disk.metadata import REC, Metadata, MetadataError, Rows
from kvservice.disk.recovery import Recovered, check_rows
from kvservice.disk.segment import NAME_RE, SegmentFile, UnsafeFileError, segment_name
from kvservice.disk.batch_io import HostSlots
from kvservice.disk.slots import ALIGN, SlotAllocator, make_loc, slot_class, split_loc
from kvservice.disk.io_backend import ShortReadError, ShortWriteError
from kvservice.core.types import HASH_BYTES

log = logging.getLogger(__name__)

META_PER_SLOT = 256  # bytes of SQLite reserved per slot: a row is ~90 B, pages may be half full
MAX_TXN_ROWS = 512  # rows per transaction: bounds the WAL a commit can add
FANOUT = 8  # requests a write batch is split into (see _request_size)
VERIFY_GIL_FREE_MIN = 64 << 10  # a read's CRC check releases the GIL from this block size up (_crc_reader)
READ_FANOUT = 16  # and a read batch: one Load is read alone (64 MiB: 16 x 4 MiB; H200 sweep 1.80 vs 1.41 GB/s for 8 x 8)


class FaultKind(str, enum.Enum):
    NO_ROOM = "no_room"  # the tier is at capacity: evict, or refuse the block
    NO_SPACE = "no_space"  # the filesystem is full (ENOSPC)
    READ_ONLY = "read_only"  # the filesystem is read-only (EROFS)
    IO_ERROR = "io_error"  # any other OS error (EIO...)
    SHORT_IO = "short_io"  # a read or write moved fewer bytes than asked
    CHECKSUM = "checksum"  # bytes read back do not have the block's CRC32C
    WRONG_SIZE = "wrong_size"  # the slot holds a block of another size than the caller's buffer
    MISSING = "missing"  # no block at this location


@dataclass(frozen=True, slots=True)
class DiskFault:
    kind: FaultKind
    message: str
    errno: int | None = None

    def __str__(self) -> str:
        return self.message


class BlockWrite(NamedTuple):
    """What the metadata keeps of a block (its bytes come separately). A NamedTuple: a spill
    batch makes one per block on the event loop (a frozen dataclass costs 2-3x more to make)."""

    namespace: str
    hash: bytes
    crc: int
    deadline: float = 0.0
    stored_at: float = 0.0
    reuse: int = 0


def fault_of(e: BaseException, what: str) -> DiskFault:
    code = getattr(e, "errno", None)
    if isinstance(e, (ShortReadError, ShortWriteError)) and code is None:
        return DiskFault(FaultKind.SHORT_IO, f"{what}: {e}")
    kind = {errnos.ENOSPC: FaultKind.NO_SPACE, errnos.EDQUOT: FaultKind.NO_SPACE,
            errnos.EROFS: FaultKind.READ_ONLY}.get(code, FaultKind.IO_ERROR)
    if isinstance(e, (ShortReadError, ShortWriteError)) and kind == FaultKind.IO_ERROR:
        kind = FaultKind.SHORT_IO
    return DiskFault(kind, f"{what}: {e}", code)


class DiskStore:
    def __init__(self, root: str, capacity_bytes: int, *, max_ttl_seconds: float = 7 * 24 * 3600.0,
                 now: Callable[[], float] = time.time, segment_bytes: int = 256 << 20, io_threads: int = 32,
                 max_request_bytes: int = 16 << 20, direct: bool = True, durable: bool = False,
                 other_bytes: int = 0) -> None:
        """other_bytes: room kept for files others put under root (the daemon's namespace canaries)."""
        self.root = root
        self.capacity_bytes = capacity_bytes
        self.max_ttl = max_ttl_seconds
        self._now = now
        self._direct = direct
        self._durable = durable
        self.max_request = max_request_bytes
        self.io_threads = io_threads
        self._wal_limit = _wal_limit(capacity_bytes)
        self._meta_fixed = metadata_fixed_bytes(capacity_bytes, other_bytes)
        self._ceiling = capacity_bytes  # lowered when the filesystem says ENOSPC first
        self._lock = threading.Lock()
        self._db_lock = threading.Lock()
        self._create_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kv-disk")
        self._alloc = SlotAllocator(self._fits, segment_bytes)
        self._files: dict[int, SegmentFile] = {}
        self._length: dict[int, np.ndarray] = {}  # per segment: block length per slot (0: empty)
        self._crc: dict[int, np.ndarray] = {}
        self._busy: Counter[int] = Counter()  # requests in flight per segment
        self._failed_segments: dict[int, DiskFault] = {}
        self._deletes: list[int] = []
        self._deadlines: dict[int, float] = {}
        self._seg_add: list[tuple[int, int, int]] = []
        self._seg_del: list[int] = []
        self._ns_ids: dict[str, int] = {}
        self._seq = 0
        self._flushing = False
        self.faults: Counter[str] = Counter()
        self.read_only_fault: DiskFault | None = None  # the last write found the filesystem read-only
        _prepare_root(root)
        self._meta = Metadata(root, durable=durable, wal_limit=self._wal_limit)
        self.readonly = self._meta.readonly
        self.recovered = self._open_segments_and_rows()

    # --- accounting
    @property
    def metadata_fixed_bytes(self) -> int:
        """The metadata reserve that does not depend on the number of slots (WAL, schema)."""
        return self._meta_fixed

    def _meta_reserve(self, total_slots: int) -> int:
        return self._meta_fixed + total_slots * META_PER_SLOT

    def _fits(self, total_slots: int, segment_bytes: int) -> bool:
        return segment_bytes + self._meta_reserve(total_slots) <= self._ceiling

    @property
    def used_bytes(self) -> int:
        """Slot bytes of stored, reserved and quarantined blocks."""
        with self._lock:
            return self._alloc.used_bytes

    def committed_bytes(self) -> int:
        """The most the tier's files may occupy now: segment files plus the metadata reserve."""
        with self._lock:
            return self._alloc.segment_bytes + self._meta_reserve(self._alloc.total_slots)

    def file_bytes(self) -> int:
        """What the tier's files occupy now (segments, database, WAL)."""
        with self._lock:
            segs = sum(f.nbytes for f in self._files.values())
        return segs + self._meta.nbytes()

    def room(self, length: int) -> int:
        """Blocks of `length` bytes that reserve() would place now without evicting."""
        sb = slot_class(length)
        with self._lock:
            free = self._alloc.free_slots(sb) + self._alloc.quarantined()
            spare = self._ceiling - self._alloc.segment_bytes - self._meta_reserve(self._alloc.total_slots)
            return 0 if self.readonly else free + max(0, spare // (sb + META_PER_SLOT))

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = {"capacity_bytes": self.capacity_bytes, "used_bytes": self._alloc.used_bytes,
                   "segment_bytes": self._alloc.segment_bytes, "segments": len(self._files),
                   "blocks": int(sum(int(np.count_nonzero(a)) for a in self._length.values())),
                   "quarantined_slots": self._alloc.quarantined()}
        out["metadata_bytes"] = self._meta.nbytes()
        out.update({f"faults_{k}": v for k, v in self.faults.items()})
        return out

    # --- open
    def _open_segments_and_rows(self) -> Recovered:
        segs, names, rows, overridden = self._meta.load()
        self._ns_ids = {n: i for i, n in names.items()}
        rec = Recovered(names, rows)
        table = {sid for sid, _, _ in segs}
        usable: dict[int, tuple[int, int]] = {}
        for sid, sb, count in segs:
            try:
                f = SegmentFile.open(self.root, sid, sb, count, direct=self._direct)
            except (OSError, UnsafeFileError) as e:
                path = os.path.join(self.root, segment_name(sid, sb))
                log.warning("disk tier: segment %s unusable, its blocks are dropped: %s", path, e)
                rec.unsafe_files.append(f"{path}: {e}")
                _remove_planted(path)
                self._seg_del.append(sid)
                continue
            self._files[sid] = f
            usable[sid] = (sb, count)
        for entry in os.scandir(self.root):
            m = NAME_RE.fullmatch(entry.name)
            if m and int(m[1]) not in table:  # made, never committed: a crash before its first commit
                if entry.is_file(follow_symlinks=False):
                    rec.orphans_removed += 1
                else:
                    rec.unsafe_files.append(f"{entry.path}: not a regular file")
                _remove_planted(entry.path)
        kept, drop, invalid, dups, clamped = check_rows(rows, usable, names, self._now(), self.max_ttl)
        rec.rows, rec.dropped_rows, rec.duplicate_rows, rec.clamped_deadlines = kept, invalid, dups, len(clamped)
        self._deletes.extend(drop.tolist())
        # rewrite rows whose deadline changed (overrides folded in, clamps) so the next open
        # reads them from the rows alone and sees the same clamp
        rewrite = np.zeros(len(kept), dtype=bool)
        rewrite[clamped] = True
        if len(overridden) and len(kept):  # kept is in loc order (the rowid)
            at = np.searchsorted(kept.loc, overridden).clip(0, len(kept) - 1)
            rewrite[at[kept.loc[at] == overridden]] = True
        fold = [(int(r["loc"]), r.tobytes()) for r in kept.rec[rewrite]] if rewrite.any() else []
        seg_of = kept.loc >> 32
        slot_of = kept.loc & ((1 << 32) - 1)
        for sid, (sb, count) in usable.items():
            mask = seg_of == sid
            slots = slot_of[mask]
            self._alloc.add_segment(sid, sb, count, slots)
            length = np.zeros(count, dtype=np.uint32)
            crc = np.zeros(count, dtype=np.uint32)
            length[slots] = kept.rec["length"][mask]
            crc[slots] = kept.rec["crc"][mask]
            self._length[sid], self._crc[sid] = length, crc
        if len(rows):
            self._seq = int(rows.rec["seq"].max()) + 1
        rec.segments_dropped = self._shrink_to_capacity(rec)
        if not self.readonly and (self._deletes or fold or len(overridden) or self._seg_del):
            with self._db_lock:
                self._commit_locked(fold, fold=True)
            self.flush()
        return rec

    def _shrink_to_capacity(self, rec: Recovered) -> int:
        """A capacity smaller than last run's: drop whole segments, newest first, until it fits."""
        dropped = 0
        while self._files and not self.readonly and not self._fits(self._alloc.total_slots, self._alloc.segment_bytes):
            sid = max(self._files)
            length = self._length.pop(sid)
            self._crc.pop(sid)
            gone = np.flatnonzero(length)
            self._deletes.extend(make_loc(sid, int(s)) for s in gone)
            rec.rows = Rows(rec.rows.rec[(rec.rows.loc >> 32) != sid])
            self._alloc.drop(sid)
            f = self._files.pop(sid)
            f.close()
            _remove_planted(f.path)
            self._seg_del.append(sid)
            dropped += 1
            log.warning("disk tier: capacity %d is below what is on disk: dropped segment %s (%d blocks)",
                        self.capacity_bytes, f.path, len(gone))
        return dropped

    # --- reservations
    def reserve(self, lengths: Sequence[int]) -> list[int | None]:
        """One slot per block, lowest free first, so a batch lands in adjacent slots."""
        out: list[int | None] = [None] * len(lengths)
        if self.readonly:
            return out
        by_class: dict[int, list[int]] = {}
        for i, n in enumerate(lengths):
            by_class.setdefault(slot_class(n), []).append(i)
        for sb, idxs in by_class.items():
            k = len(idxs)
            locs = self._allocate(sb, k)
            if locs is None:  # not all fit: as many as do, the batch's first blocks
                k = min(k - 1, self.room(sb))
            while locs is None and k > 0:
                locs = self._allocate(sb, k)
                k -= max(1, k // 8)
            for i, loc in zip(idxs, locs or ()):
                out[i] = loc
        return out

    def refusal(self) -> str:
        """Why reserve() places nothing, for the message of a refused block."""
        if self.readonly:
            return f"disk tier at {self.root} is on a read-only filesystem: nothing can be written"
        if self.read_only_fault is not None:
            return f"disk tier at {self.root}: the filesystem turned read-only ({self.read_only_fault.message})"
        if self._ceiling < self.capacity_bytes:
            return (f"disk tier at {self.root} is full: the filesystem ran out of space (ENOSPC) before "
                    f"the configured capacity of {self.capacity_bytes} bytes")
        return f"disk tier at {self.root} is full ({self.capacity_bytes} bytes)"

    def _allocate(self, sb: int, n: int) -> list[int] | None:
        with self._lock:
            # free slots, then slots whose old rows' deletes are queued (reserved now, the write
            # commits the deletes first), then new segments
            locs = self._alloc.allocate_retired(sb, n)
            if locs is not None:
                return locs
            empties = self._alloc.reclaimable(keep_class=sb)
            empties = [s for s in empties if not self._busy[s.id]]
            for seg in empties:
                self._drop_segment_locked(seg.id)
            if empties:
                locs = self._alloc.allocate(sb, n)
            need_flush = locs is None and self._alloc.quarantined() > 0
        if need_flush:  # slots wait for their delete to commit: commit now
            self.flush()
            with self._lock:
                locs = self._alloc.allocate(sb, n)
        return locs

    def _drop_segment_locked(self, sid: int) -> None:
        self._alloc.drop(sid)
        f = self._files.pop(sid, None)
        self._length.pop(sid, None)
        self._crc.pop(sid, None)
        self._seg_del.append(sid)
        if f is not None:
            f.close()
            _remove_planted(f.path)

    def cancel(self, locs: Sequence[int]) -> None:
        with self._lock:
            self._alloc.release(locs)

    # --- writes
    def write(self, locs: Sequence[int], blocks: Sequence[BlockWrite],
              bufs: Sequence[Buffer] | HostSlots) -> list[DiskFault | None]:
        """bufs: one buffer per block, or HostSlots (blocks in one host buffer, planned as arrays)."""
        n = len(locs)
        faults: list[DiskFault | None] = [None] * n
        la = np.fromiter(locs, np.int64, n)
        slots, views, lengths = _buffers(bufs, faults, writable=False)
        for i, b in enumerate(blocks):
            if len(b.hash) != HASH_BYTES and faults[i] is None:
                faults[i] = DiskFault(FaultKind.WRONG_SIZE, f"block not written: block hash must be {HASH_BYTES} bytes")
        seg_of = la >> 32
        seg_list, loc_list = seg_of.tolist(), la.tolist()  # per-block checks on Python ints, not numpy scalars
        with self._lock:
            sb_of = {sid: (seg.slot_bytes if (seg := self._alloc.segments.get(sid)) else -1) for sid in set(seg_list)}
        want = np.fromiter(map(sb_of.__getitem__, seg_list), np.int64, n)
        classes = (np.maximum(lengths, 1) + ALIGN - 1) // ALIGN * ALIGN
        for i in np.flatnonzero((classes != want) | (lengths <= 0)).tolist():
            if faults[i] is None:
                faults[i] = DiskFault(FaultKind.WRONG_SIZE, f"block not written: a {int(lengths[i])}-byte block "
                                      f"does not fit slot class {int(want[i])}")
        self._create_planned({sid for sid, f in zip(seg_list, faults) if f is None})
        with self._lock:
            pending = [i for i, (loc, f) in enumerate(zip(loc_list, faults)) if f is None and self._alloc.pending(loc)]
        if pending:
            self._commit_deletes_first(pending, la, faults)
        with self._lock:
            files = self._files
            for i in [i for i, (sid, f) in enumerate(zip(seg_list, faults)) if f is None and sid not in files]:
                sid = seg_list[i]
                faults[i] = self._failed_segments.get(sid) or DiskFault(
                    FaultKind.IO_ERROR, f"segment {sid} of this reservation is gone")
            good = np.fromiter((i for i, f in enumerate(faults) if f is None), np.int64)
            segs = set(seg_of[good].tolist())
            self._busy.update(segs)
            files = {s: self._files[s] for s in segs}
        try:
            size = self._request_size(int(lengths[good].sum()))
            if slots is not None:
                runs = batch_io.plan_slots(good, la[good], slots.subset(good), files, size, reading=False)
            else:
                runs = batch_io.plan([(int(i), int(la[i]), views[i]) for i in good], files, size, reading=False)
            errors = batch_io.execute(self._pool, runs, batch_io.write_run)
            for k, e in errors.items():
                f = fault_of(e, f"spill to {runs[k].seg.path} failed")
                for i in runs[k].blocks:
                    faults[i] = f
            if self._durable:
                self._sync({runs[k].seg.id: runs[k].seg for k in range(len(runs)) if k not in errors}, runs, faults)
        finally:
            with self._lock:
                self._busy.subtract(segs)
        done = [i for i in good.tolist() if faults[i] is None]
        self._commit_puts(done, la, blocks, lengths, faults)
        with self._lock:
            bad = [i for i in range(n) if faults[i] is not None]
            self._alloc.release([locs[i] for i in bad])
            for i in bad:
                self.faults[faults[i].kind.value] += 1  # type: ignore[union-attr]
            ro = [faults[i] for i in bad if faults[i].kind == FaultKind.READ_ONLY]  # type: ignore[union-attr]
            if ro:
                self.read_only_fault = ro[0]
            elif len(bad) < n:
                self.read_only_fault = None
        return faults

    def _commit_deletes_first(self, idx: list[int], la: np.ndarray, faults: list) -> None:
        """Slots reserved before their previous blocks' deletes committed (allocate_retired): commit
        the queued deletes now, on this writer thread and once for the batch, before any byte of
        the new blocks lands there; a slot whose delete still did not commit is not written."""
        try:
            self.flush()
            fault = DiskFault(FaultKind.IO_ERROR, "block not written: the delete of its slot's previous block "
                              "has not committed")
        except (MetadataError, OSError) as e:
            fault = fault_of(e, "block not written: the delete of its slot's previous block did not commit")
        with self._lock:
            for i in idx:
                if self._alloc.pending(int(la[i])):
                    faults[i] = fault

    def _request_size(self, total: int, fanout: int = FANOUT) -> int:
        """Large requests, and several of them per call: a batch is split into about `fanout`
        requests (1 MiB to max_request each), so one call keeps several I/O threads busy and the
        calls of concurrent writers (readers) fill the rest of the pool. One stream of a virtual
        disk is far from its limit; what it needs is many bytes in flight."""
        return max(1 << 20, min(self.max_request, -(-total // fanout)))

    def _sync(self, segs: dict[int, SegmentFile], runs, faults) -> None:
        for sid, f in segs.items():
            try:
                f.sync()
            except OSError as e:
                bad = fault_of(e, f"fdatasync of {f.path} failed")
                for r in runs:
                    if r.seg.id == sid:
                        for i in r.blocks:
                            faults[i] = bad

    def _create_planned(self, seg_ids: set[int]) -> None:
        with self._lock:
            todo = [self._alloc.segments[s] for s in seg_ids
                    if s in self._alloc.segments and not self._alloc.segments[s].on_disk]
        for seg in todo:
            with self._create_lock:
                with self._lock:
                    if seg.id not in self._alloc.segments or seg.on_disk:
                        continue
                try:
                    f = SegmentFile.create(self.root, seg.id, seg.slot_bytes, seg.slots, direct=self._direct)
                except OSError as e:
                    fault = fault_of(e, f"could not make segment file {segment_name(seg.id, seg.slot_bytes)}")
                    log.warning("disk tier: %s", fault.message)
                    with self._lock:
                        self._failed_segments[seg.id] = fault
                        self._alloc.drop(seg.id)
                        if fault.kind == FaultKind.NO_SPACE:  # the filesystem has less room than the setting
                            self._ceiling = min(self._ceiling, self._alloc.segment_bytes
                                                + self._meta_reserve(self._alloc.total_slots) + _free_space(self.root))
                    continue
                with self._lock:
                    self._files[seg.id] = f
                    self._length[seg.id] = np.zeros(seg.slots, dtype=np.uint32)
                    self._crc[seg.id] = np.zeros(seg.slots, dtype=np.uint32)
                    self._alloc.created(seg.id)
                    self._seg_add.append((seg.id, seg.slot_bytes, seg.slots))

    def _ns_id(self, name: str) -> int:
        ns = self._ns_ids.get(name)
        if ns is None:  # under the db lock
            ns = self._ns_ids[name] = self._meta.add_namespace(name)
        return ns

    def _commit_puts(self, done: list[int], la: np.ndarray, blocks, lengths: np.ndarray, faults) -> None:
        """Metadata after data: rows for the written blocks, in transactions of MAX_TXN_ROWS."""
        with self._db_lock:
            for start in range(0, max(1, len(done)), MAX_TXN_ROWS):
                part = done[start:start + MAX_TXN_ROWS]
                try:
                    rec = np.zeros(len(part), REC)
                    rec["loc"] = la[part]
                    rec["length"] = lengths[part]
                    if part:  # BlockWrite's fields as columns
                        names, hashes, crcs, deadlines, stored, reuse = zip(*[blocks[i] for i in part])
                        ids = {name: self._ns_id(name) for name in set(names)}
                        rec["ns"] = [ids[name] for name in names]
                        rec["hash"] = np.frombuffer(b"".join(hashes), "V32")
                        rec["crc"] = crcs
                        rec["reuse"] = reuse
                        rec["stored_at"] = stored
                        rec["deadline"] = deadlines
                    rec["seq"] = np.arange(self._seq, self._seq + len(part), dtype=np.uint64)
                    self._seq += len(part)
                    blob = rec.tobytes()
                    w = REC.itemsize
                    puts = [(loc, blob[j * w:(j + 1) * w]) for j, loc in enumerate(rec["loc"].tolist())]
                    self._commit_locked(puts)
                except (MetadataError, OSError) as e:
                    f = fault_of(e, "spill written but its metadata commit failed")
                    for i in done[start:]:
                        faults[i] = f
                    return
                seg_of, slot_of = rec["loc"] >> 32, rec["loc"] & 0xFFFFFFFF
                with self._lock:
                    for sid in set(seg_of.tolist()):
                        length = self._length.get(sid)
                        if length is not None:
                            m = seg_of == sid
                            length[slot_of[m]] = rec["length"][m]
                            self._crc[sid][slot_of[m]] = rec["crc"][m]

    def _commit_locked(self, puts=(), fold: bool = False) -> None:
        """One transaction of the queued deletes, deadlines, segment rows and `puts`.
        Holds the db lock. On failure everything queued is queued again."""
        with self._lock:
            deletes, self._deletes = self._deletes[:MAX_TXN_ROWS * 4], self._deletes[MAX_TXN_ROWS * 4:]
            deadlines, self._deadlines = self._deadlines, {}
            seg_add, self._seg_add = self._seg_add, []
            seg_del, self._seg_del = self._seg_del, []
        try:
            self._meta.commit(puts=puts, deletes=deletes, deadlines=list(deadlines.items()),
                              segments_add=seg_add, segments_del=seg_del, fold_deadlines=fold)
        except BaseException:
            with self._lock:
                self._deletes[:0] = deletes
                for loc, d in deadlines.items():  # a loc freed meanwhile must not get a stale deadline
                    if loc not in self._deletes:
                        self._deadlines.setdefault(loc, d)
                self._seg_add[:0] = seg_add
                self._seg_del[:0] = seg_del
            raise
        with self._lock:
            self._alloc.settle(deletes)

    # --- reads
    def read(self, locs: Sequence[int], outs: Sequence[Buffer] | HostSlots,
             fanout: int = READ_FANOUT) -> list[DiskFault | None]:
        """outs: one buffer per block, or HostSlots (the blocks land in one host buffer); fanout:
        about how many requests the batch becomes (see _request_size)."""
        n = len(locs)
        faults: list[DiskFault | None] = [None] * n
        la = np.fromiter(locs, np.int64, n)
        slots, views, lengths = _buffers(outs, faults, writable=True)
        seg_of, slot_of = la >> 32, la & 0xFFFFFFFF
        have = np.zeros(n, dtype=np.int64)
        expect = np.zeros(n, dtype=np.int64)
        with self._lock:
            for sid in set(seg_of.tolist()):
                length = self._length.get(sid)
                m = np.flatnonzero(seg_of == sid)
                if length is None:
                    continue
                ok = m[slot_of[m] < len(length)]
                have[ok] = length[slot_of[ok]]
                expect[ok] = self._crc[sid][slot_of[ok]]
            for i in np.flatnonzero((have == 0) | (have != lengths)).tolist():
                if faults[i] is not None:
                    continue
                sid, slot = int(seg_of[i]), int(slot_of[i])
                if not have[i]:
                    faults[i] = DiskFault(FaultKind.MISSING, f"no block at disk location {sid}:{slot}")
                else:
                    faults[i] = DiskFault(FaultKind.WRONG_SIZE, f"disk slot {sid}:{slot} holds a {int(have[i])}-byte "
                                          f"block, the namespace's blocks are {int(lengths[i])} bytes")
            good = np.fromiter((i for i in range(n) if faults[i] is None), np.int64)
            segs = set(seg_of[good].tolist())
            self._busy.update(segs)
            files = {s: self._files[s] for s in segs}
        bad: dict[int, DiskFault] = {}
        try:
            size = self._request_size(int(lengths[good].sum()), fanout)
            if slots is not None:
                runs = batch_io.plan_slots(good, la[good], slots.subset(good), files, size, reading=True)
            else:
                runs = batch_io.plan([(int(i), int(la[i]), views[i]) for i in good], files, size, reading=True)

            crc_of, want = _crc_reader(slots, views), expect.tolist()

            def one(run: batch_io.Run) -> None:
                batch_io.read_run(run)
                for i in run.blocks:  # verified in the reading thread
                    got = crc_of(i)
                    if got != want[i]:
                        bad[i] = DiskFault(FaultKind.CHECKSUM, f"disk block at {run.seg.path} slot "
                                           f"{int(slot_of[i])} fails its checksum: crc32c {got:#010x}, "
                                           f"expected {int(expect[i]):#010x}")

            errors = batch_io.execute(self._pool, runs, one)
        finally:
            with self._lock:
                self._busy.subtract(segs)
        for k, e in errors.items():
            f = fault_of(e, f"read of {runs[k].seg.path} failed")
            for i in runs[k].blocks:
                faults[i] = f
        for i, f in bad.items():
            faults[i] = faults[i] or f
        with self._lock:
            for f in faults:
                if f is not None:
                    self.faults[f.kind.value] += 1
        return faults

    # --- removal, deadlines, commit
    def free(self, locs: Sequence[int]) -> None:
        """Committed blocks leave. Their slots come back once the delete has committed.
        A batch is handled with array operations per segment (a full tier's spill frees a
        disk block per victim: at 64 KiB, thousands a second)."""
        la = np.fromiter(locs, np.int64)
        seg_of, slot_of = la >> 32, la & 0xFFFFFFFF
        with self._lock:
            gone: list[int] = []
            for sid in set(seg_of.tolist()):
                length = self._length.get(sid)
                if length is None:
                    continue
                slots = slot_of[seg_of == sid] if len(la) > 1 else slot_of
                slots = slots[slots < len(length)]
                slots = slots[length[slots] != 0]
                if len(slots) > 1:  # the same block twice leaves once (sorted, not np.unique: it imports numpy.ma)
                    slots = np.sort(slots)
                    slots = slots[np.concatenate(([True], slots[1:] != slots[:-1]))]
                length[slots] = 0
                self._crc[sid][slots] = 0
                gone.extend(((sid << 32) | slots).tolist())
            if self._deadlines:
                for loc in gone:
                    self._deadlines.pop(loc, None)
            self._deletes.extend(gone)
            self._alloc.retire(gone)
            kick = bool(self._deletes) and not self._flushing and not self.readonly
            self._flushing = self._flushing or kick
        if kick:
            self._pool.submit(self._background_flush)

    def _background_flush(self) -> None:
        try:
            self.flush()
        except (MetadataError, OSError) as e:
            log.warning("disk tier: metadata commit failed: %s", e)
        finally:
            with self._lock:
                self._flushing = False

    def set_deadline(self, loc: int, deadline: float) -> None:
        """Persisted by a commit that starts at once in the background."""
        with self._lock:
            sid, slot = split_loc(loc)
            length = self._length.get(sid)
            if length is None or not length[slot]:
                return
            self._deadlines[loc] = float(deadline)
            kick = not self._flushing and not self.readonly
            self._flushing = self._flushing or kick
        if kick:
            self._pool.submit(self._background_flush)

    def flush(self) -> None:
        """Commit what is queued (deletes, deadlines, segment rows). Raises MetadataError."""
        if self.readonly:
            return
        with self._db_lock:
            while True:
                with self._lock:
                    idle = not (self._deletes or self._deadlines or self._seg_add or self._seg_del)
                if idle:
                    return
                self._commit_locked()

    def close(self) -> None:
        try:
            self.flush()
        except (MetadataError, OSError) as e:
            log.warning("disk tier: final metadata commit failed: %s", e)
        self._pool.shutdown(wait=True)
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()
        self._meta.close()


def _crc_reader(slots: HostSlots | None, views: list) -> Callable[[int], int]:
    """CRC32C of block i of a read batch, for the reading threads: from VERIFY_GIL_FREE_MIN up
    through the C function with the GIL released (checksum() holds it below 256 KiB: a 64 KiB
    block's ~10 us CRC would make the event loop wait), addressed from the slot's offset (no
    numpy view per block)."""
    fn = _extend_gil_free
    if slots is not None:
        if fn is None:
            return lambda i: checksum(slots.view(i))
        base, offs, lens = slots.base.ctypes.data, slots.offsets.tolist(), slots.lengths.tolist()

        def crc(i: int) -> int:
            n = lens[i]
            return int(fn(0, base + offs[i], n)) if n >= VERIFY_GIL_FREE_MIN else checksum(slots.view(i))
        return crc

    def crc_view(i: int) -> int:
        v = views[i]
        return int(fn(0, v.ctypes.data, v.nbytes)) if fn is not None and v.nbytes >= VERIFY_GIL_FREE_MIN else checksum(v)
    return crc_view


def _buffers(bufs, faults: list, *, writable: bool) -> tuple[HostSlots | None, list, np.ndarray]:
    """(slots, views, lengths) of a batch's buffers; a buffer that is no usable host buffer is a
    WRONG_SIZE fault in its place (length 0)."""
    if isinstance(bufs, HostSlots):
        return bufs, [], bufs.lengths
    views: list[np.ndarray | None] = [None] * len(bufs)
    for i, b in enumerate(bufs):
        try:
            views[i] = byte_view(b, writable=writable)
        except (TypeError, ValueError) as e:
            what = "cannot read into this buffer" if writable else "block not written"
            faults[i] = DiskFault(FaultKind.WRONG_SIZE, f"{what}: {e}")
    lengths = np.fromiter((v.nbytes if v is not None else 0 for v in views), np.int64, len(views))
    return None, views, lengths


def _wal_limit(capacity_bytes: int) -> int:
    return min(4 << 20, max(64 << 10, capacity_bytes // 256))


def metadata_fixed_bytes(capacity_bytes: int, other_bytes: int = 0) -> int:
    """The metadata reserve that does not depend on the number of slots: WAL, -shm, schema pages,
    and `other_bytes` kept for files others put under the root."""
    return 3 * _wal_limit(capacity_bytes) + (256 << 10) + other_bytes


def _prepare_root(root: str) -> None:
    """The disk directory: made 0700 if missing; refused if it is a symlink or not ours."""
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        os.makedirs(root, mode=0o700, exist_ok=True)
        st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeFileError(errnos.ENOTDIR, "the disk path is not a directory (a symlink is refused)", root)
    if st.st_uid != os.geteuid():
        raise UnsafeFileError(errnos.EPERM, f"the disk path is owned by uid {st.st_uid}, not this daemon", root)


def _free_space(root: str) -> int:
    """What the filesystem still gives us, less a margin for the metadata's growth."""
    try:
        st = os.statvfs(root)
    except OSError:
        return 0
    return max(0, st.f_bavail * st.f_frsize - (512 << 10))


def _remove_planted(path: str) -> None:
    """Unlink a refused entry with our naming: a symlink or FIFO is removed, never followed."""
    try:
        os.unlink(path)
    except OSError:
        pass
