"""ShmKVPool: an engine's paged KV pool in POSIX shared memory (the CPU-host registration path).

The daemon maps the segment from its file descriptor, which the engine passes over the
registration socket (`description()` is the OpenSessionRequest's pool, `registration_fds()`
the descriptor sent with it); it never opens the segment by name, so a session can touch only
memory its own process handed over. The daemon then moves block bytes in and out of it
directly. Two byte layouts:

  block-contiguous  one region; block b is one row of block_bytes at b * block_bytes.
  layer-first       2 * num_layers regions (layer 0 K, layer 0 V, layer 1 K, ...), each of
                    num_blocks rows of block_bytes / (2 * num_layers); block b is row b of
                    every region, concatenated in region order.

Lifetime:
  - The creating process owns the segment: `unlink()` removes its name, and so does normal
    interpreter exit or garbage collection of the pool (a weakref.finalize, only in the
    creating pid, so a forked child exiting does not unlink its parent's pool). If the owner
    is killed, Python's resource_tracker unlinks the leaked segment (with a warning): that is
    the crash safety net, so the owner stays registered with it.
  - `attach()` maps an existing segment without owning it. On Python < 3.13 SharedMemory
    registers even attached segments with the resource_tracker, which would unlink the owner's
    pool when the attaching process exits; attach() unregisters it (3.13+: track=False).
  - `.buffer` is a zero-copy torch.uint8 view of the whole segment. Tensors derived from it
    keep the mapping alive: `close()` drops this object's hold, and the memory is unmapped
    when the last such tensor is freed, so a view can never dangle.
"""

from __future__ import annotations

import operator
import os
import sys
import uuid
import weakref
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import torch

from kvwire.v1 import kvcache_pb2

LAYOUTS = ("block-contiguous", "layer-first")

_created_here: set[str] = set()  # segments this process created (and registered with the resource_tracker)


@dataclass(frozen=True, slots=True)
class Region:
    """Row b of this region is at offset + b * block_stride and is block_bytes long."""

    offset: int
    block_stride: int
    block_bytes: int


