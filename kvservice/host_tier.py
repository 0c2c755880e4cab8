"""Host tier: daemon memory holding block bytes, byte-capacity bounded, LRU.

Primitives:
  free_bytes                                room left
  reserve(nbytes) / unreserve(nbytes)       hold room while a Store copies bytes in
  add(chain, bufs, reserved)                insert entries (head first) with their buffers
  touch(chain)                              refresh LRU order on a hit
  entries_oldest_first()                    LRU order, for the eviction plan (tiers.Tiers)
  remove(entry) -> buffer                   take an entry's bytes out of the tier
Which entries are victims, and whether a victim spills to disk or is dropped, is decided in
tiers.Tiers with eviction's policies, not here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvservice.index import Entry
from kvservice.lru import ChainLRU


class HostTier:
    name = "host"

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._lru = ChainLRU()

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def __len__(self) -> int:
        return len(self._lru)

    def entries(self):
        return self._lru.values()

    def entries_oldest_first(self):
        return self._lru.oldest_first()

    def reserve(self, nbytes: int) -> None:
        self.used_bytes += nbytes
        assert self.used_bytes <= self.capacity_bytes, "host tier over capacity"

    def unreserve(self, nbytes: int) -> None:
        self.used_bytes -= nbytes

    def add(self, chain: Sequence[Entry], bufs: Sequence[torch.Tensor], reserved: bool = False) -> None:
        for e, b in zip(chain, bufs):
            assert e.host_buf is None
            e.host_buf = b
            if not reserved:
                self.used_bytes += e.size
        assert self.used_bytes <= self.capacity_bytes, "host tier over capacity"
        self._lru.touch(chain)

    def touch(self, chain: Sequence[Entry]) -> None:
        self._lru.touch([e for e in chain if e in self._lru])

    def remove(self, entry: Entry) -> torch.Tensor:
        buf = entry.host_buf
        assert buf is not None
        entry.host_buf = None
        self.used_bytes -= entry.size
        self._lru.discard(entry)
        return buf
