"""CUDA engine memory: the daemon's mapping of an engine's KV pool, opened from a CUDA IPC handle.

Primitives (the EngineMemory protocol of engine_memory.py, plus two the cache uses when present):
  CudaEngineMemory(spec)              open the IPC handle on the engine's device; map the pool once
  gather_with_checksums(ids)          engine GPU -> pinned host rows, with the CRC32C of each row
  gather(ids)                         the same rows, without checksums
  scatter(ids, srcs)                  host rows -> engine GPU; returns once the bytes have landed
  alloc_host(n)                       n pinned host rows (disk reads land here, then go to the GPU)
  close()                             wait for copies in flight, close the IPC handles

Ordering contract (what each side guarantees; engine_client.cuda_pool says it from the engine's side)
  Store: the engine's kernels that wrote the blocks must be ordered before the daemon's copy. Either
    the pool registered an interprocess event and the engine records it after those kernels, before
    sending Store (the daemon's stream waits on it with cudaStreamWaitEvent, so the engine's host
    thread never blocks), or the engine synchronises its stream before sending Store. The reply
    comes after the bytes are in pinned host memory and checksummed: the blocks may be reused.
  Load: the reply comes after the daemon synchronised its own stream, so the bytes are in the
    engine's memory; any later engine kernel sees them, with no event needed on the engine side.
  The engine must not write a block while a Store or Load naming it is in flight.

How a batch moves (a few launches and copies per batch, never one per block per region)
  The pool is viewed as [regions, num_blocks, row] with the widest integer element that divides
  every offset, stride and row (int64 for real layouts); both engine_client layouts, block-contiguous
  (1 region) and layer-first (2 x layers regions), are such a view, so one indexing kernel moves a
  whole chunk of blocks across every region. Other region lists fall back to one kernel per region.
  Each lane (the streams one copy job uses) owns STAGING_SLOTS chunks of device staging, allocated
  once and reused in turn, so a batch of any size holds a fixed amount of the engine's GPU memory.
  Store: per chunk, one gather kernel into a staging slot, the GPU CRC32C of its rows on the same
  stream, and on the DMA stream the D2H copies of its runs of adjacent arena slots (one per run):
  chunk k+1 gathers while chunk k is in flight.
  Load: per chunk, the H2D copies of its runs of adjacent slots into a staging slot (many runs: one
  cudaMemcpyBatchAsync), then one scatter kernel on the other stream.
  Offsets and runs are numpy arrays: no Python work per block on these paths.
  Pinned chunks that alloc_host hands out hold a power-of-two number of rows (torch's pinned
  allocator rounds every request up to a power of two bytes).

Devices: the engine's device is found by UUID (its index may differ under another
CUDA_VISIBLE_DEVICES). A device gets CUDA state (context, streams) only when a session registers a
pool on it; when its last session closes, the cached staging memory is released.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from kvservice import checksum as _checksum
from kvservice.memory.cuda_launch import LaneLaunches, Launcher, PoolRows
from kvservice.memory.engine_pool import InFlight, validate_layout
from kvservice.memory.host_arena import HostArena, runs
from kvservice.core.sessions_api import PoolSpec
from kvservice.core.types import CacheError, ErrorCode
from kvservice.ops.trace import TRACE

log = logging.getLogger(__name__)

# pipeline granularity: copy chunk k+1 while checksumming / scattering chunk k (KVTUNE_COPY_CHUNK_MIB: an A/B).
# Each chunk costs the copy thread a fixed set of launches (gather or scatter, CRC, DMA, events) that holds
# the GIL against the event loop; at small blocks a 32 MiB chunk was that cost every 512 rows of 64 KiB.
# 32 -> 128 MiB with 2 staging slots a lane (4 x 32 -> 2 x 128: 256 MiB of device staging a lane, was 128),
# H100, 2 GiB batches, three calls: Loads of 256 KiB blocks 0.74-0.88 -> 0.83-0.89 x H2D and of 64 KiB
# 0.47-0.58 -> 0.55-0.71; 256 KiB Stores 0.62-0.75 -> 0.65-0.73; 2 MiB unchanged (BENCHMARKS.md).
CHUNK_BYTES = max(1, int(os.environ.get("KVTUNE_COPY_CHUNK_MIB", "128"))) << 20
# device staging chunks per lane, reused in turn while the DMA engine drains the one before (KVTUNE_STAGING_SLOTS)
STAGING_SLOTS = max(2, int(os.environ.get("KVTUNE_STAGING_SLOTS", "2")))
MAX_RUN_COPIES = 16  # per chunk; more runs than this go through one cudaMemcpyBatchAsync
CRC_THREADS = max(1, min(16, (os.cpu_count() or 2) - 2))  # ~6 GB/s each: the store's CRC must keep up with DMA
_ELEMENT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}

_lock = threading.Lock()
_devices: dict[int, _Device] = {}
_open_mappings = 0
_crc_pool: ThreadPoolExecutor | None = None


# --- CUDA runtime calls torch does not expose (IPC handles, batched copies)


class _Runtime:
    """cuda.bindings.runtime when installed, else CuPy's runtime module: byte handles in, ints out."""

    def __init__(self) -> None:
        try:
            from cuda.bindings import runtime as rt
        except ImportError:
            rt = None
        self._rt = rt
        if rt is None:
            try:
                import cupy.cuda.runtime as cp_rt
            except ImportError as e:
                raise CacheError(ErrorCode.FAILED_PRECONDITION,
                                 "opening a CUDA IPC pool needs cuda-bindings (pip install cuda-bindings) "
                                 f"or CuPy on the daemon's host: {e}") from None
            self._cp = cp_rt
        self.name = "cuda.bindings" if rt is not None else "cupy"

    def _ok(self, what: str, result: Any) -> Any:
        err, *rest = result if isinstance(result, tuple) else (result,)
        if int(err) != 0:
            _, msg = self._rt.cudaGetErrorString(err)
            raise RuntimeError(f"{what}: {err.name if hasattr(err, 'name') else err} ({msg.decode(errors='replace')})")
        return rest[0] if len(rest) == 1 else rest

    def set_device(self, index: int) -> None:
        if self._rt is not None:
            self._ok("cudaSetDevice", self._rt.cudaSetDevice(index))
        else:
            self._cp.setDevice(index)

    def ipc_open(self, handle: bytes) -> int:
        if self._rt is not None:
            h = self._rt.cudaIpcMemHandle_t()
            h.reserved = handle
            return int(self._ok("cudaIpcOpenMemHandle", self._rt.cudaIpcOpenMemHandle(
                h, self._rt.cudaIpcMemLazyEnablePeerAccess)))
        return int(self._cp.ipcOpenMemHandle(handle, self._cp.cudaIpcMemLazyEnablePeerAccess))

    def ipc_close(self, ptr: int) -> None:
        if self._rt is not None:
            self._ok("cudaIpcCloseMemHandle", self._rt.cudaIpcCloseMemHandle(ptr))
        else:
            self._cp.ipcCloseMemHandle(ptr)

    def memcpy_batch(self, dsts: list[int], srcs: list[int], sizes: list[int], stream: int) -> bool:
        """One cudaMemcpyBatchAsync (CUDA >= 12.8); False when this runtime has none."""
        rt = self._rt
        if rt is None or not hasattr(rt, "cudaMemcpyBatchAsync"):
            return False
        attrs = rt.cudaMemcpyAttributes()
        attrs.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        self._ok("cudaMemcpyBatchAsync", rt.cudaMemcpyBatchAsync(
            dsts, srcs, sizes, len(sizes), [attrs], [0], 1, rt.cudaStream_t(stream)))
        return True


_runtime: _Runtime | None = None
_batch_copy_ok = True  # cleared the first time the batched copy API fails


