"""Direct CUDA driver launches for the copy path (KVTUNE_LEAN_LAUNCH): a chunk of a Store or a Load in
a handful of ctypes calls into libcuda, each releasing the GIL, instead of dozens of torch ops.

Why: the H100 call timelines of 256 MiB Stores (BENCHMARKS.md, "Lead, 2026-12-07 21:25 UTC") spend
~1 ms of the copy thread's Python between its start and the first D2H (ids to the device 0.3-0.4 ms,
then ~0.6 ms a 128 MiB chunk of torch launches: views, the index_select kernel, CuPy's CRC launches,
the D2H), all holding the GIL; at 16k-token batches that is a fifth of the whole copy.
What the same work costs here: per chunk one gather (or scatter) kernel, two CRC kernels, one D2H per
run of adjacent arena slots (cudaMemcpyBatchAsync past MAX_RUN_COPIES, as before) and two events,
each a single driver call with its parameters packed into buffers made once.

  Driver()                          libcuda through ctypes (cuLaunchKernel, cuMemcpy*Async, events)
  RowKernels(index)                 the gather/scatter kernels (NVRTC through CuPy) of one device
  PoolRows.of(ptr, regions)         a pool's uniform layout as the kernels see it (None: not uniform, or
                                    not 8-byte aligned: the torch path moves it)
  Launcher                          per device: driver, kernels, the CRC kernels' handles; launches

The bytes a chunk moves and where they land are exactly the torch path's: staged row i is block
ids[i]'s regions back to back (test_gpu checks the two paths against each other).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

_ROW_SRC = r"""
template <typename T>
__device__ __forceinline__ void move_rows(char* pool, const long long* ids, char* staged, long long rows,
                                          long long regions, long long rstride, long long bstride, long long words,
                                          bool gather) {
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        long long i = row / regions;
        long long r = row - i * regions;
        T* p = (T*)(pool + r * rstride + ids[i] * bstride);
        T* s = (T*)staged + row * words;
        if (gather) {
            for (long long w = threadIdx.x; w < words; w += blockDim.x) s[w] = p[w];
        } else {
            for (long long w = threadIdx.x; w < words; w += blockDim.x) p[w] = s[w];
        }
    }
}
extern "C" __global__ void gather_rows16(char* pool, const long long* ids, char* staged, long long rows,
        long long regions, long long rstride, long long bstride, long long words) {
    move_rows<uint4>(pool, ids, staged, rows, regions, rstride, bstride, words, true);
}
extern "C" __global__ void gather_rows8(char* pool, const long long* ids, char* staged, long long rows,
        long long regions, long long rstride, long long bstride, long long words) {
    move_rows<unsigned long long>(pool, ids, staged, rows, regions, rstride, bstride, words, true);
}
extern "C" __global__ void scatter_rows16(char* pool, const long long* ids, char* staged, long long rows,
        long long regions, long long rstride, long long bstride, long long words) {
    move_rows<uint4>(pool, ids, staged, rows, regions, rstride, bstride, words, false);
}
extern "C" __global__ void scatter_rows8(char* pool, const long long* ids, char* staged, long long rows,
        long long regions, long long rstride, long long bstride, long long words) {
    move_rows<unsigned long long>(pool, ids, staged, rows, regions, rstride, bstride, words, false);
}
"""
MAX_GRID = 1 << 20  # CTAs of a row kernel (a grid-stride loop covers the rest)


@dataclass(frozen=True)
class PoolRows:
    """A uniform pool layout in bytes: region r of block b starts at ptr + r * rstride + b * bstride and
    holds row_bytes; `width` is the widest of 16 and 8 bytes dividing all of them (the kernel's word)."""

    ptr: int
    regions: int
    rstride: int
    bstride: int
    row_bytes: int
    width: int

    @staticmethod
    def of(base_ptr: int, regions: Sequence[Any]) -> PoolRows | None:
        """The layout of `regions` (offset, block_stride, block_bytes each) over base_ptr, or None when
        they are not one strided [regions, blocks, row] view or not 8-byte aligned."""
        if not regions:
            return None
        r0 = regions[0]
        delta = regions[1].offset - r0.offset if len(regions) > 1 else 0
        if len(regions) > 1 and (delta <= 0 or not all(
                r.block_bytes == r0.block_bytes and r.block_stride == r0.block_stride and r.offset == r0.offset + i * delta
                for i, r in enumerate(regions))):
            return None
        ptr = base_ptr + r0.offset
        for width in (16, 8):
            if all(v % width == 0 for v in (ptr, delta, r0.block_stride, r0.block_bytes)):
                return PoolRows(ptr, len(regions), delta, r0.block_stride, r0.block_bytes, width)
        return None

    def threads(self) -> int:
        """Threads of a CTA (one CTA a region row at a time): the row's words rounded up to a warp, 32-256."""
        words = self.row_bytes // self.width
        return max(32, min(256, -(-words // 32) * 32))


class CudaDriverError(RuntimeError):
    pass


class Driver:
    """The libcuda calls the copy path makes, with argtypes set once (ctypes releases the GIL in each)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        vp, u, sz, i = ctypes.c_void_p, ctypes.c_uint, ctypes.c_size_t, ctypes.c_int

        def fn(name: str, *args: Any) -> Any:
            f = getattr(lib, name)
            f.argtypes = list(args)
            f.restype = ctypes.c_int
            return f
        self._name = fn("cuGetErrorName", i, ctypes.POINTER(ctypes.c_char_p))
        self._launch = fn("cuLaunchKernel", vp, u, u, u, u, u, u, u, vp, vp, vp)
        self._dtoh = fn("cuMemcpyDtoHAsync_v2", vp, ctypes.c_uint64, sz, vp)
        self._htod = fn("cuMemcpyHtoDAsync_v2", ctypes.c_uint64, vp, sz, vp)
        self._record = fn("cuEventRecord", vp, vp)
        self._wait = fn("cuStreamWaitEvent", vp, vp, u)
        self._sync = fn("cuStreamSynchronize", vp)
        self._event_create = fn("cuEventCreate", ctypes.POINTER(vp), u)
        self._event_destroy = fn("cuEventDestroy_v2", vp)
        self._ctx_set = fn("cuCtxSetCurrent", vp)
        self._ctx_get = fn("cuCtxGetCurrent", ctypes.POINTER(vp))

    def check(self, what: str, rc: int) -> None:
        if rc:
            name = ctypes.c_char_p()
            self._name(rc, ctypes.byref(name))
            raise CudaDriverError(f"{what}: CUDA error {rc} ({(name.value or b'?').decode()})")

    def current_context(self) -> int:
        ctx = ctypes.c_void_p()
        self.check("cuCtxGetCurrent", self._ctx_get(ctypes.byref(ctx)))
        return ctx.value or 0

    def set_context(self, ctx: int) -> None:
        self.check("cuCtxSetCurrent", self._ctx_set(ctx))

    def event(self) -> int:
        ev = ctypes.c_void_p()
        self.check("cuEventCreate", self._event_create(ctypes.byref(ev), 2))  # CU_EVENT_DISABLE_TIMING
        return ev.value

    def destroy_event(self, ev: int) -> None:
        self._event_destroy(ev)

    def record(self, ev: int, stream: int) -> None:
        self.check("cuEventRecord", self._record(ev, stream))

    def wait(self, stream: int, ev: int) -> None:
        self.check("cuStreamWaitEvent", self._wait(stream, ev, 0))

    def sync(self, stream: int) -> None:
        self.check("cuStreamSynchronize", self._sync(stream))

    def dtoh(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.check("cuMemcpyDtoHAsync", self._dtoh(dst, src, nbytes, stream))

    def htod(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.check("cuMemcpyHtoDAsync", self._htod(dst, src, nbytes, stream))

    def launch(self, func: int, grid: int, threads: int, stream: int, params: _Params) -> None:
        self.check("cuLaunchKernel", self._launch(func, grid, 1, 1, threads, 1, 1, 0, stream, params.ptrs, None))


class _Params:
    """A kernel's parameter buffer, made once: `set(*values)` fills it (cuLaunchKernel copies it at the call)."""

    __slots__ = ("vals", "ptrs")

    def __init__(self, types: Sequence[Any]) -> None:
        self.vals = [t() for t in types]
        self.ptrs = (ctypes.c_void_p * len(types))(*[ctypes.addressof(v) for v in self.vals])

    def set(self, *values: int) -> _Params:
        for v, x in zip(self.vals, values):
            v.value = x
        return self


_ROW_PARAMS = (ctypes.c_uint64,) * 3 + (ctypes.c_int64,) * 5
_SEG_PARAMS = (ctypes.c_uint64,) * 3 + (ctypes.c_int64,) * 2
_CRC_ROW_PARAMS = (ctypes.c_uint64,) * 3 + (ctypes.c_int64,) * 2 + (ctypes.c_uint32,)
CRC_THREADS = 128  # the CRC kernels' CTA (as _GpuCrc.rows launches them)


class Launcher:
    """One device's driver launches. Built in the thread that registers a pool (the CUDA context current
    there is the device's primary context, the one torch and CuPy use); every job calls enter() first,
    so the driver calls of a copy thread run in that context. A Launcher's parameter buffers are shared:
    launch() calls of one Launcher must not run on two threads at once (lease() gives each copy job its
    own: one per lane)."""

    def __init__(self, index: int, crc: Any | None) -> None:
        import cupy

        self.driver = Driver()
        with cupy.cuda.Device(index):
            mod = cupy.RawModule(code=_ROW_SRC, options=("-std=c++14",))
            fn = {name: mod.get_function(name).kernel.ptr  # RawKernel -> the device's Function -> its CUfunction
                  for name in ("gather_rows16", "gather_rows8", "scatter_rows16", "scatter_rows8")}
            self._gather = {16: fn["gather_rows16"], 8: fn["gather_rows8"]}
            self._scatter = {16: fn["scatter_rows16"], 8: fn["scatter_rows8"]}
            self._module = mod  # keeps the functions loaded
            self.context = self.driver.current_context()
            self._crc_seg = self._crc_row = 0
            if crc is not None:  # the GPU CRC's two kernels (kvservice.memory.cuda_memory._GpuCrc)
                self._crc_seg = crc._seg_kernel.kernel.ptr
                self._crc_row = crc._row_kernel.kernel.ptr
        if not self.context:
            raise CudaDriverError("no CUDA context current after loading the row kernels")
        self.crc = crc

    def lease(self) -> LaneLaunches:
        return LaneLaunches(self)


class LaneLaunches:
    """One lane's launches: its own parameter buffers and events (a lane runs one copy job at a time)."""

    def __init__(self, launcher: Launcher) -> None:
        self.l = launcher
        self.d = launcher.driver
        self._rows = _Params(_ROW_PARAMS)
        self._seg = _Params(_SEG_PARAMS)
        self._crc_rows = _Params(_CRC_ROW_PARAMS)
        self._events: list[int] = []

    def enter(self) -> None:
        self.d.set_context(self.l.context)

    def events(self, n: int) -> list[int]:
        while len(self._events) < n:
            self._events.append(self.d.event())
        return self._events

    def close(self) -> None:
        for ev in self._events:
            self.d.destroy_event(ev)
        self._events = []

    def rows(self, gather: bool, layout: PoolRows, ids_ptr: int, n: int, staged: int, stream: int) -> None:
        """Blocks ids[0:n] (int64 on the device at ids_ptr) to (gather) or from staged rows, on stream."""
        rows = n * layout.regions
        func = (self.l._gather if gather else self.l._scatter)[layout.width]
        self.d.launch(func, min(rows, MAX_GRID), layout.threads(), stream,
                      self._rows.set(layout.ptr, ids_ptr, staged, rows, layout.regions, layout.rstride, layout.bstride,
                                     layout.row_bytes // layout.width))

    def crc(self, data: int, n: int, row_bytes: int, seg: int, segs: int, out: int, tables: int, shift: int,
            zero_crc: int, stream: int) -> None:
        """out[i] = CRC32C of row i of data (n rows of row_bytes), through segs (n x row_bytes / seg int32)."""
        per_row = row_bytes // seg
        nsegs = n * per_row
        self.d.launch(self.l._crc_seg, -(-nsegs // CRC_THREADS), CRC_THREADS, stream,
                      self._seg.set(data, segs, tables, seg // 8, nsegs))
        self.d.launch(self.l._crc_row, -(-n // CRC_THREADS), CRC_THREADS, stream,
                      self._crc_rows.set(segs, out, shift, per_row, n, zero_crc))