class ShmKVPool:
    """num_blocks blocks of block_bytes each, in one shared-memory segment."""

    def __init__(
        self,
        num_blocks: int,
        block_bytes: int,
        layout: str = "block-contiguous",
        num_layers: int = 1,
        *,
        _attach_name: str | None = None,
    ) -> None:
        """Create (and own) a new segment named kvpool_<pid>_<8 hex>; use attach() to map one."""
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.layout = layout
        self.num_layers = num_layers
        self.regions: list[Region] = _regions(num_blocks, block_bytes, layout, num_layers)
        nbytes = num_blocks * block_bytes
        if _attach_name is None:
            name = f"kvpool_{os.getpid()}_{uuid.uuid4().hex[:8]}"
            shm = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
            _created_here.add(shm.name)
            self.owner = True
        else:
            shm = _attach_untracked(_attach_name)
            self.owner = False
            if shm.size < nbytes:
                _abandon_mapping(shm)
                raise ValueError(f"segment {_attach_name!r} is {shm.size} bytes, the pool needs {nbytes}")
        self._shm = shm
        self._view: memoryview | None = memoryview(shm.buf)
        self._buffer: torch.Tensor | None = torch.frombuffer(self._view, dtype=torch.uint8)
        self._unlinker = weakref.finalize(self, _unlink, shm, os.getpid()) if self.owner else None
        self._closer = weakref.finalize(self, _abandon_mapping, shm)

    @classmethod
    def attach(
        cls, name: str, num_blocks: int, block_bytes: int, layout: str = "block-contiguous", num_layers: int = 1
    ) -> ShmKVPool:
        """Map an existing pool segment by name, without owning it (close() only, never unlink)."""
        return cls(num_blocks, block_bytes, layout, num_layers, _attach_name=name)

    # --- the segment
    @property
    def name(self) -> str:
        """The POSIX shared-memory name, without the leading slash."""
        return self._shm.name

    @property
    def size(self) -> int:
        """Bytes of the mapped segment (at least num_blocks * block_bytes)."""
        return self._shm.size

    @property
    def buffer(self) -> torch.Tensor:
        """The whole segment as a zero-copy torch.uint8 tensor."""
        if self._buffer is None:
            raise ValueError("ShmKVPool is closed")
        return self._buffer

    def description(self) -> kvcache_pb2.PoolDescription:
        """What registration sends: block count, regions, the segment's size (the memory itself
        travels as the descriptor of registration_fds(), never as a name)."""
        return kvcache_pb2.PoolDescription(
            num_blocks=self.num_blocks,
            regions=[kvcache_pb2.PoolRegion(offset=r.offset, block_stride=r.block_stride, block_bytes=r.block_bytes)
                     for r in self.regions],
            shm=kvcache_pb2.ShmHandle(size=self.size),
        )

    def registration_fds(self) -> list[int]:
        """A new read-write descriptor of the segment, for the registration to pass (SCM_RIGHTS);
        the caller closes it once sent."""
        if self._view is None:
            raise ValueError("ShmKVPool is closed")
        fd = getattr(self._shm, "_fd", -1)  # SharedMemory keeps the segment's descriptor open while mapped
        if fd >= 0:
            return [os.dup(fd)]
        return [os.open(f"/dev/shm/{self.name}", os.O_RDWR | os.O_NOFOLLOW)]

    # --- blocks
    def read_block(self, block_id: int) -> bytes:
        """A copy of block `block_id`: its row in every region, concatenated in region order."""
        view, b = self._live_view(), self._check_id(block_id)
        return b"".join(view[r.offset + b * r.block_stride : r.offset + b * r.block_stride + r.block_bytes]
                        for r in self.regions)

    def write_block(self, block_id: int, data: bytes | bytearray | memoryview) -> None:
        """Overwrite block `block_id` with exactly block_bytes bytes (split over regions as read_block reads)."""
        view, b = self._live_view(), self._check_id(block_id)
        src = memoryview(data).cast("B")
        if len(src) != self.block_bytes:
            raise ValueError(f"block data is {len(src)} bytes, blocks are {self.block_bytes}")
        pos = 0
        for r in self.regions:
            start = r.offset + b * r.block_stride
            view[start : start + r.block_bytes] = src[pos : pos + r.block_bytes]
            pos += r.block_bytes

    # --- lifetime
    def close(self) -> None:
        """Drop this object's mapping. Idempotent; tensors derived from .buffer stay valid."""
        self._buffer = None
        self._view = None
        self._closer()

    def unlink(self) -> None:
        """Remove the segment's name (owner only; idempotent). Existing mappings stay valid."""
        if self._unlinker is None:
            raise PermissionError(f"ShmKVPool {self.name!r} was attached, not created: only its owner unlinks it")
        self._unlinker()

    def __enter__(self) -> ShmKVPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self.owner:
            self.unlink()

    def _live_view(self) -> memoryview:
        if self._view is None:
            raise ValueError("ShmKVPool is closed")
        return self._view

    def _check_id(self, block_id: int) -> int:
        try:
            b = operator.index(block_id)
        except TypeError:
            raise TypeError(f"block id must be an int, got {type(block_id).__name__}") from None
        if not 0 <= b < self.num_blocks:
            raise IndexError(f"block id {b} is out of range: the pool has blocks 0..{self.num_blocks - 1}")
        return b


def _regions(num_blocks: int, block_bytes: int, layout: str, num_layers: int) -> list[Region]:
    if num_blocks < 1 or block_bytes < 1:
        raise ValueError(f"num_blocks ({num_blocks}) and block_bytes ({block_bytes}) must be >= 1")
    if layout == "block-contiguous":
        return [Region(0, block_bytes, block_bytes)]
    if layout != "layer-first":
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    rows = 2 * num_layers
    if block_bytes % rows:
        raise ValueError(f"layer-first: block_bytes {block_bytes} is not divisible by 2 * num_layers = {rows}")
    row = block_bytes // rows
    return [Region(r * num_blocks * row, row, row) for r in range(rows)]


def _attach_untracked(name: str) -> shared_memory.SharedMemory:
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    shm = shared_memory.SharedMemory(name=name)
    # Undo SharedMemory's registration of a segment this process does not own (bpo-39959). The
    # tracker keeps one entry per name, so for our own segment that would drop the owner's entry.
    if shm.name not in _created_here:
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm


def _abandon_mapping(shm: shared_memory.SharedMemory) -> None:
    """Close `shm` without unmapping memory that live tensors may still alias.

    SharedMemory.close() would munmap (or raise BufferError if exports remain). Handing the mmap
    to the memoryviews that reference it instead unmaps it exactly when the last one is freed.
    """
    shm._mmap = None  # type: ignore[attr-defined]  # the remaining memoryviews keep the mmap object alive
    shm.close()  # releases SharedMemory's own view and closes the fd


def _unlink(shm: shared_memory.SharedMemory, creator_pid: int) -> None:
    if os.getpid() != creator_pid:
        return
    _created_here.discard(shm.name)
    try:
        shm.unlink()
    except FileNotFoundError:
        # Someone removed the name already; still stop the resource_tracker from reporting a leak.
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