def _rt() -> _Runtime:
    global _runtime
    if _runtime is None:
        _runtime = _Runtime()
    return _runtime


# --- devices


class _Lane:
    """One copy in flight owns a lane: a stream for kernels and one for DMA, so they overlap, and
    STAGING_SLOTS chunks of device staging that every job on the lane reuses in turn. The staging
    is allocated once (at registration's warm-up), not per chunk: a batch of 4 GiB would otherwise
    hold 4 GiB of the engine's GPU memory in the caching allocator, and the first Store would pay
    a cudaMalloc per chunk."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.kernels = torch.cuda.Stream(device)
        self.dma = torch.cuda.Stream(device)
        self._staging: torch.Tensor | None = None
        # a job's block ids (pinned, on the device) and its rows' CRCs (on the device, pinned), kept for the
        # next job on this lane (driver launches): every job ends by synchronising its lane, so the next one
        # may overwrite them
        self._ids: tuple[np.ndarray, torch.Tensor, torch.Tensor] | None = None
        self._crc: tuple[torch.Tensor, torch.Tensor] | None = None
        self._segs: torch.Tensor | None = None
        self._launches: LaneLaunches | None = None

    def staging(self, chunk_bytes: int) -> torch.Tensor:
        """[STAGING_SLOTS, >= chunk_bytes] uint8 on the device. Called at a job's start, when the
        lane is idle (every job ends by synchronising it), so growing it is safe."""
        if self._staging is None or self._staging.shape[1] < chunk_bytes:
            self._staging = None
            width = -(-max(CHUNK_BYTES, chunk_bytes) // 256) * 256  # slots stay aligned for any element type
            self._staging = torch.empty((STAGING_SLOTS, width), dtype=torch.uint8, device=self.device)
        return self._staging

    def ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Block ids as int64 on the device, copied on the current stream (torch launches: _device_ids)."""
        return _device_ids(block_ids, self.device)

    def stage_ids(self, block_ids: Sequence[int]) -> tuple[int, torch.Tensor, torch.Tensor]:
        """The ids written into this lane's pinned buffer: (n, pinned host int64, device int64 of the
        same capacity); the caller copies host[:n] to the device."""
        a = np.asarray(block_ids, dtype=np.int64)
        n = a.size
        if self._ids is None or self._ids[0].size < n:
            cap = 1 << max(10, (n - 1).bit_length())
            host = torch.empty(cap, dtype=torch.int64, pin_memory=True)
            self._ids = (host.numpy(), host, torch.empty(cap, dtype=torch.int64, device=self.device))
        view, host, dev = self._ids
        view[:n] = a
        return n, host, dev

    def upload_ids(self, go: LaneLaunches, block_ids: Sequence[int], stream: int) -> int:
        """The ids on the device through this lane's pinned buffer, one driver copy on `stream` (lean
        launches); returns their device address."""
        n, host, dev = self.stage_ids(block_ids)
        go.d.htod(dev.data_ptr(), host.data_ptr(), 8 * n, stream)
        return dev.data_ptr()

    def segs(self, n: int) -> torch.Tensor:
        """n int32 on the device: the GPU CRC's per-segment values of a chunk (lean launches)."""
        if self._segs is None or self._segs.numel() < n:
            self._segs = torch.empty(1 << max(10, (n - 1).bit_length()), dtype=torch.int32, device=self.device)
        return self._segs

    def launches(self, launcher: Launcher) -> LaneLaunches:
        """This lane's parameter buffers and events for the driver launches (made at its first lean job)."""
        if self._launches is None:
            self._launches = launcher.lease()
        return self._launches

    def close(self) -> None:
        if self._launches is not None:
            self._launches.enter()
            self._launches.close()
            self._launches = None

    def crc(self, n: int, keep: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """n int32 on the device (the rows' CRCs) and n pinned int32 on the host (where they land).
        keep: through buffers this lane keeps (driver launches); else new tensors (torch launches)."""
        if not keep:
            return (torch.empty(n, dtype=torch.int32, device=self.device),
                    torch.empty(n, dtype=torch.int32, pin_memory=True))
        if self._crc is None or self._crc[0].numel() < n:
            cap = 1 << max(10, (n - 1).bit_length())
            self._crc = (torch.empty(cap, dtype=torch.int32, device=self.device),
                         torch.empty(cap, dtype=torch.int32, pin_memory=True))
        return self._crc[0][:n], self._crc[1][:n]

    def synchronize(self) -> None:
        self.kernels.synchronize()
        self.dma.synchronize()


class _Device:
    """CUDA state of one device, created when the first session registers a pool on it."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.device = torch.device("cuda", index)
        self.sessions = 0
        self._lanes: queue.SimpleQueue[_Lane] = queue.SimpleQueue()
        self.crc: _GpuCrc | None = None
        self.crc_state = "unknown"  # "on" | "off" once decided (GPU CRC32C built and self-tested, or not)
        self.crc_lock = threading.Lock()
        self.launcher: Launcher | None = None
        self.launcher_state = "unknown"  # "on" | "off" once decided (LEAN_LAUNCH: the driver launches built)

    def drop_lanes(self) -> None:
        """Forget idle lanes (and their staging): called when the device's last session closed."""
        while True:
            try:
                lane = self._lanes.get_nowait()
            except queue.Empty:
                return
            try:
                lane.close()
            except Exception as e:  # an event the driver refuses to destroy: it goes with the context
                log.warning("device %d: closing a copy lane: %s", self.index, e)

    @contextmanager
    def lane(self) -> Iterator[_Lane]:
        try:
            lane = self._lanes.get_nowait()
        except queue.Empty:
            lane = _Lane(self.device)
        try:
            yield lane
        finally:
            self._lanes.put(lane)


def normalize_uuid(uuid: str) -> str:
    """'GPU-8f1e...' and '8f1e...' name the same device."""
    u = uuid.strip().lower()
    return u[4:] if u.startswith("gpu-") else u


def device_uuids() -> list[str]:
    return [normalize_uuid(str(torch.cuda.get_device_properties(i).uuid)) for i in range(torch.cuda.device_count())]


def resolve_device(spec: PoolSpec) -> int:
    """The local index of the engine's device: by UUID when given (indices differ between processes
    with different CUDA_VISIBLE_DEVICES), else by the engine's index."""
    if not torch.cuda.is_available():
        raise CacheError(ErrorCode.FAILED_PRECONDITION,
                         "this daemon has no CUDA data path here: it sees no CUDA device (torch.cuda.is_available() "
                         "is False); register a shared-memory pool, or run the daemon with the engine's GPU visible")
    if spec.cuda_device_uuid:
        uuids = device_uuids()
        want = normalize_uuid(spec.cuda_device_uuid)
        if want in uuids:
            return uuids.index(want)
        raise CacheError(ErrorCode.FAILED_PRECONDITION,
                         f"pool.cuda.device_uuid {spec.cuda_device_uuid} is not one of this daemon's CUDA devices "
                         f"({', '.join(uuids)}); check the daemon's CUDA_VISIBLE_DEVICES")
    n = torch.cuda.device_count()
    if not 0 <= spec.cuda_device_index < n:
        raise CacheError(ErrorCode.INVALID_ARGUMENT,
                         f"pool.cuda.device_index {spec.cuda_device_index} is not one of this daemon's {n} CUDA devices")
    return spec.cuda_device_index


def _acquire_device(index: int) -> _Device:
    with _lock:
        d = _devices.get(index)
        if d is None:
            d = _devices[index] = _Device(index)
            log.info("CUDA device %d (%s) in use: first pool registered on it", index, torch.cuda.get_device_name(index))
        d.sessions += 1
        return d


def _release_device(d: _Device) -> None:
    with _lock:
        d.sessions -= 1
        last = d.sessions == 0
    if last:
        d.drop_lanes()
        with torch.cuda.device(d.index):
            torch.cuda.empty_cache()  # staging memory of this device's copies goes back to the driver


def open_mappings() -> int:
    """IPC mappings this process holds open (the leak check reads it from the log)."""
    return _open_mappings


# --- batch shapes


def chunk_rows(n: int, row_bytes: int, chunk_bytes: int = 0) -> list[int]:
    """Rows of each piece a batch of n rows moves in: full chunks of the largest power of two rows
    within chunk_bytes, then the remainder as descending powers of two (see the module docstring)."""
    per = 1 << max(0, ((chunk_bytes or CHUNK_BYTES) // max(1, row_bytes)).bit_length() - 1)
    out = [per] * (n // per)
    rest = n % per
    while rest:
        p = 1 << (rest.bit_length() - 1)
        out.append(p)
        rest -= p
    return out


def element_bytes(spec: PoolSpec, base_ptr: int = 0) -> int:
    """The widest of 8, 4, 2, 1 bytes that divides every offset, stride and row of the layout."""
    for e in (8, 4, 2, 1):
        if base_ptr % e == 0 and all(r.offset % e == 0 and r.block_stride % e == 0 and r.block_bytes % e == 0
                                     for r in spec.regions):
            return e
    return 1


def uniform_layout(spec: PoolSpec) -> bool:
    """Regions of one width and stride at evenly spaced offsets: one [R, N, row] strided view."""
    rs = spec.regions
    if len(rs) == 1:
        return True
    delta = rs[1].offset - rs[0].offset
    return delta > 0 and all(r.block_bytes == rs[0].block_bytes and r.block_stride == rs[0].block_stride
                             and r.offset == rs[0].offset + i * delta for i, r in enumerate(rs))


def host_runs(srcs: Sequence[torch.Tensor], row_bytes: int) -> list[tuple[int, int, torch.Tensor | None]]:
    """Group per-block host buffers into runs that are back to back in one base tensor, in batch order.
    Returns (first position, rows, flat uint8 base or None for a lone buffer); a run's bytes start at
    srcs[first].data_ptr()."""
    runs: list[tuple[int, int, torch.Tensor | None]] = []
    prev_base: torch.Tensor | None = None
    prev_end = first = -1
    for i, s in enumerate(srcs):  # per-row work kept minimal: 4096 rows of 64 KiB are one 256 MiB batch
        base = s._base
        p = s.data_ptr()
        if base is not None and base is prev_base and p == prev_end:
            prev_end = p + row_bytes
            continue
        if s.nbytes != row_bytes or s.is_cuda:
            raise ValueError(f"source #{i} is not a host buffer of {row_bytes} bytes")
        if first >= 0:
            runs.append((first, i - first, prev_base))
        first = i
        prev_base = base if base is not None and base.is_contiguous() else None
        prev_end = p + row_bytes
    if first >= 0:
        runs.append((first, len(srcs) - first, prev_base))
    return runs


# KVTUNE_ASYNC_IDS=0 (an A/B): the ids' copy from pageable memory, which torch follows with a wait for
# the stream (the lane's kernel stream, behind the engine's event): the copy thread's launches stalled
# there 0.28 ms a part on the H100 (the call timelines' gather.lane -> gather.ids).
ASYNC_IDS = os.environ.get("KVTUNE_ASYNC_IDS", "1") == "1"
# (KVTUNE_LANE_BUFFERS, the torch launches through buffers each lane keeps, was A/B'd on the H100 on
# 2026-12-08 and gained nothing (BENCHMARKS.md): gone; the driver launches keep such buffers.)
# LEAN_LAUNCH (default; KVTUNE_LEAN_LAUNCH=0: the torch path, an A/B): a chunk's gather or scatter kernel,
# CRC kernels, copies and events go through libcuda directly (kvservice.memory.cuda_launch: one ctypes call
# each, the GIL released in it) instead of torch ops; pools whose regions are not one 8-byte-aligned
# strided view, and CRCs on the CPU, keep the torch path. H100, 2026-12-08, A/B in one call (BENCHMARKS.md):
# copy thread start -> first D2H of a 256 MiB Store 1.2 -> 0.41 ms; Store / Load x limit at 256 MiB
# 0.57 / 0.67 -> 0.61 / 0.73 (k = 1), 0.65 / 0.73 -> 0.68 / 0.77 (8 a key); the GPU tests pass with it.
LEAN_LAUNCH = os.environ.get("KVTUNE_LEAN_LAUNCH", "1") == "1"


def _device_ids(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """Engine block ids as an int64 tensor on the device, copied on the current stream without
    waiting for it: through pinned memory (torch's caching host allocator keeps that block until the
    copy has run), so the caller's next launches queue behind the copy instead of after a host sync."""
    ids = torch.from_numpy(np.asarray(block_ids, dtype=np.int64))
    if ASYNC_IDS:
        return ids.pin_memory().to(device, non_blocking=True)
    return ids.to(device)


# _device_ids' pinned buffers, made at registration for every power-of-two size up to this many ids: torch's
# caching host allocator keeps its pinned blocks per power-of-two size and a size's first block is a
# cudaHostAlloc (the H100 call timelines: gather.lane -> gather.ids 2.4 ms in a fresh daemon's first 2 MiB
# Store against 0.3 ms later; ~1.1 ms again in its second part, another size)
IDS_WARM_MAX = 1 << 16
IDS_IN_FLIGHT = 4  # blocks of each size: a call's copies in flight (pipeline.PIPELINE_DEPTH) and another call's


def _warm_pinned_ids(n: int) -> None:
    """Have torch's caching host allocator hold IDS_IN_FLIGHT pinned blocks of every power-of-two size
    up to n int64 ids (freed at once: they stay in its cache for _device_ids)."""
    if not ASYNC_IDS:
        return
    k = 1
    while k <= max(1, n):
        held = [torch.empty(k * 8, dtype=torch.uint8, pin_memory=True) for _ in range(IDS_IN_FLIGHT)]
        held.clear()  # back to the allocator's cache, all of them at once in use before: IDS_IN_FLIGHT blocks
        k *= 2


def _pinned(shape: tuple[int, int]) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.uint8, pin_memory=True)


def _crc_rows(ptr: int, n: int, row_bytes: int) -> list[int]:
    fn = _checksum._extend_gil_free
    if fn is None:
        buf = (ctypes.c_uint8 * (n * row_bytes)).from_address(ptr)
        return [_checksum.checksum(memoryview(buf)[i * row_bytes:(i + 1) * row_bytes]) for i in range(n)]
    return [int(fn(0, ptr + i * row_bytes, row_bytes)) for i in range(n)]


def _crc_executor() -> ThreadPoolExecutor:
    global _crc_pool
    with _lock:
        if _crc_pool is None:
            _crc_pool = ThreadPoolExecutor(CRC_THREADS, thread_name_prefix="kv-crc")
        return _crc_pool


# --- CRC32C on the GPU
#
# The CPU computes CRC32C at ~6 GB/s a core, and for small blocks Python threads cannot share the
# work (each row is one GIL round trip), so the store's checksums run on the GPU instead, on the
# device staging copy of each chunk while the DMA engine moves it. Two kernels: every `seg`-byte
# segment gets its raw CRC (slice-by-8 tables, no pre/post inversion); one thread per row then
# folds its segments, shifting the running value past each segment (4 tables that apply the linear
# map "append seg zero bytes"), and applies the standard conditioning:
#   crc32c(row) = raw(row) ^ crc32c(zeros of the row's length).
# A self-test against google_crc32c runs once per device; any failure falls back to the CPU.

_POLY = 0x82F63B78  # CRC32C, reflected
_CRC_SEG = 1024
_CRC_SRC = r"""
extern "C" __global__ void crc32c_segments(const unsigned long long* __restrict__ data, unsigned int* __restrict__ out,
                                           const unsigned int* __restrict__ tables, long long words, long long nsegs) {
    __shared__ unsigned int t[8 * 256];
    for (int i = threadIdx.x; i < 8 * 256; i += blockDim.x) t[i] = tables[i];
    __syncthreads();
    long long s = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= nsegs) return;
    const unsigned long long* p = data + s * words;
    unsigned int c = 0;
#pragma unroll 4
    for (long long i = 0; i < words; ++i) {
        unsigned long long x = p[i] ^ (unsigned long long)c;
        c = t[7 * 256 + (x & 0xff)] ^ t[6 * 256 + ((x >> 8) & 0xff)] ^ t[5 * 256 + ((x >> 16) & 0xff)]
          ^ t[4 * 256 + ((x >> 24) & 0xff)] ^ t[3 * 256 + ((x >> 32) & 0xff)] ^ t[2 * 256 + ((x >> 40) & 0xff)]
          ^ t[256 + ((x >> 48) & 0xff)] ^ t[x >> 56];
    }
    out[s] = c;
}

extern "C" __global__ void crc32c_rows(const unsigned int* __restrict__ segs, unsigned int* __restrict__ out,
                                       const unsigned int* __restrict__ shift, long long per_row, long long rows,
                                       unsigned int zero_crc) {
    __shared__ unsigned int t[4 * 256];
    for (int i = threadIdx.x; i < 4 * 256; i += blockDim.x) t[i] = shift[i];
    __syncthreads();
    long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const unsigned int* q = segs + r * per_row;
    unsigned int c = 0;
    for (long long i = 0; i < per_row; ++i)
        c = t[c & 0xff] ^ t[256 + ((c >> 8) & 0xff)] ^ t[512 + ((c >> 16) & 0xff)] ^ t[768 + (c >> 24)] ^ q[i];
    out[r] = c ^ zero_crc;
}
"""


def crc_slice_tables() -> list[list[int]]:
    """Slice-by-8 tables: T0 is the byte table, Tk[i] = T(k-1)[i] advanced by one zero byte."""
    t0 = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (_POLY if c & 1 else 0)
        t0.append(c)
    tables = [t0]
    for _ in range(7):
        prev = tables[-1]
        tables.append([(v >> 8) ^ t0[v & 0xFF] for v in prev])
    return tables


def crc_shift_tables(nbytes: int) -> list[list[int]]:
    """Tables of the linear map c -> raw CRC state after nbytes zero bytes, one per byte of c."""
    import google_crc32c

    zeros = bytes(nbytes)

    def advance(c: int) -> int:  # extend() works on conditioned values: raw state = ~value
        return ~google_crc32c.extend(~c & 0xFFFFFFFF, zeros) & 0xFFFFFFFF
    return [[advance(b << (8 * k)) for b in range(256)] for k in range(4)]


def crc_segment_bytes(row_bytes: int) -> int:
    """Segment length for a row: the largest power of two <= _CRC_SEG dividing it; 0 if under 8."""
    seg = _CRC_SEG
    while seg >= 8 and row_bytes % seg:
        seg //= 2
    return seg if seg >= 8 else 0


class _GpuCrc:
    """The two CRC kernels of one device, with their tables in device memory."""

    def __init__(self, device: torch.device) -> None:
        import cupy

        self._cupy = cupy
        self.device = device
        self._tables = torch.tensor([v for t in crc_slice_tables() for v in t], dtype=torch.int64,
                                    device=device).to(torch.int32)
        self._shift: dict[int, torch.Tensor] = {}
        self._zero: dict[int, int] = {}
        self._streams: dict[int, Any] = {}
        with cupy.cuda.Device(device.index):
            self._seg_kernel = cupy.RawKernel(_CRC_SRC, "crc32c_segments")
            self._row_kernel = cupy.RawKernel(_CRC_SRC, "crc32c_rows")

    def _stream(self, stream: torch.cuda.Stream) -> Any:
        s = self._streams.get(stream.cuda_stream)
        if s is None:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                s = self._streams[stream.cuda_stream] = self._cupy.cuda.ExternalStream(stream.cuda_stream,
                                                                                         self.device.index)
        return s

    def prepare(self, row_bytes: int) -> None:
        """The tables for rows of row_bytes (built once per size; a session's registration calls this,
        so its first Store does not pay for them)."""
        seg = crc_segment_bytes(row_bytes)
        if row_bytes not in self._zero:
            import google_crc32c

            self._zero[row_bytes] = google_crc32c.value(bytes(row_bytes))
        if seg not in self._shift:
            self._shift[seg] = torch.tensor([v for t in crc_shift_tables(seg) for v in t], dtype=torch.int64,
                                            device=self.device).to(torch.int32)

    def rows(self, data: torch.Tensor, row_bytes: int, out: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """out[i] = crc32c of row i of the contiguous device tensor data, computed on `stream`."""
        import numpy as np

        seg = crc_segment_bytes(row_bytes)
        n = data.numel() * data.element_size() // row_bytes
        self.prepare(row_bytes)
        per_row = row_bytes // seg
        segs = torch.empty(n * per_row, dtype=torch.int32, device=self.device)
        threads = 128
        with self._cupy.cuda.Device(self.device.index), self._stream(stream):
            self._seg_kernel(((n * per_row + threads - 1) // threads,), (threads,),
                             (np.uint64(data.data_ptr()), np.uint64(segs.data_ptr()), np.uint64(self._tables.data_ptr()),
                              np.int64(seg // 8), np.int64(n * per_row)))
            self._row_kernel(((n + threads - 1) // threads,), (threads,),
                             (np.uint64(segs.data_ptr()), np.uint64(out.data_ptr()),
                              np.uint64(self._shift[seg].data_ptr()), np.int64(per_row), np.int64(n),
                              np.uint32(self._zero[row_bytes])))

    def self_test(self) -> None:
        """Raise unless the kernels agree with google_crc32c on random rows of a few sizes."""
        for row_bytes in (8, 520, 4096, 65536 + 1024):
            data = torch.randint(0, 256, (3, row_bytes), dtype=torch.uint8, device=self.device)
            out = torch.empty(3, dtype=torch.int32, device=self.device)
            stream = torch.cuda.current_stream(self.device)
            self.rows(data, row_bytes, out, stream)
            stream.synchronize()
            host = data.cpu()
            want = [_checksum.checksum(host[i]) for i in range(3)]
            got = [v & 0xFFFFFFFF for v in out.cpu().tolist()]
            if got != want:
                raise RuntimeError(f"GPU CRC32C of {row_bytes}-byte rows is {got}, expected {want}")


def _gpu_crc_for(dev: _Device) -> _GpuCrc | None:
    """The device's GPU CRC, built and self-tested on first use; None means checksum on the CPU."""
    if dev.crc_state == "unknown":
        with dev.crc_lock:
            if dev.crc_state == "unknown":
                if os.environ.get("KVSERVICE_GPU_CRC", "1") == "0":
                    dev.crc_state = "off"
                else:
                    try:
                        with torch.cuda.device(dev.index):
                            crc = _GpuCrc(dev.device)
                            crc.self_test()
                        dev.crc, dev.crc_state = crc, "on"
                        log.info("device %d: store checksums (CRC32C) computed on the GPU", dev.index)
                    except Exception as e:  # no CuPy, no NVRTC, or a wrong result: checksum on the CPU
                        dev.crc_state = "off"
                        log.warning("device %d: GPU CRC32C unavailable (%s: %s); checksumming on the CPU",
                                    dev.index, type(e).__name__, e)
    return dev.crc


def _launcher_for(dev: _Device, crc: _GpuCrc | None) -> Launcher | None:
    """The device's driver launches, built on first use (with the GPU CRC's kernels when it has them);
    None: not available here (no CuPy, no libcuda): the torch path moves the bytes."""
    if dev.launcher_state == "unknown":
        with dev.crc_lock:
            if dev.launcher_state == "unknown":
                try:
                    with torch.cuda.device(dev.index):
                        dev.launcher = Launcher(dev.index, crc)
                    dev.launcher_state = "on"
                    log.info("device %d: copies launched through the CUDA driver directly", dev.index)
                except Exception as e:
                    dev.launcher_state = "off"
                    log.warning("device %d: driver launches unavailable (%s: %s); launching through torch",
                                dev.index, type(e).__name__, e)
    launcher = dev.launcher
    if launcher is not None and launcher.crc is not crc:
        return None  # built without the CRC kernels this pool's Stores need
    return launcher


class _DevicePointer:
    """Hands a raw device pointer to torch.as_tensor without a copy; the tensor keeps this alive."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


# --- the mapping


class CudaEngineMemory:
    """An engine's CUDA KV pool, mapped once per session through its IPC handle."""

    _rows: PoolRows | None = None  # the layout as the driver launches see it (LEAN_LAUNCH), else None
    _launcher: Launcher | None = None
    _crc: _GpuCrc | None = None

    def __init__(self, spec: PoolSpec) -> None:
        global _open_mappings
        validate_layout(spec)
        index = resolve_device(spec)
        rt = _rt()
        self.spec = spec
        self.num_blocks = spec.num_blocks
        self.block_bytes = spec.block_bytes
        self._dev = _acquire_device(index)
        self._inflight = InFlight()
        self._ptr = 0
        try:
            with torch.cuda.device(index):
                rt.set_device(index)
                try:
                    self._ptr = rt.ipc_open(bytes(spec.cuda_handle))
                except Exception as e:
                    raise CacheError(ErrorCode.FAILED_PRECONDITION,
                                     f"cannot open the pool's CUDA IPC handle on device {index}: {e} (the pool must be "
                                     "a cudaMalloc allocation of a live process other than the daemon)") from None
                with _lock:
                    _open_mappings += 1
                base = torch.as_tensor(_DevicePointer(self._ptr, spec.size), device=self._dev.device)
                if base.data_ptr() != self._ptr:
                    raise RuntimeError("torch copied the IPC mapping instead of viewing it")
                self._event = (torch.cuda.Event.from_ipc_handle(self._dev.device, bytes(spec.cuda_event_handle))
                               if spec.cuda_event_handle else None)
                self._plan(base)
                # build and self-test the GPU CRC kernels, the tables of this block size and a lane now:
                # the first Store must run at the speed of the thousandth
                crc = _gpu_crc_for(self._dev) if crc_segment_bytes(spec.block_bytes) else None
                if crc is not None:
                    crc.prepare(spec.block_bytes)
                self._rows = PoolRows.of(self._ptr, spec.regions) if LEAN_LAUNCH else None
                self._launcher = _launcher_for(self._dev, crc) if self._rows is not None else None
                self._crc = crc
                self._warm_up(crc)
        except BaseException:
            self._release()
            raise
        log.info("CUDA pool mapped on device %d: %d blocks x %d bytes in %d region(s), %s, store event %s; "
                 "open mappings: %d", index, spec.num_blocks, spec.block_bytes, len(spec.regions),
                 "one view" if self._uniform else "per-region views", "yes" if self._event else "no", _open_mappings)

    def _plan(self, base: torch.Tensor) -> None:
        spec = self.spec
        e = element_bytes(spec, self._ptr)
        self._dtype = _ELEMENT[e]
        self._row = spec.block_bytes // e
        flat = base[: spec.size - spec.size % e].view(self._dtype)
        self._uniform = uniform_layout(spec)
        rs = spec.regions
        if self._uniform:
            delta = (rs[1].offset - rs[0].offset) // e if len(rs) > 1 else 0
            self._view3 = flat.as_strided((len(rs), spec.num_blocks, rs[0].block_bytes // e),
                                          (delta, rs[0].block_stride // e, 1), rs[0].offset // e)
            self._region_ids = torch.arange(len(rs), device=base.device).view(1, -1)
            self._views: list[torch.Tensor] = []
        else:
            self._views = [flat.as_strided((spec.num_blocks, r.block_bytes // e), (r.block_stride // e, 1), r.offset // e)
                           for r in rs]
        self._base = base

    def _warm_up(self, crc: _GpuCrc | None) -> None:
        """Launch once, at registration, every kernel and copy a Store and a Load of this layout use
        (CUDA loads a kernel's module at its first launch), and reserve one chunk of device staging
        in the caching allocator: the first Store of a fresh daemon must not pay for them. Reads
        block 0 of the pool; writes only scratch memory."""
        dev = self._dev.device
        bb = self.block_bytes
        per = chunk_rows(1 << 20, bb)[0]  # the rows of a full chunk; smaller pieces are powers of two below it
        with self._dev.lane() as lane, torch.cuda.stream(lane.kernels):
            staging = lane.staging(per * bb)
            # every piece size a copy launches (1, 2, 4, ... per rows, all of block 0): the index kernels pick
            # their variant by the number of rows (the 2 MiB session's pieces of 16 rows did not load the one a
            # 256 KiB session's pieces of 128 need, which its first Store paid: ~29 ms on the H100)
            k, sizes = 1, []
            while k <= per:
                sizes.append(k)
                k *= 2
            crc_out = torch.empty(per, dtype=torch.int32, device=dev) if crc is not None else None
            for k in sizes:
                idx = torch.zeros(k, dtype=torch.long, device=dev)
                rows = self._gather_dev(idx, out=staging[0, :k * bb].view(self._dtype).view(k, self._row))
                if crc is not None:
                    crc.rows(rows, bb, crc_out[:k], lane.kernels)
            rows = staging[0, :bb].view(self._dtype).view(1, self._row)
            host = torch.empty((1, self._row), dtype=self._dtype, pin_memory=True)
            host.copy_(rows, non_blocking=True)
            rows.copy_(host, non_blocking=True)
            self._warm_batch_copy(host, rows, lane.kernels)
            real = (self._view3, self._views) if self._uniform else (None, self._views)
            try:  # the scatter kernels, on scratch rows shaped like the pool's views
                if self._uniform:
                    self._view3 = torch.empty((self._view3.shape[0], 1, self._view3.shape[2]), dtype=self._dtype,
                                              device=dev)
                else:
                    self._views = [torch.empty((1, v.shape[1]), dtype=self._dtype, device=dev) for v in self._views]
                for k in sizes:  # k rows into the one scratch row (duplicate indices: any of them lands)
                    self._scatter_dev(torch.zeros(k, dtype=torch.long, device=dev),
                                      staging[0, :k * bb].view(self._dtype).view(k, self._row))
            finally:
                if self._uniform:
                    self._view3 = real[0]
                self._views = real[1]
            if self._launcher is not None:
                self._warm_lean(lane, staging, crc)
            lane.synchronize()
        _warm_pinned_ids(min(self.spec.num_blocks, IDS_WARM_MAX))

    def _warm_lean(self, lane: _Lane, staging: torch.Tensor, crc: _GpuCrc | None) -> None:
        """The driver launches once each (a gather of block 0 and its CRC, a scatter into scratch rows
        shaped as the pool's) and the lane's buffers at the largest job's size."""
        bb, rows = self.block_bytes, self._rows
        go = lane.launches(self._launcher)
        go.enter()
        most = min(self.spec.num_blocks, IDS_WARM_MAX)
        lane.stage_ids(np.zeros(most, dtype=np.int64))
        if crc is not None:
            lane.crc(most, keep=True)
            seg = crc_segment_bytes(bb)
            lane.segs(chunk_rows(1 << 20, bb)[0] * (bb // seg))
        ks = lane.kernels.cuda_stream
        ids = lane.upload_ids(go, [0], ks)
        go.rows(True, rows, ids, 1, staging.data_ptr(), ks)
        if crc is not None:
            self._crc_lean(go, lane, staging.data_ptr(), 1, lane.crc(1, keep=True)[0].data_ptr(), ks)
        scratch = torch.empty(rows.regions * rows.row_bytes, dtype=torch.uint8, device=self._dev.device)
        go.rows(False, PoolRows(scratch.data_ptr(), rows.regions, rows.row_bytes, 0, rows.row_bytes, rows.width),
                ids, 1, staging.data_ptr(), ks)
        go.d.sync(ks)

    def _warm_batch_copy(self, host: torch.Tensor, rows: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """One cudaMemcpyBatchAsync (what a chunk of many runs of slots copies with), device row ->
        pinned host row, so its first use by a Store is not also its first call. Where the runtime has
        none (or refuses it), the copies go one per run from now on, as at a first failing use."""
        global _batch_copy_ok
        if not _batch_copy_ok:
            return
        try:
            if not _rt().memcpy_batch([host.data_ptr()], [rows.data_ptr()], [self.block_bytes], stream.cuda_stream):
                _batch_copy_ok = False
        except Exception as e:
            log.warning("cudaMemcpyBatchAsync failed (%s); using one copy per run from now on", e)
            _batch_copy_ok = False
        stream.synchronize()

    # --- device-side gather/scatter of one chunk (on the current stream)
    def _gather_dev(self, idx: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[n, row] device tensor of the blocks idx, in the pool's element dtype (into `out`, a
        contiguous [n, row] tensor, when given: one index kernel over every region)."""
        n = idx.numel()
        if self._uniform:
            v3 = self._view3
            if v3.shape[0] == 1:
                return v3[0].index_select(0, idx) if out is None else torch.index_select(v3[0], 0, idx, out=out)
            if out is None:
                return v3[self._region_ids, idx.view(-1, 1)].view(n, self._row)
            torch.index_select(v3.permute(1, 0, 2), 0, idx, out=out.view(n, v3.shape[0], v3.shape[2]))
            return out
        if out is None:
            out = torch.empty((n, self._row), dtype=self._dtype, device=idx.device)
        col = 0
        for v in self._views:
            out[:, col:col + v.shape[1]] = v.index_select(0, idx)
            col += v.shape[1]
        return out

    def _scatter_dev(self, idx: torch.Tensor, rows: torch.Tensor) -> None:
        if self._uniform:
            if self._view3.shape[0] == 1:
                self._view3[0].index_copy_(0, idx, rows)
            else:
                self._view3.index_put_((self._region_ids, idx.view(-1, 1)), rows.view(idx.numel(), *self._view3.shape[::2]))
            return
        col = 0
        for v in self._views:
            v.index_copy_(0, idx, rows[:, col:col + v.shape[1]])
            col += v.shape[1]

    # --- EngineMemory
    def alloc_host(self, n: int, row_bytes: int = 0) -> list[torch.Tensor]:
        """n pinned host rows of row_bytes (0: block_bytes), back to back in power-of-two chunks."""
        rb = row_bytes or self.block_bytes
        rows: list[torch.Tensor] = []
        with torch.cuda.device(self._dev.index):  # pinned memory belongs to a context: this device's
            for k in chunk_rows(n, rb):
                rows.extend(_pinned((k, rb)).unbind(0))
        return rows

    def gather(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        return self._gather(block_ids, with_checksums=False)[0]

    def gather_with_checksums(self, block_ids: Sequence[int]) -> tuple[list[torch.Tensor], list[int]]:
        return self._gather(block_ids, with_checksums=True)

    def _gather(self, block_ids: Sequence[int], with_checksums: bool) -> tuple[list[torch.Tensor], list[int]]:
        """Fresh pinned rows (one allocation) filled by the gather_into path."""
        n, bb = len(block_ids), self.block_bytes
        with torch.cuda.device(self._dev.index):  # pinned memory belongs to a context: this device's
            flat = torch.empty(n * bb, dtype=torch.uint8, pin_memory=True)
        sums = self._gather_to(flat, block_ids, [i * bb for i in range(n)], with_checksums)
        return list(flat.view(n, bb).unbind(0)) if n else [], sums

    SIGNALS_ENQUEUED = True  # gather_into calls `enqueued` once every chunk is queued on the device

    def gather_into(self, block_ids: Sequence[int], arena: HostArena, offsets: Sequence[int],
                    enqueued: Callable[[], None] | None = None) -> list[int]:
        """Engine GPU -> host arena slots (pinned): per chunk one gather kernel into device staging,
        then one D2H copy per run of adjacent slots straight into the arena, on the DMA stream while
        the next chunk gathers. Returns the CRC32C of each block (GPU kernels when available).
        enqueued(): called (on this thread) once all of it is queued on the device, before the wait
        for it: the caller may then take the GIL for long without starving this thread's launches."""
        return self._gather_to(arena.base, block_ids, offsets, True, enqueued)

    def _gather_to(self, base: torch.Tensor, block_ids: Sequence[int], offsets: Sequence[int],
                   with_checksums: bool, enqueued: Callable[[], None] | None = None) -> list[int]:
        """gather_into into any flat pinned uint8 tensor; without checksums returns []. Per chunk j:
        gather kernel into staging slot j % STAGING_SLOTS (once the DMA of chunk j - STAGING_SLOTS
        has left it), GPU CRC of the slot beside the DMA, D2H of its runs of adjacent slots."""
        bb = self.block_bytes
        n_all = len(block_ids)
        if n_all == 0:
            return []
        TRACE.mark(0, "gather.start")
        offs = np.asarray(offsets, dtype=np.int64)
        chunks = chunk_rows(n_all, bb)
        gpu_crc = _gpu_crc_for(self._dev) if with_checksums and crc_segment_bytes(bb) else None
        if self._launcher is not None and (gpu_crc is not None or not with_checksums):
            return self._gather_lean(base, block_ids, offs, chunks, gpu_crc is not None, enqueued)
        with self._inflight, torch.cuda.device(self._dev.index), self._dev.lane() as lane:
            try:
                staging = lane.staging(chunks[0] * bb)
                TRACE.mark(0, "gather.lane")
                with torch.cuda.stream(lane.kernels):
                    if self._event is not None:
                        lane.kernels.wait_event(self._event)  # the engine's writes to these blocks come first
                    idx = lane.ids(block_ids)
                    crc_dev, crc_host = lane.crc(n_all) if gpu_crc else (None, None)
                TRACE.mark(0, "gather.ids")  # (the first chunk's steps too: where a cold first Store's launch goes)
                free_after: list[torch.cuda.Event | None] = [None] * STAGING_SLOTS
                done = []
                lo = 0
                for j, k in enumerate(chunks):
                    slot = j % STAGING_SLOTS
                    staged = staging[slot, :k * bb].view(self._dtype).view(k, self._row)
                    with torch.cuda.stream(lane.kernels):
                        if free_after[slot] is not None:
                            lane.kernels.wait_event(free_after[slot])  # chunk j - STAGING_SLOTS has left the slot
                        self._gather_dev(idx[lo:lo + k], out=staged)
                        gathered = lane.kernels.record_event()
                        if not j:
                            TRACE.mark(0, "gather.kernel0")
                        if gpu_crc is not None:  # on the kernel stream, beside the DMA of the same chunk
                            gpu_crc.rows(staged, bb, crc_dev[lo:lo + k], lane.kernels)
                            if not j:
                                TRACE.mark(0, "gather.crc0")
                    lane.dma.wait_event(gathered)
                    with torch.cuda.stream(lane.dma):
                        self._copy_runs_out(staged, base, runs(offs[lo:lo + k], bb), lane.dma)
                        free_after[slot] = ev = lane.dma.record_event()
                    if not j:
                        TRACE.mark(0, "gather.d2h0")
                    done.append((lo, k, ev))
                    lo += k
                TRACE.mark(0, "gather.queued")
                if enqueued is not None:
                    enqueued()
                sums: list[int] = []
                if gpu_crc is not None:
                    with torch.cuda.stream(lane.kernels):
                        crc_host.copy_(crc_dev, non_blocking=True)
                    lane.kernels.synchronize()
                    sums = crc_host.numpy().view(np.uint32).tolist()
                futures = []
                pool = _crc_executor() if with_checksums and gpu_crc is None else None
                for lo, k, ev in done:
                    ev.synchronize()
                    if pool is not None:
                        for first, n, off in runs(offs[lo:lo + k], bb):
                            futures.append(pool.submit(_crc_rows, base.data_ptr() + off, n, bb))
                for f in futures:
                    sums.extend(f.result())
            finally:
                lane.synchronize()
        TRACE.mark(0, "gather.done")
        return sums

    def scatter(self, block_ids: Sequence[int], srcs: Sequence[torch.Tensor]) -> None:
        if len(block_ids) != len(srcs):
            raise ValueError(f"{len(block_ids)} block ids but {len(srcs)} source buffers")
        self._scatter_chunks(block_ids, lambda staged, lo, k, stream: self._copy_in(staged, srcs[lo:lo + k], stream))

    def scatter_from(self, block_ids: Sequence[int], arena: HostArena, offsets: Sequence[int],
                     enqueued: Callable[[], None] | None = None) -> None:
        """Host arena slots (pinned) -> engine GPU: per chunk the H2D copies of its runs of adjacent
        slots into device staging (one cudaMemcpyBatchAsync when there are many), then one scatter
        kernel; no per-block tensor. Returns once the bytes are in the engine's memory. enqueued():
        as gather_into's, once every chunk is queued on the device."""
        bb = self.block_bytes
        if len(block_ids) != len(offsets):
            raise ValueError(f"{len(block_ids)} block ids but {len(offsets)} slots")
        base = arena.base
        offs = np.asarray(offsets, dtype=np.int64)

        if self._launcher is not None:
            return self._scatter_lean(block_ids, base.data_ptr(), offs, enqueued)

        def fill(staged: torch.Tensor, lo: int, k: int, stream: torch.cuda.Stream) -> None:
            self._copy_runs_in(staged, [(first, n, base[off:off + n * bb]) for first, n, off in runs(offs[lo:lo + k], bb)],
                               stream)
        self._scatter_chunks(block_ids, fill, enqueued)

    def _scatter_chunks(self, block_ids: Sequence[int], fill, enqueued: Callable[[], None] | None = None) -> None:
        """Per chunk j: fill(staged, first, rows, dma stream) puts its host bytes into staging slot
        j % STAGING_SLOTS (once the scatter of chunk j - STAGING_SLOTS is done with it), then one
        scatter kernel on the other stream. Returns once the bytes are in the engine's memory."""
        bb = self.block_bytes
        n_all = len(block_ids)
        if n_all == 0:
            return
        chunks = chunk_rows(n_all, bb)
        TRACE.mark(0, "scatter.start")
        with self._inflight, torch.cuda.device(self._dev.index), self._dev.lane() as lane:
            try:
                staging = lane.staging(chunks[0] * bb)
                with torch.cuda.stream(lane.kernels):
                    idx = lane.ids(block_ids)
                free_after: list[torch.cuda.Event | None] = [None] * STAGING_SLOTS
                lo = 0
                for j, k in enumerate(chunks):
                    slot = j % STAGING_SLOTS
                    staged = staging[slot, :k * bb].view(self._dtype).view(k, self._row)
                    if free_after[slot] is not None:
                        lane.dma.wait_event(free_after[slot])  # chunk j - STAGING_SLOTS was scattered out of it
                    with torch.cuda.stream(lane.dma):
                        fill(staged, lo, k, lane.dma)
                        copied = lane.dma.record_event()
                    lane.kernels.wait_event(copied)
                    with torch.cuda.stream(lane.kernels):
                        self._scatter_dev(idx[lo:lo + k], staged)
                        free_after[slot] = lane.kernels.record_event()
                    lo += k
                TRACE.mark(0, "scatter.queued")
                if enqueued is not None:
                    enqueued()
            finally:
                lane.synchronize()  # the Load reply promises the bytes are in the engine's memory
        TRACE.mark(0, "scatter.done")

    # --- the same copies through the driver (LEAN_LAUNCH; kvservice.memory.cuda_launch)
    def _crc_lean(self, go: LaneLaunches, lane: _Lane, data: int, n: int, out: int, stream: int) -> None:
        crc, bb = self._crc, self.block_bytes
        seg = crc_segment_bytes(bb)
        segs = lane.segs(n * (bb // seg))
        go.crc(data, n, bb, seg, segs.data_ptr(), out, crc._tables.data_ptr(), crc._shift[seg].data_ptr(),
               crc._zero[bb], stream)

    def _runs_lean(self, go: LaneLaunches, to_host: bool, staged: int, base: int, spans: Sequence[tuple[int, int, int]],
                   stream: int) -> None:
        """The copies of (first row, rows, byte offset in base) runs between staged rows and host slots:
        one driver call each, or one cudaMemcpyBatchAsync past MAX_RUN_COPIES."""
        global _batch_copy_ok
        bb = self.block_bytes
        if len(spans) > MAX_RUN_COPIES and _batch_copy_ok:
            host = [base + off for _, _, off in spans]
            dev = [staged + first * bb for first, _, _ in spans]
            try:
                if _rt().memcpy_batch(host if to_host else dev, dev if to_host else host, [n * bb for _, n, _ in spans],
                                      stream):
                    return
            except Exception as e:
                log.warning("cudaMemcpyBatchAsync failed (%s); using one copy per run from now on", e)
            _batch_copy_ok = False
        copy = go.d.dtoh if to_host else go.d.htod
        for first, n, off in spans:
            if to_host:
                copy(base + off, staged + first * bb, n * bb, stream)
            else:
                copy(staged + first * bb, base + off, n * bb, stream)

    @contextmanager
    def _lean_lane(self, chunk_bytes: int) -> Iterator[tuple[_Lane, LaneLaunches, int, int]]:
        """A copy job's lane for driver launches: (lane, its launches, staging base address, bytes between
        staging slots), the device's context current; the lane is synchronised when the job ends, however
        it ends (a Load's reply promises the bytes are in the engine's memory; a lane is reused)."""
        with self._inflight, torch.cuda.device(self._dev.index), self._dev.lane() as lane:
            go = lane.launches(self._launcher)
            try:
                go.enter()
                staging = lane.staging(chunk_bytes)
                yield lane, go, staging.data_ptr(), staging.stride(0)
            finally:
                lane.synchronize()

    def _gather_lean(self, base: torch.Tensor, block_ids: Sequence[int], offs: np.ndarray, chunks: list[int],
                     with_crc: bool, enqueued: Callable[[], None] | None) -> list[int]:
        """_gather_to through the driver: per chunk j one gather kernel into staging slot j % STAGING_SLOTS
        (once the D2H of chunk j - STAGING_SLOTS has left it), the CRC kernels beside the D2H of its runs."""
        bb, n_all, rows = self.block_bytes, len(block_ids), self._rows
        host_base = base.data_ptr()
        with self._lean_lane(chunks[0] * bb) as (lane, go, sbase, width):
            ks, ds = lane.kernels.cuda_stream, lane.dma.cuda_stream
            TRACE.mark(0, "gather.lane")
            if self._event is not None:
                lane.kernels.wait_event(self._event)  # the engine's writes to these blocks come first
            ids = lane.upload_ids(go, block_ids, ks)
            crc_dev, crc_host = lane.crc(n_all, keep=True) if with_crc else (None, None)
            ev = go.events(2 * STAGING_SLOTS)  # [slot]: gathered; [STAGING_SLOTS + slot]: the slot is free again
            TRACE.mark(0, "gather.ids")
            used = [False] * STAGING_SLOTS
            lo = 0
            for j, k in enumerate(chunks):
                slot = j % STAGING_SLOTS
                staged = sbase + slot * width
                if used[slot]:
                    go.d.wait(ks, ev[STAGING_SLOTS + slot])
                go.rows(True, rows, ids + 8 * lo, k, staged, ks)
                go.d.record(ev[slot], ks)
                if crc_dev is not None:
                    self._crc_lean(go, lane, staged, k, crc_dev.data_ptr() + 4 * lo, ks)
                go.d.wait(ds, ev[slot])
                self._runs_lean(go, True, staged, host_base, runs(offs[lo:lo + k], bb), ds)
                go.d.record(ev[STAGING_SLOTS + slot], ds)
                used[slot] = True
                if not j:
                    TRACE.mark(0, "gather.d2h0")
                lo += k
            TRACE.mark(0, "gather.queued")
            if enqueued is not None:
                enqueued()
            sums: list[int] = []
            if crc_dev is not None:
                go.d.dtoh(crc_host.data_ptr(), crc_dev.data_ptr(), 4 * n_all, ks)
                go.d.sync(ks)
                sums = crc_host.numpy().view(np.uint32).tolist()
            go.d.sync(ds)
        TRACE.mark(0, "gather.done")
        return sums

    def _scatter_lean(self, block_ids: Sequence[int], host_base: int, offs: np.ndarray,
                      enqueued: Callable[[], None] | None) -> None:
        """scatter_from through the driver: per chunk j the H2D of its runs into staging slot
        j % STAGING_SLOTS (once chunk j - STAGING_SLOTS was scattered out of it), then one scatter
        kernel; the ids go to the device after the first H2D is queued (only the kernels need them)."""
        bb, n_all, rows = self.block_bytes, len(block_ids), self._rows
        if n_all == 0:
            return
        chunks = chunk_rows(n_all, bb)
        TRACE.mark(0, "scatter.start")
        with self._lean_lane(chunks[0] * bb) as (lane, go, sbase, width):  # (its end: the bytes are in the pool)
            ks, ds = lane.kernels.cuda_stream, lane.dma.cuda_stream
            ev = go.events(2 * STAGING_SLOTS)  # [slot]: copied in; [STAGING_SLOTS + slot]: scattered out
            used = [False] * STAGING_SLOTS
            ids = 0
            lo = 0
            for j, k in enumerate(chunks):
                slot = j % STAGING_SLOTS
                staged = sbase + slot * width
                if used[slot]:
                    go.d.wait(ds, ev[STAGING_SLOTS + slot])
                self._runs_lean(go, False, staged, host_base, runs(offs[lo:lo + k], bb), ds)
                go.d.record(ev[slot], ds)
                if not ids:
                    ids = lane.upload_ids(go, block_ids, ks)
                go.d.wait(ks, ev[slot])
                go.rows(False, rows, ids + 8 * lo, k, staged, ks)
                go.d.record(ev[STAGING_SLOTS + slot], ks)
                used[slot] = True
                lo += k
            TRACE.mark(0, "scatter.queued")
            if enqueued is not None:
                enqueued()
            go.d.sync(ks)
        TRACE.mark(0, "scatter.done")

    def _copy_runs_out(self, staged: torch.Tensor, base: torch.Tensor, spans: Sequence[tuple[int, int, int]],
                       stream: torch.cuda.Stream) -> None:
        """D2H of staged rows into (first row, rows, byte offset in base) runs of host slots: one copy
        per run, or one cudaMemcpyBatchAsync for all of them when there are many (a fragmented arena:
        thousands of cudaMemcpyAsync calls would make the CPU, not the DMA engine, the limit)."""
        global _batch_copy_ok
        bb = self.block_bytes
        if len(spans) > MAX_RUN_COPIES and _batch_copy_ok:
            src, dst = staged.data_ptr(), base.data_ptr()
            try:
                if _rt().memcpy_batch([dst + off for _, _, off in spans], [src + first * bb for first, _, _ in spans],
                                      [n * bb for _, n, _ in spans], stream.cuda_stream):
                    return
            except Exception as e:  # an older driver or runtime: fall back to one copy per run
                log.warning("cudaMemcpyBatchAsync failed (%s); using one copy per run from now on", e)
            _batch_copy_ok = False
        for first, n, off in spans:
            base[off:off + n * bb].view(self._dtype).view(n, self._row).copy_(staged[first:first + n], non_blocking=True)

    def _copy_runs_in(self, staged: torch.Tensor, spans: Sequence[tuple[int, int, torch.Tensor]],
                      stream: torch.cuda.Stream) -> None:
        """H2D of (first row, rows, flat uint8 host bytes) spans into staged rows: one copy per span,
        or one cudaMemcpyBatchAsync for all of them when there are many."""
        global _batch_copy_ok
        bb = self.block_bytes
        if len(spans) > MAX_RUN_COPIES and _batch_copy_ok:
            base = staged.data_ptr()
            try:
                if _rt().memcpy_batch([base + first * bb for first, _, _ in spans], [src.data_ptr() for _, _, src in spans],
                                      [n * bb for _, n, _ in spans], stream.cuda_stream):
                    return
            except Exception as e:  # an older driver or runtime: fall back to one copy per span
                log.warning("cudaMemcpyBatchAsync failed (%s); using one copy per run from now on", e)
            _batch_copy_ok = False
        flat_dst = staged.view(-1)
        e = staged.element_size()
        for first, n, src in spans:
            flat_dst[first * (bb // e):(first + n) * (bb // e)].copy_(src.view(self._dtype), non_blocking=True)

    def _copy_in(self, staged: torch.Tensor, srcs: Sequence[torch.Tensor], stream: torch.cuda.Stream) -> None:
        """H2D of one chunk's host rows into staged, one copy per run of back-to-back rows."""
        bb = self.block_bytes
        spans: list[tuple[int, int, torch.Tensor]] = []
        for first, n, base in host_runs(srcs, bb):
            if base is None:
                spans.append((first, n, srcs[first].reshape(-1).view(torch.uint8)))
            else:
                start = srcs[first].data_ptr() - base.data_ptr()
                spans.append((first, n, base.view(-1).view(torch.uint8)[start:start + n * bb]))
        self._copy_runs_in(staged, spans, stream)

    def close(self) -> None:
        if self._inflight.closed:
            return
        self._inflight.close_when_idle()
        self._release()
        log.info("CUDA pool unmapped from device %d; open mappings: %d", self._dev.index, _open_mappings)

    def _release(self) -> None:
        global _open_mappings
        # every tensor over the mapping goes before the handle closes
        self._view3 = self._views = self._region_ids = self._base = None  # type: ignore[assignment]
        self._event = None
        if self._ptr:
            try:
                with torch.cuda.device(self._dev.index):
                    _rt().set_device(self._dev.index)
                    _rt().ipc_close(self._ptr)
            except Exception as e:
                log.error("closing the CUDA IPC mapping on device %d failed: %s", self._dev.index, e)
            self._ptr = 0
            with _lock:
                _open_mappings -= 1
        _release_device(self._dev)
