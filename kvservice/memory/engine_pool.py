"""What the daemon's mapping of an engine's KV pool offers, whatever the pool's kind (shared
memory on CPU hosts, a CUDA IPC allocation on GPU hosts), and what every kind shares: the layout
check and the count of copies in flight that keeps close() from unmapping under a copy.
engine_memory (shm) and cuda_memory (CUDA) both import this; neither imports the other's privates.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from kvservice.memory.host_arena import HostArena
from kvservice.core.sessions_api import PoolSpec
from kvservice.core.types import CacheError, ErrorCode


class EngineMemory(Protocol):
    block_bytes: int
    num_blocks: int

    def gather(self, block_ids: Sequence[int]) -> Sequence[torch.Tensor]: ...

    def gather_with_checksums(self, block_ids: Sequence[int]) -> tuple[Sequence[torch.Tensor], list[int]]: ...

    # gather_into / scatter_from call enqueued() once their copies are queued (before the wait for them) when
    # the memory sets SIGNALS_ENQUEUED (kvservice.core.pipeline.copy_call passes it only then)
    SIGNALS_ENQUEUED: bool

    def gather_into(self, block_ids: Sequence[int], arena: HostArena, offsets: Sequence[int],
                    enqueued: Callable[[], None] | None = None) -> list[int]: ...

    # n host buffers of row_bytes each (0: block_bytes) where disk reads land; None items: any buffer will do
    def alloc_host(self, n: int, row_bytes: int = 0) -> Sequence[torch.Tensor | None]: ...

    def scatter(self, block_ids: Sequence[int], srcs: Sequence[torch.Tensor]) -> None: ...

    def scatter_from(self, block_ids: Sequence[int], arena: HostArena, offsets: Sequence[int],
                     enqueued: Callable[[], None] | None = None) -> None: ...

    def close(self) -> None: ...


def validate_layout(spec: PoolSpec) -> None:
    """Every region row of every block must lie inside the allocation."""
    if spec.num_blocks <= 0:
        raise CacheError(ErrorCode.INVALID_ARGUMENT, "pool.num_blocks must be > 0")
    if not spec.regions:
        raise CacheError(ErrorCode.INVALID_ARGUMENT, "pool.regions is empty")
    for i, r in enumerate(spec.regions):
        if r.block_bytes <= 0 or r.block_stride < r.block_bytes:
            raise CacheError(ErrorCode.INVALID_ARGUMENT,
                             f"pool.regions[{i}]: need 0 < block_bytes <= block_stride, got {r.block_bytes}, {r.block_stride}")
        end = r.offset + (spec.num_blocks - 1) * r.block_stride + r.block_bytes
        if end > spec.size:
            raise CacheError(ErrorCode.INVALID_ARGUMENT,
                             f"pool.regions[{i}] ends at byte {end}, past the pool size {spec.size}")


class InFlight:
    """Counts copies in flight so that close() never unmaps under a running copy."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._n = 0
        self.closed = False

    def __enter__(self) -> None:
        with self._cv:
            if self.closed:
                raise CacheError(ErrorCode.NOT_FOUND, "session closed: its pool mapping is released")
            self._n += 1

    def __exit__(self, *exc: object) -> None:
        with self._cv:
            self._n -= 1
            self._cv.notify_all()

    def close_when_idle(self) -> None:
        with self._cv:
            self.closed = True
            while self._n:
                self._cv.wait()
