"""CudaKVPool: an engine's paged KV pool in a dedicated CUDA allocation, registered by CUDA IPC.

    pool = CudaKVPool(num_blocks, block_bytes, layout="layer-first", num_layers=32, device=0)
    with KVClient(target, namespace, pool) as kv:   # OpenSession sends pool.description()
        ...kernels on the engine's stream write blocks 7 and 9...
        pool.record_ready()                         # after those kernels, before Store
        kv.store(hashes, [7, 9])                    # returns once the bytes left GPU memory
        kv.load(hashes, [3, 4])                     # returns once the bytes are in blocks 3 and 4

The daemon opens the IPC handle once per session and moves blocks between this allocation and
its pinned host tier on its own streams; only block ids travel over gRPC. Layouts as ShmKVPool:
block-contiguous (one region) or layer-first (2 x num_layers regions, a block is one row in each).

Ordering contract
  Store: whatever wrote the blocks must be ordered before the daemon reads them. record_ready()
    records this pool's interprocess CUDA event on the engine's stream; the daemon makes its copy
    stream wait for the event's latest record (cudaStreamWaitEvent), so the engine's host thread
    need not block. Without the event (ipc_event=False), synchronise the writing stream before
    Store. Once Store returns the bytes are in the daemon's host memory: the blocks may be reused.
  Load: when Load returns, the daemon has synchronised its stream and the bytes are in the pool;
    kernels launched afterwards on any stream see them.
  Never write a block while a Store or Load naming it is in flight.

Why a dedicated allocation: cudaIpcGetMemHandle exports a whole cudaMalloc allocation. A tensor
from torch's caching allocator is a piece of a larger segment that torch may split, reuse or free
behind the daemon's mapping, so the pool is its own cudaMalloc (cuda.bindings.runtime, or CuPy's
runtime when cuda-bindings is not installed), freed when the pool and every tensor viewing it
are gone. The daemon's mapping keeps the physical memory alive until the daemon closes it, also
after this process dies: the daemon notices the lost lease and unmaps within seconds.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch

from engine_client.shm_pool import LAYOUTS, Region, _regions
from kvwire.v1 import kvcache_pb2

__all__ = ["CudaKVPool", "LAYOUTS"]


class _Cuda:
    """The few runtime calls torch does not expose: cudaMalloc/cudaFree and cudaIpcGetMemHandle."""

    def __init__(self) -> None:
        want = os.environ.get("KVSERVICE_CUDA_RUNTIME", "")  # "cupy" forces the fallback (tests)
        self.rt = None
        if want != "cupy":
            try:
                from cuda.bindings import runtime

                self.rt = runtime
            except ImportError:
                pass
        if self.rt is None:
            import cupy.cuda.runtime

            self.cp = cupy.cuda.runtime
        self.name = "cuda.bindings" if self.rt is not None else "cupy"

    def _ok(self, what: str, result: Any) -> Any:
        err, *rest = result if isinstance(result, tuple) else (result,)
        if int(err) != 0:
            raise RuntimeError(f"{what} failed: {getattr(err, 'name', err)}")
        return rest[0] if rest else None

    def malloc(self, device: int, nbytes: int) -> int:
        if self.rt is not None:
            self._ok("cudaSetDevice", self.rt.cudaSetDevice(device))
            return int(self._ok("cudaMalloc", self.rt.cudaMalloc(nbytes)))
        self.cp.setDevice(device)
        return int(self.cp.malloc(nbytes))

    def free(self, device: int, ptr: int) -> None:
        if self.rt is not None:
            self._ok("cudaSetDevice", self.rt.cudaSetDevice(device))
            self._ok("cudaFree", self.rt.cudaFree(ptr))
        else:
            self.cp.setDevice(device)
            self.cp.free(ptr)

    def ipc_handle(self, ptr: int) -> bytes:
        if self.rt is not None:
            return bytes(self._ok("cudaIpcGetMemHandle", self.rt.cudaIpcGetMemHandle(ptr)).reserved)
        return bytes(self.cp.ipcGetMemHandle(ptr))


class _Allocation:
    """One cudaMalloc; freed when the last tensor over it (which holds this object) is gone."""

    def __init__(self, cuda: _Cuda, device: int, nbytes: int) -> None:
        self.ptr = cuda.malloc(device, nbytes)
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (self.ptr, False),
                                         "version": 3, "strides": None}
        self._free = weakref.finalize(self, _free, cuda, device, self.ptr)


def _free(cuda: _Cuda, device: int, ptr: int) -> None:
    try:
        torch.cuda.synchronize(device)  # no kernel of ours may still touch it
        cuda.free(device, ptr)
    except Exception:  # interpreter shutdown: the driver reclaims the process's memory anyway
        pass


def device_uuid(index: int) -> str:
    return "GPU-" + str(torch.cuda.get_device_properties(index).uuid).removeprefix("GPU-")


class CudaKVPool:
    """num_blocks blocks of block_bytes each, in one cudaMalloc on `device`."""

    def __init__(
        self,
        num_blocks: int,
        block_bytes: int,
        layout: str = "block-contiguous",
        num_layers: int = 1,
        device: int | str | torch.device | None = None,
        *,
        ipc_event: bool = True,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.layout = layout
        self.num_layers = num_layers
        self.regions: list[Region] = _regions(num_blocks, block_bytes, layout, num_layers)
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"CudaKVPool needs a CUDA device, got {dev}")
        self.device = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
        self.size = num_blocks * block_bytes
        cuda = _Cuda()
        self.runtime = cuda.name
        with torch.cuda.device(self.device):
            alloc = self._alloc = _Allocation(cuda, self.device.index, self.size)
            self._buffer: torch.Tensor | None = torch.as_tensor(alloc, device=self.device)
            if self._buffer.data_ptr() != alloc.ptr:
                raise RuntimeError("torch copied the pool allocation instead of viewing it")
            self._handle = cuda.ipc_handle(alloc.ptr)
            self.event = torch.cuda.Event(interprocess=True) if ipc_event else None
            self._event_handle = bytes(self.event.ipc_handle()) if self.event is not None else b""
        self.device_uuid = device_uuid(self.device.index)

    # --- the allocation
    @property
    def buffer(self) -> torch.Tensor:
        """The whole pool as a zero-copy torch.uint8 CUDA tensor."""
        if self._buffer is None:
            raise ValueError("CudaKVPool is closed")
        return self._buffer

    def region_view(self, r: int) -> torch.Tensor:
        """Region r as a [num_blocks, row bytes] view (layer-first: layer r // 2, K if r is even, V if odd)."""
        reg = self.regions[r]
        return self.buffer.as_strided((self.num_blocks, reg.block_bytes), (reg.block_stride, 1), reg.offset)

    def description(self) -> kvcache_pb2.PoolDescription:
        """What registration sends: blocks, regions, the IPC handles and the device's identity."""
        return kvcache_pb2.PoolDescription(
            num_blocks=self.num_blocks,
            regions=[kvcache_pb2.PoolRegion(offset=r.offset, block_stride=r.block_stride, block_bytes=r.block_bytes)
                     for r in self.regions],
            cuda=kvcache_pb2.CudaIpcHandle(handle=self._handle, device_index=self.device.index,
                                           device_uuid=self.device_uuid, size=self.size,
                                           event_handle=self._event_handle),
        )

    def registration_fds(self) -> list[int]:
        """No descriptors: the IPC handle in description() is the capability (registered on the same
        socket, so the session is bound to this process's uid as a shared-memory one is)."""
        return []

    def record_ready(self, stream: torch.cuda.Stream | None = None) -> None:
        """Record the store event on `stream` (default: the current stream): call after the kernels
        that wrote the blocks and before Store. Without an event, synchronises that stream instead."""
        stream = stream or torch.cuda.current_stream(self.device)
        if self.event is None:
            stream.synchronize()
        else:
            self.event.record(stream)

    # --- blocks (tests and tools; an engine's kernels write the pool directly)
    def read_block(self, block_id: int) -> bytes:
        """A host copy of block `block_id`: its row in every region, concatenated in region order."""
        b = self._check_id(block_id)
        rows = [self.region_view(r)[b] for r in range(len(self.regions))]
        return torch.cat(rows).cpu().numpy().tobytes()

    def write_block(self, block_id: int, data: bytes | bytearray | memoryview | torch.Tensor) -> None:
        """Overwrite block `block_id` with exactly block_bytes bytes, on the current stream."""
        b = self._check_id(block_id)
        src = data if isinstance(data, torch.Tensor) else torch.frombuffer(bytearray(data), dtype=torch.uint8)
        src = src.reshape(-1).view(torch.uint8).to(self.device, non_blocking=False)
        if src.numel() != self.block_bytes:
            raise ValueError(f"block data is {src.numel()} bytes, blocks are {self.block_bytes}")
        pos = 0
        for r, reg in enumerate(self.regions):
            self.region_view(r)[b].copy_(src[pos:pos + reg.block_bytes])
            pos += reg.block_bytes

    def _check_id(self, block_id: int) -> int:
        if not 0 <= int(block_id) < self.num_blocks:
            raise IndexError(f"block id {block_id} is out of range: the pool has blocks 0..{self.num_blocks - 1}")
        return int(block_id)

    # --- lifetime
    def close(self) -> None:
        """Drop this object's hold; the memory is freed once no tensor views it. Close the KVClient
        session first, so the daemon unmaps it."""
        self._buffer = None
        self._alloc = None

    def __enter__(self) -> CudaKVPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
