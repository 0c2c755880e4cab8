"""Restart: turn the metadata rows into what the store and the daemon need, trusting nothing.

`check_rows(rows, segments, names, now, max_ttl)` is pure (numpy over all rows at once): it keeps
a row only if its segment opened safely, its slot is inside the segment, its length is in
(0, slot_bytes], its namespace is known and its deadline is a finite number >= 0; clamps
deadlines to now + max_ttl; and of two rows with one key keeps the later write (seq). It returns
the surviving rows and the locations of the rows to delete.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from kvservice.disk.metadata import KEY_SLICE, REC, Rows

_SLOT_MASK = (1 << 32) - 1


class DiskRecord(NamedTuple):
    """One block found on disk at open."""

    loc: int
    namespace: str
    hash: bytes
    length: int
    crc: int
    deadline: float  # unix seconds, clamped to now + max_ttl; 0.0: not retained
    stored_at: float
    reuse: int


@dataclass(slots=True)
class Recovered:
    """The blocks on disk at open, as arrays (1M blocks decode in one pass, no per-block object)."""

    names: dict[int, str]
    rows: Rows
    dropped_rows: int = 0  # rows naming a missing/unsafe segment, a bad slot, length or deadline
    duplicate_rows: int = 0  # older rows of a key written twice
    clamped_deadlines: int = 0  # deadlines beyond now + max_ttl, clamped
    unsafe_files: list[str] = field(default_factory=list)  # refused paths, with the reason
    orphans_removed: int = 0  # segment files without metadata (a crash between create and commit)
    segments_dropped: int = 0  # to fit a capacity smaller than last run's

    def __len__(self) -> int:
        return len(self.rows.loc)

    def records(self) -> Iterator[DiskRecord]:
        rec = self.rows.rec
        cols = [rec[f].tolist() for f in ("loc", "ns", "hash", "length", "crc", "deadline", "stored_at", "reuse")]
        for loc, ns, h, length, crc, deadline, stored, reuse in zip(*cols):
            yield DiskRecord(loc, self.names[ns], h, length, crc, deadline, stored, reuse)


# The key's first 8 hash bytes and its namespace, as strided views of the rows (no copy).
_H0 = np.dtype({"names": ["ns", "h0"], "formats": ["<u4", "<u8"], "offsets": [8, 12], "itemsize": REC.itemsize})


def check_rows(rows: Rows, segments: dict[int, tuple[int, int]], names: dict[int, str], now: float,
               max_ttl: float) -> tuple[Rows, np.ndarray, int, int, np.ndarray]:
    """(kept rows, locs to delete, invalid count, duplicate count, indices of clamped kept rows).
    segments: usable segment id -> (slot_bytes, slots)."""
    rec = rows.rec
    n = len(rec)
    loc = rec["loc"]
    seg = loc >> 32
    slot = loc & _SLOT_MASK
    top = max(segments, default=0) + 1
    slot_bytes = np.zeros(top, dtype=np.int64)
    slots = np.zeros(top, dtype=np.int64)
    for sid, (sb, count) in segments.items():
        slot_bytes[sid], slots[sid] = sb, count
    in_range = (seg >= 0) & (seg < top)
    seg_c = np.where(in_range, seg, 0)
    length = rec["length"].astype(np.int64)
    ns_known = np.isin(rec["ns"], np.fromiter(names, dtype=np.int64, count=len(names)))
    deadline = rec["deadline"]
    ok = (in_range & (slot_bytes[seg_c] > 0) & (slot < slots[seg_c]) & (length > 0)
          & (length <= slot_bytes[seg_c]) & ns_known & np.isfinite(deadline) & (deadline >= 0))
    invalid = int(n - ok.sum())

    # one row per key, the latest write: sort on (ns, first 8 hash bytes), compare neighbours fully
    dup = np.zeros(n, dtype=bool)
    idx = np.flatnonzero(ok)
    if len(idx) > 1:
        hv = rec.view(_H0)
        h0, ns = hv["h0"][idx], hv["ns"][idx]
        order = np.lexsort((h0, ns))
        h0, ns = h0[order], ns[order]
        same = np.flatnonzero((h0[1:] == h0[:-1]) & (ns[1:] == ns[:-1]))
        raw = rec.view(np.uint8).reshape(n, REC.itemsize)
        seq = rec["seq"]
        best: dict[bytes, int] = {}
        for j in same:  # rare: only a crash between a rewrite and its delete leaves two rows
            for pos in (order[j], order[j + 1]):
                i = int(idx[pos])
                key = raw[i, KEY_SLICE].tobytes()
                other = best.setdefault(key, i)
                if other != i:
                    loser, best[key] = (i, other) if seq[i] < seq[other] else (other, i)
                    dup[loser] = True
    keep = ok & ~dup
    drop_locs = loc[~keep]
    kept = rec if keep.all() else rec[keep]
    over = np.flatnonzero(kept["deadline"] > now + max_ttl)
    if len(over):
        if not kept.flags.writeable:
            kept = kept.copy()
        kept["deadline"][over] = now + max_ttl
    return Rows(kept), drop_locs, invalid, int(dup.sum()), over
