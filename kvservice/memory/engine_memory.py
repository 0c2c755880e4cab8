"""Engine memory: the daemon's mapping of one engine's registered KV pool.

Primitives:
  gather(block_ids) -> [row per block]            copy blocks out of the engine pool into host rows
  gather_with_checksums(block_ids) -> rows, crcs  the same, with the CRC32C of each row
  gather_into(block_ids, arena, offsets) -> crcs   copy blocks straight into host arena slots
  alloc_host(n) -> [buffer or None per block]     where disk reads for this pool should land
  scatter(block_ids, srcs)                        copy one host buffer per block into the engine pool
  scatter_from(block_ids, arena, offsets)         copy host arena slots into the engine pool (no per-block objects)
  close()                                         unmap once no copy is in flight

A block's bytes are the concatenation of its row in every region, in region order, so both
block-contiguous (one region) and layer-first (2 x layers regions) pools work with one copy
per region per batch. CPU hosts pass a shared-memory file descriptor; GPU hosts register a
CUDA IPC handle (cuda_memory.CudaEngineMemory, whose rows are pinned). The rows become host-tier
buffers as they are: views into slabs, so a batch costs a few copies, not one per block.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
from collections.abc import Callable, Sequence

import torch

from kvservice.checksum import checksum
from kvservice.memory.engine_pool import EngineMemory, InFlight, validate_layout
from kvservice.memory.host_arena import HostArena, runs
from kvservice.memory.key_groups import KeyGroupMemory
from kvservice.core.sessions_api import PoolSpec
from kvservice.core.types import CacheError, ErrorCode

SLAB_BYTES = 16 << 20  # host rows are carved from slabs below glibc's largest mmap threshold


class ShmEngineMemory:
    """A shared-memory pool, mapped once from the descriptor its engine passed (never opened by name).

    The descriptor is the peer's own capability: whatever it can map read-write, and nothing else,
    is what this session may touch. It is consumed (closed) here, mapped or not.
    """

    def __init__(self, spec: PoolSpec) -> None:
        fd = spec.shm_fd
        if fd < 0:
            raise CacheError(ErrorCode.INVALID_ARGUMENT,
                             "a shared-memory pool must come with its file descriptor (SCM_RIGHTS on the "
                             "registration socket); the daemon never opens a segment by name")
        try:
            validate_layout(spec)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CacheError(ErrorCode.INVALID_ARGUMENT,
                                 "the pool's file descriptor is not a shared-memory segment or memfd (not a regular file)")
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
                raise CacheError(ErrorCode.INVALID_ARGUMENT, "the pool's file descriptor must be open read-write")
            if st.st_size < spec.size:
                raise CacheError(ErrorCode.INVALID_ARGUMENT,
                                 f"the pool's segment has {st.st_size} bytes, pool.shm.size says {spec.size}")
            self._mm = mmap.mmap(fd, spec.size)
        finally:
            os.close(fd)
        self.spec = spec
        self.num_blocks = spec.num_blocks
        self.block_bytes = spec.block_bytes
        # copy in 8-byte words when the layout allows: uint8 gathers run several times slower
        word = 8 if all(r.offset % 8 == 0 and r.block_stride % 8 == 0 and r.block_bytes % 8 == 0
                        for r in spec.regions) and spec.size % 8 == 0 else 1
        self._word = word
        self._base = torch.frombuffer(self._mm, dtype=torch.int64 if word == 8 else torch.uint8)
        self._views = [
            self._base.as_strided((spec.num_blocks, r.block_bytes // word), (r.block_stride // word, 1), r.offset // word)
            for r in spec.regions
        ]
        self._inflight = InFlight()

    def gather(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        """One host row per block, as views into slabs of at most SLAB_BYTES: freed slabs go back
        to the heap and are reused without fresh page faults (kvservice.ops.heap)."""
        idx = torch.as_tensor(list(block_ids), dtype=torch.long)
        per_slab = max(1, SLAB_BYTES // self.block_bytes)
        rows: list[torch.Tensor] = []
        with self._inflight:
            for lo in range(0, len(idx), per_slab):
                part = idx[lo:lo + per_slab]
                if len(self._views) == 1:
                    slab = self._views[0].index_select(0, part)
                else:
                    slab = torch.cat([v.index_select(0, part) for v in self._views], dim=1)
                rows.extend(slab.view(torch.uint8).unbind(0))
        return rows

    def gather_with_checksums(self, block_ids: Sequence[int]) -> tuple[list[torch.Tensor], list[int]]:
        rows = self.gather(block_ids)
        return rows, [checksum(row) for row in rows]

    SIGNALS_ENQUEUED = True  # as CudaEngineMemory's; a CPU copy has no device queue to fill: at once

    def gather_into(self, block_ids: Sequence[int], arena: HostArena, offsets: Sequence[int],
                    enqueued: Callable[[], None] | None = None) -> list[int]:
        """Copy blocks straight into host arena slots (one index_select per run of adjacent slots
        and region); returns the CRC32C of each. enqueued(): called first (the CUDA memory calls it
        once its copies are queued on the device; this copy runs on this thread, nothing to queue)."""
        bb = self.block_bytes
        if enqueued is not None:
            enqueued()
        with self._inflight:
            for part, dst in self._slot_runs(block_ids, arena, offsets):
                if len(self._views) == 1:
                    torch.index_select(self._views[0], 0, part, out=dst)
                    continue
                col = 0
                for v in self._views:
                    width = v.shape[1]
                    dst[:, col:col + width] = v.index_select(0, part)
                    col += width
        flat = arena.base.numpy()  # numpy slices: a torch slice per block costs more than a 4 KiB CRC
        return [checksum(flat[o:o + bb]) for o in offsets]

    def _slot_runs(self, block_ids: Sequence[int], arena: HostArena, offsets: Sequence[int]):
        """(engine block ids, [n, row] view of their slots) per run of adjacent arena slots, in the
        pool's copy word (8 bytes when the layout allows)."""
        bb = self.block_bytes
        idx = torch.as_tensor(list(block_ids), dtype=torch.long)
        for first, n, off in runs(offsets, bb):
            rows = arena.base[off:off + n * bb]
            yield idx[first:first + n], rows.view(torch.int64).view(n, bb // 8) if self._word == 8 else rows.view(n, bb)

    def alloc_host(self, n: int, row_bytes: int = 0) -> list[None]:
        return [None] * n  # any CPU buffer will do: the reader allocates its own

    def scatter(self, block_ids: Sequence[int], srcs: Sequence[torch.Tensor]) -> None:
        # one memcpy per block and region, straight from each host buffer: no staging copy
        with self._inflight:
            for b, src in zip(block_ids, srcs):
                words = src.view(torch.int64) if self._word == 8 and src.data_ptr() % 8 == 0 else None
                col = 0
                for view in self._views:
                    width = view.shape[1]
                    if words is not None:
                        view[b].copy_(words[col:col + width])
                    else:
                        view[b].view(torch.uint8).copy_(src[col * self._word:(col + width) * self._word])
                    col += width

    def scatter_from(self, block_ids: Sequence[int], arena: HostArena, offsets: Sequence[int],
                     enqueued: Callable[[], None] | None = None) -> None:
        """Host arena slots -> engine pool: one index_copy_ per run of adjacent slots and region.
        enqueued(): called first, as in gather_into."""
        if enqueued is not None:
            enqueued()
        with self._inflight:
            for part, src in self._slot_runs(block_ids, arena, offsets):
                col = 0
                for v in self._views:
                    width = v.shape[1]
                    v.index_copy_(0, part, src[:, col:col + width] if len(self._views) > 1 else src)
                    col += width

    def close(self) -> None:
        if self._inflight.closed:
            return
        self._inflight.close_when_idle()
        # the mmap refuses to close while tensors still export its buffer
        self._views = []
        self._base = None  # type: ignore[assignment]
        self._mm.close()


def open_engine_memory(spec: PoolSpec) -> EngineMemory:
    """The pool's memory, in daemon blocks: a pool of blocks_per_key > 1 through KeyGroupMemory."""
    if spec.kind == "shm":
        memory: EngineMemory = ShmEngineMemory(spec)
    elif spec.kind == "cuda":
        from kvservice.memory.cuda_memory import CudaEngineMemory  # lazy: CPU hosts never load CUDA libraries

        memory = CudaEngineMemory(spec)
    else:
        raise CacheError(ErrorCode.INVALID_ARGUMENT, f"unknown pool kind {spec.kind!r}")
    return KeyGroupMemory(memory, spec.blocks_per_key) if spec.blocks_per_key > 1 else memory
