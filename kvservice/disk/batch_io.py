"""Batched segment I/O: a batch of (location, host buffer) pairs becomes a few large requests.

Primitives:
  plan(items, segments, max_request) -> [Run]   sort by location; adjacent slots of one segment
                                                become one pwritev/preadv of up to max_request
                                                bytes, its iovecs the callers' buffers themselves
  execute(pool, runs, fn) -> {run index: error}  run every request on the pool, wait for all

A run is direct (O_DIRECT descriptor) when every buffer in it starts ALIGN-aligned and fills
its slot exactly: then the bytes go between the disk and the host slots with no copy. Any other
block (an odd length, an unaligned buffer, a filesystem without O_DIRECT) goes through the
buffered descriptor, its slot padding covered by a small pad iovec, so the layout is the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor, wait
from dataclasses import dataclass, field

import numpy as np

from kvservice.disk.segment import SegmentFile
from kvservice.disk.slots import ALIGN, split_loc

_ZERO_PAD = np.zeros(ALIGN, dtype=np.uint8)
_ZERO_PAD.flags.writeable = False


@dataclass(slots=True)
class Run:
    seg: SegmentFile
    first_slot: int
    direct: bool
    blocks: list[int] = field(default_factory=list)  # indices into the caller's batch
    views: list[np.ndarray] = field(default_factory=list)  # data and pad iovecs, in file order
    nbytes: int = 0

    @property
    def offset(self) -> int:
        return self.seg.offset(self.first_slot)

    @property
    def fd(self) -> int:
        return self.seg.dfd if self.direct else self.seg.fd  # type: ignore[return-value]


def _direct_ok(view: np.ndarray, seg: SegmentFile) -> bool:
    return (seg.dfd is not None and view.nbytes == seg.slot_bytes
            and view.ctypes.data % ALIGN == 0)


def plan(items: Sequence[tuple[int, int, np.ndarray]], segments: dict[int, SegmentFile], max_request: int,
         *, reading: bool) -> list[Run]:
    """items: (batch index, loc, byte view). Every loc's segment must be in `segments`."""
    runs: list[Run] = []
    cur: Run | None = None
    prev = (-1, -1)
    for idx, loc, view in sorted(items, key=lambda it: it[1]):
        seg_id, slot = split_loc(loc)
        seg = segments[seg_id]
        direct = _direct_ok(view, seg)
        adjacent = (cur is not None and prev == (seg_id, slot - 1) and cur.direct == direct
                    and cur.nbytes + seg.slot_bytes <= max_request)
        if not adjacent:
            cur = Run(seg, slot, direct)
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
