"""BlockAllocator: the GPU tier's block ids, each free, in use, or held until its offload lands.

Primitives:
  allocate(n)          -> n free block ids, or None (all or nothing)
  free(blocks)         back to the free list now
  hold(blocks, until)  back to the free list once the future `until` is done: an evicted block's
                       bytes are being copied to the daemon (Store), so it must not be written yet
  reclaim()            move held blocks whose future finished to the free list

Which blocks to give up is the radix tree's business (RadixCache.evict); this only counts.
"""

from __future__ import annotations

import concurrent.futures
from collections import deque
from collections.abc import Iterable
from typing import Any

from model_runner.radix import BlockId


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[BlockId] = deque(BlockId(b) for b in range(num_blocks))
        self._is_free = [True] * num_blocks
        self._held: list[tuple[concurrent.futures.Future[Any], list[BlockId]]] = []

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def held_count(self) -> int:
        """Blocks waiting for an offload to finish before they can be reused."""
        return sum(len(blocks) for _, blocks in self._held)

    def held_until(self) -> list[concurrent.futures.Future[Any]]:
        """The futures held blocks wait for."""
        return [f for f, _ in self._held]

    def allocate(self, n: int) -> list[BlockId] | None:
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            return None
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._is_free[b] = False
        return out

    def free(self, blocks: Iterable[BlockId]) -> None:
        for b in blocks:
            if not 0 <= b < self.num_blocks:
                raise IndexError(f"block {b} is outside the pool's {self.num_blocks} blocks")
            if self._is_free[b]:
                raise RuntimeError(f"double free of block {b}")
            self._is_free[b] = True
            self._free.append(b)

    def hold(self, blocks: list[BlockId], until: concurrent.futures.Future[Any]) -> None:
        if blocks:
            self._held.append((until, blocks))

    def reclaim(self) -> int:
        """Free the blocks whose offload finished (whatever its outcome); how many came back."""
        done, pending = [], []
        for item in self._held:  # one pass: a future may finish while we look (another thread)
            (done if item[0].done() else pending).append(item)
        if not done:
            return 0
        self._held = pending
        n = 0
        for _, blocks in done:
            self.free(blocks)
            n += len(blocks)
        return n
