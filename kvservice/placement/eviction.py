"""Where eviction is decided: the host admission gate and the disk victim order (DESIGN §5).

Disk victims, in this order:
  1. free space                                  (no victim)
  2. unmarked blocks, LRU, tail of a chain before its head; then best-effort spills still
     queued for writing (cancelling one costs no I/O, and it is the most recent)
  3. expired retained blocks, oldest deadline first
  4. unexpired retained blocks in deadline order (never, under protect-unexpired)
Pinned blocks (reads in flight, prefetch leases) are never victims. A plan is all or nothing:
if the needed bytes cannot be freed, nothing is evicted and admission is refused.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvservice.disk.disk_tier import DiskTier
from kvservice.ops.config import Config
from kvservice.placement.index import Entry


class VictimClass(enum.Enum):
    UNMARKED = "disk_evictions_unmarked"  # counter name
    EXPIRED = "disk_evictions_expired"
    RETAINED = "disk_evictions_retained"


@dataclass(frozen=True, slots=True)
class Victim:
    entry: Entry
    cls: VictimClass


class DiskRoom:
    """The disk bytes spills could get without evicting an unexpired retained block (free space, then
    unpinned unmarked blocks, then unpinned expired retained ones), counted only as far as someone asks:
    `take(n)` walks the disk order just until n bytes are covered, so an evicting Store costs what it
    evicts, not a walk of the whole disk tier (a 1M-block tier was summed on every evicting Store).
    Same answers as summing everything first: a take that finds too little leaves the whole sum, and
    later smaller takes still draw on it."""

    __slots__ = ("_sizes", "room")

    def __init__(self, free: int, sizes: Iterator[int]) -> None:
        self.room = free
        self._sizes = sizes

    @classmethod
    def of(cls, tier: DiskTier, now: float) -> DiskRoom:
        sizes = itertools.chain(
            (e.size for e in tier.unmarked.values() if not e.pinned(now)),
            (e.size for e in tier.retained.values() if e.deadline <= now and not e.pinned(now)))
        return cls(tier.free_bytes, sizes)

    @classmethod
    def none(cls) -> DiskRoom:
        return cls(0, iter(()))

    def take(self, nbytes: int) -> bool:
        """Reserve nbytes of the room; False (nothing taken) when the room cannot cover them."""
        while self.room < nbytes:
            size = next(self._sizes, None)
            if size is None:
                return False
            self.room += size
        self.room -= nbytes
        return True


def plan_disk_eviction(tier: DiskTier, nbytes: int, now: float, protect_unexpired: bool) -> list[Victim] | None:
    need = nbytes - tier.free_bytes
    if need <= 0:
        return []
    plan: list[Victim] = []
    for e in tier.unmarked.oldest_first():
        if e.pinned(now):
            continue
        plan.append(Victim(e, VictimClass.UNMARKED))
        need -= e.size
        if need <= 0:
            return plan
    for e in list(tier.queued.values()):
        if e.pinned(now) or e.retained(now) or e.deadline > 0:
            continue
        plan.append(Victim(e, VictimClass.UNMARKED))
        need -= e.size
        if need <= 0:
            return plan
    by_deadline = sorted((e for e in tier.retained.values() if not e.pinned(now)), key=lambda e: e.deadline)
    for e in by_deadline:
        expired = e.deadline <= now
        if not expired and protect_unexpired:
            break
        plan.append(Victim(e, VictimClass.EXPIRED if expired else VictimClass.RETAINED))
        need -= e.size
        if need <= 0:
            return plan
    return None


Gate = Callable[[Entry, float], bool]


def admission_gate(config: Config) -> Gate:
    """Whether a host victim may spill to disk. Unexpired retained blocks always may."""
    gate = config.admission_gate
    if gate == "all":
        return lambda e, now: True
    if gate == "retained-only":
        return lambda e, now: e.retained(now)
    k = config.min_reuse
    if k <= 0:
        raise ValueError(f"admission_gate: unknown gate {gate!r}")
    return lambda e, now: e.retained(now) or e.reuse >= k
