"""Block index: (namespace, hash) -> Entry, the one record of where a block's bytes are.

An entry exists while the block is in the host tier, waiting in the write queue, or on disk.
Tiers keep their own ordering structures (LRU, deadline heap) over the same entries.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvservice.types import BlockKey, NamespaceId, Tier


class DiskState(enum.IntEnum):
    NONE = 0  # no disk copy
    QUEUED = 1  # spill waiting in the write queue or being written
    ON_DISK = 2  # complete file under the disk path


@dataclass(slots=True, eq=False)
class Entry:
    key: BlockKey
    size: int
    checksum: int
    stored_at: float
    deadline: float = 0.0  # retention deadline, unix seconds; 0: never retained
    reuse: int = 0  # times loaded
    slot: int = -1  # byte offset of its slot in the host arena; -1: not in host memory
    spilling: bool = False  # evicted from the host tier: the slot goes once its disk write ends
    staged: bool = False  # while spilling: its bytes count on the spill staging budget, not the tier
    release_pending: bool = False  # the slot is to go, once the copies pinning it are done
    disk: DiskState = DiskState.NONE
    disk_path: str = ""
    disk_loc: int = -1  # disk tier v2 (segments): the block's segment slot, kvservice.disk.make_loc
    disk_deadline: float = 0.0  # deadline written in the disk header
    pins: int = 0  # copies or reads in flight that need the bytes to stay
    lease_until: float = 0.0  # prefetch lease: evictable again after this
    lease_owner: str = ""  # session that holds the prefetch lease
    ready: bool = True  # False while a Store is still copying its bytes in

    @property
    def namespace(self) -> NamespaceId:
        return self.key.namespace

    def retained(self, now: float) -> bool:
        return self.deadline > now

    def pinned(self, now: float) -> bool:
        return self.pins > 0 or self.lease_until > now

    @property
    def in_memory(self) -> bool:
        """Bytes available without disk I/O: in the host tier, or in a slot a spill still holds."""
        return self.slot >= 0

    @property
    def host_buf(self) -> int | None:
        """The slot offset while the block's bytes count on the host tier (not on the spill staging
        budget); None otherwise. What the host tier's used bytes add up (tests count by it)."""
        return self.slot if self.slot >= 0 and not self.staged else None

    @property
    def tier(self) -> Tier:
        if self.slot >= 0:
            return Tier.HOST
        if self.disk == DiskState.ON_DISK:
            return Tier.DISK
        return Tier.NONE


@dataclass(slots=True)
class BlockIndex:
    entries: dict[BlockKey, Entry] = field(default_factory=dict)

    def get(self, key: BlockKey) -> Entry | None:
        e = self.entries.get(key)
        return e if e is not None and e.ready else None

    def get_any(self, key: BlockKey) -> Entry | None:
        return self.entries.get(key)

    def add(self, entry: Entry) -> None:
        self.entries[entry.key] = entry

    def remove(self, entry: Entry) -> None:
        if self.entries.get(entry.key) is entry:
            del self.entries[entry.key]

    def __len__(self) -> int:
        return len(self.entries)

    def values(self):
        return self.entries.values()
