"""Batched segment I/O: a batch of (location, host buffer) pairs becomes a few large requests.

Primitives:
  plan(items, segments, max_request) -> [Run]   sort by location; adjacent slots of one segment
                                                become one pwritev/preadv of up to max_request
                                                bytes, its iovecs the callers' buffers themselves
  plan_slots(idx, locs, HostSlots, ...) -> [Run] the same for blocks in one host buffer (the
                                                arena), with array operations; blocks adjacent on
                                                disk and in memory share one iovec
  execute(pool, runs, fn) -> {run index: error}  run every request on the pool, wait for all

A run is direct (O_DIRECT descriptor) when every buffer in it fills its slot exactly: if they
also start ALIGN-aligned, the bytes go between the disk and the host slots with no copy;
otherwise the run bounces through a per-thread aligned staging buffer (one memcpy, still
O_DIRECT, at most BOUNCE_MAX bytes a request). Any other block (an odd length, a filesystem
without O_DIRECT) goes through the buffered descriptor, its slot padding covered by a small pad
iovec, so the layout is the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor, wait
import threading
from dataclasses import dataclass, field

import numpy as np

from kvservice.disk.segment import SegmentFile, aligned_buffer, read_all, write_all
from kvservice.disk.slots import ALIGN, split_loc

_ZERO_PAD = np.zeros(ALIGN, dtype=np.uint8)
_ZERO_PAD.flags.writeable = False
BOUNCE_MAX = 4 << 20  # staging per I/O thread, allocated on its first unaligned run
_staging = threading.local()


@dataclass(slots=True)
class Run:
    seg: SegmentFile
    first_slot: int
    direct: bool
    bounce: bool = False  # direct, through an aligned staging buffer
    blocks: list[int] = field(default_factory=list)  # indices into the caller's batch
    views: list[np.ndarray] = field(default_factory=list)  # data and pad iovecs, in file order
    nbytes: int = 0

    @property
    def offset(self) -> int:
        return self.seg.offset(self.first_slot)

    @property
    def fd(self) -> int:
        return self.seg.dfd if self.direct else self.seg.fd  # type: ignore[return-value]


def _mode(view: np.ndarray, seg: SegmentFile) -> tuple[bool, bool]:
    """(direct, bounce) for one block."""
    if seg.dfd is None or view.nbytes != seg.slot_bytes:
        return False, False
    return True, view.ctypes.data % ALIGN != 0


def staging(nbytes: int) -> np.ndarray:
    """This thread's aligned staging buffer, at least nbytes."""
    buf = getattr(_staging, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _staging.buf = aligned_buffer(max(nbytes, BOUNCE_MAX))
    return buf[:nbytes]


def write_run(run: Run) -> None:
    if run.bounce:
        stage = staging(run.nbytes)
        at = 0
        for v in run.views:
            stage[at:at + v.nbytes] = v
            at += v.nbytes
        write_all(run.fd, [stage], run.offset, run.seg.path)
    else:
        write_all(run.fd, run.views, run.offset, run.seg.path)


def read_run(run: Run) -> None:
    if run.bounce:
        stage = staging(run.nbytes)
        read_all(run.fd, [stage], run.offset, run.seg.path)
        at = 0
        for v in run.views:
            v[:] = stage[at:at + v.nbytes]
            at += v.nbytes
    else:
        read_all(run.fd, run.views, run.offset, run.seg.path)


@dataclass(slots=True)
class HostSlots:
    """A batch's blocks in one host buffer: block i is base[offsets[i]:offsets[i] + lengths[i]]
    (the host arena's slots). Planned with array operations, and blocks adjacent both on disk
    and in memory share one iovec: a batch of a Store's blocks is a few iovecs, not one per block."""

    base: np.ndarray  # uint8, 1-D
    offsets: np.ndarray  # int64
    lengths: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.offsets)

    def view(self, i: int) -> np.ndarray:
        o = int(self.offsets[i])
        return self.base[o:o + int(self.lengths[i])]

    def subset(self, idx: np.ndarray) -> HostSlots:
        return HostSlots(self.base, self.offsets[idx], self.lengths[idx])


