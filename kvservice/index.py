"""Block index: (namespace, hash) -> Entry, the one record of where a block's bytes are.

An entry exists while the block is in the host tier, waiting in the write queue, or on disk.
Tiers keep their own ordering structures (LRU, deadline heap) over the same entries.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

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
    host_buf: torch.Tensor | None = None  # bytes in the host tier
    spill_buf: torch.Tensor | None = None  # bytes held by the write queue (left host accounting)
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

    def memory_buf(self) -> torch.Tensor | None:
        """Bytes available without disk I/O (host tier or a queued spill)."""
        return self.host_buf if self.host_buf is not None else self.spill_buf

    @property
    def tier(self) -> Tier:
        if self.memory_buf() is not None:
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
