"""Batched segment I/O: a batch of (location, host buffer) pairs becomes a few large requests.

Primitives:
  plan(items, segments, max_request) -> [Run]   sort by location; adjacent slots of one segment
                                                become one pwritev/preadv of up to max_request
                                                bytes, its iovecs the callers' buffers themselves
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


def plan(items: Sequence[tuple[int, int, np.ndarray]], segments: dict[int, SegmentFile], max_request: int,
         *, reading: bool) -> list[Run]:
    """items: (batch index, loc, byte view). Every loc's segment must be in `segments`."""
    runs: list[Run] = []
    cur: Run | None = None
    prev = (-1, -1)
    for idx, loc, view in sorted(items, key=lambda it: it[1]):
        seg_id, slot = split_loc(loc)
        seg = segments[seg_id]
        direct, bounce = _mode(view, seg)
        limit = min(max_request, BOUNCE_MAX) if bounce else max_request
        adjacent = (cur is not None and prev == (seg_id, slot - 1) and cur.direct == direct
                    and cur.bounce == bounce and cur.nbytes + seg.slot_bytes <= limit)
        if not adjacent:
            cur = Run(seg, slot, direct, bounce)
            runs.append(cur)
        assert cur is not None
        cur.blocks.append(idx)
        cur.views.append(view)
        pad = seg.slot_bytes - view.nbytes
        if pad:  # only on buffered runs: a direct view fills its slot
            cur.views.append(np.empty(pad, dtype=np.uint8) if reading else _ZERO_PAD[:pad])
        cur.nbytes += seg.slot_bytes
        prev = (seg_id, slot)
    return runs


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