def plan(items: Sequence[tuple[int, int, np.ndarray]], segments: dict[int, SegmentFile], max_request: int,
         *, reading: bool) -> list[Run]:
    """items: (batch index, loc, byte view). Every loc's segment must be in `segments`."""
    if not items:
        return []
    idx = np.fromiter((it[0] for it in items), np.int64, len(items))
    locs = np.fromiter((it[1] for it in items), np.int64, len(items))
    views = [it[2] for it in items]
    lengths = np.fromiter((v.nbytes for v in views), np.int64, len(views))
    addrs = np.fromiter((v.ctypes.data for v in views), np.int64, len(views))
    return _plan(idx, locs, lengths, addrs, segments, max_request, reading, views=views)


def plan_slots(idx: np.ndarray, locs: np.ndarray, slots: HostSlots, segments: dict[int, SegmentFile],
               max_request: int, *, reading: bool) -> list[Run]:
    """plan() for blocks in host slots: idx are batch indices, slots their buffers (same order)."""
    if not len(idx):
        return []
    addrs = slots.offsets + slots.base.ctypes.data
    return _plan(idx, locs, slots.lengths, addrs, segments, max_request, reading, slots=slots)


def _plan(idx, locs, lengths, addrs, segments, max_request, reading, *, views=None, slots=None) -> list[Run]:
    order = np.argsort(locs, kind="stable")
    locs, lengths, addrs, idx = locs[order], lengths[order], addrs[order], idx[order]
    seg_ids, slot_no = locs >> 32, locs & 0xFFFFFFFF
    first = np.ones(len(seg_ids), dtype=bool)  # sorted: a segment's blocks are one stretch (no np.unique:
    first[1:] = seg_ids[1:] != seg_ids[:-1]     # its first call imports numpy.ma, 0.4 s)
    uniq, inv = seg_ids[first], np.cumsum(first) - 1
    segs = [segments[int(s)] for s in uniq]
    slot_bytes = np.array([s.slot_bytes for s in segs], dtype=np.int64)[inv]
    has_direct = np.array([s.dfd is not None for s in segs], dtype=bool)[inv]
    direct = has_direct & (lengths == slot_bytes)
    bounce = direct & (addrs % ALIGN != 0)
    n = len(locs)
    brk = np.ones(n, dtype=bool)
    if n > 1:
        brk[1:] = ((seg_ids[1:] != seg_ids[:-1]) | (slot_no[1:] != slot_no[:-1] + 1)
                   | (direct[1:] != direct[:-1]) | (bounce[1:] != bounce[:-1]))
    starts = np.flatnonzero(brk).tolist() + [n]
    runs: list[Run] = []
    for a, b in zip(starts[:-1], starts[1:]):
        seg = segs[int(inv[a])]
        sb = seg.slot_bytes
        limit = min(max_request, BOUNCE_MAX) if bounce[a] else max_request
        per = max(1, limit // sb)
        for lo in range(a, b, per):
            hi = min(b, lo + per)
            run = Run(seg, int(slot_no[lo]), bool(direct[lo]), bool(bounce[lo]), idx[lo:hi].tolist(),
                      nbytes=(hi - lo) * sb)
            if slots is not None and run.direct:
                run.views = _coalesced(slots, order[lo:hi], addrs[lo:hi], lengths[lo:hi])
            else:
                for k in range(lo, hi):
                    v = views[int(order[k])] if views is not None else slots.view(int(order[k]))
                    run.views.append(v)
                    pad = sb - int(lengths[k])
                    if pad:  # only on buffered runs: a direct view fills its slot
                        run.views.append(np.empty(pad, dtype=np.uint8) if reading else _ZERO_PAD[:pad])
            runs.append(run)
    return runs


def _coalesced(slots: HostSlots, pos: np.ndarray, addrs: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    """iovecs of consecutive disk slots: one per stretch that is also contiguous in memory."""
    cut = np.flatnonzero(addrs[1:] != addrs[:-1] + lengths[:-1]) + 1
    bounds = [0, *cut.tolist(), len(pos)]
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        o = int(slots.offsets[pos[a]])
        out.append(slots.base[o:o + int(lengths[a:b].sum())])
    return out


def execute(pool: Executor, runs: list[Run], fn: Callable[[Run], None]) -> dict[int, BaseException]:
    """Run fn(run) for every run on the pool; the exceptions by run index. Waits for all, even
    after a failure: the buffers stay in use until every request is done."""
    if len(runs) == 1:
        try:
            fn(runs[0])
            return {}
        except Exception as e:
            return {0: e}
    futures = [pool.submit(fn, r) for r in runs]
    wait(futures)
    return {i: f.exception() for i, f in enumerate(futures) if f.exception() is not None}  # type: ignore[misc]
