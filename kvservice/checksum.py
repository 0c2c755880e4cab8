"""CRC32C of block payloads, and the zero-copy byte view the disk layer shares.

Every block carries a CRC32C from the moment it is stored (DESIGN §5); the disk tier checks it
before a block read from disk may reach an engine. CRC32C because google_crc32c computes it with
the CPU's crc32 instruction (SSE4.2 / ARMv8 CRC) at many GB/s, so checking costs far less than the
read it guards.

Primitives:
- `checksum(buf)`: CRC32C of one host buffer, or of the concatenation of a list of them.
- `byte_view(buf)`: a flat uint8 numpy view of a host buffer, without copying. Accepts bytes,
  bytearray, memoryview, numpy arrays and contiguous CPU torch tensors of any dtype.

Threads: google_crc32c's Python functions hold the GIL for anything but `bytes` of 1 MiB and more,
so the reader/writer pools would checksum one block at a time. For buffers of 256 KiB and more we
call the same library's C function `crc32c_extend` through ctypes, which releases the GIL for the
duration of the call, so checksums run in parallel with each other and with I/O. If that symbol
cannot be loaded we fall back to google_crc32c's own functions (same result, serialised).
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Sequence
from typing import Any

import google_crc32c
import numpy as np

CHECKSUM_NAME = "crc32c"

_GIL_FREE_MIN = 256 << 10  # below this the ~2 us ctypes call costs more than it frees

# Any object exposing the buffer protocol, a numpy array or a torch.Tensor.
Buffer = Any


def _torch_tensor_type() -> type | None:
    # Only a process that imported torch can hand us a tensor; do not pay torch's import here.
    torch = sys.modules.get("torch")
    return getattr(torch, "Tensor", None) if torch is not None else None


def byte_view(buf: Buffer, *, writable: bool = False) -> np.ndarray:
    """A 1-D uint8 numpy array over the bytes of `buf`, sharing its memory (never a copy).

    Raises TypeError for device (CUDA) tensors and ValueError for non-contiguous buffers,
    and for read-only buffers when `writable` is asked for.
    """
    tensor_type = _torch_tensor_type()
    if tensor_type is not None and isinstance(buf, tensor_type):
        if buf.device.type != "cpu":
            raise TypeError(f"need a host buffer, got a tensor on {buf.device}")
        if not buf.is_contiguous():
            raise ValueError("tensor is not contiguous; its bytes are not one run of memory")
        # view(uint8) first: numpy has no bfloat16/float8, and the reinterpretation is free.
        arr = buf.detach().reshape(-1).view(sys.modules["torch"].uint8).numpy()
    elif isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("array is not C-contiguous; its bytes are not one run of memory")
        arr = buf.reshape(-1).view(np.uint8)
    else:
        try:
            arr = np.frombuffer(buf, dtype=np.uint8)
        except (TypeError, ValueError) as e:
            raise TypeError(f"need a contiguous buffer, got {type(buf).__name__}: {e}") from e
    if writable and not arr.flags.writeable:
        raise ValueError(f"need a writable buffer, got a read-only {type(buf).__name__}")
    return arr


def checksum(buf: Buffer | Sequence[Buffer]) -> int:
    """CRC32C of `buf`; for a list or tuple, of the concatenation of its items (computed
    incrementally, the items are never joined)."""
    if isinstance(buf, (list, tuple)):
        crc = 0
        for item in buf:
            crc = _extend(crc, item)
        return crc
    return _extend(0, buf)


def _load_gil_free_extend() -> Any:
    try:
        from google_crc32c import _crc32c  # the C extension; its libcrc32c exports crc32c_extend

        fn = ctypes.CDLL(_crc32c.__file__).crc32c_extend
    except (ImportError, OSError, AttributeError):
        return None
    fn.restype = ctypes.c_uint32
    fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
    return fn


_extend_gil_free = _load_gil_free_extend()


def _extend(crc: int, buf: Buffer) -> int:
    # google_crc32c parses "y#": bytes and numpy arrays pass, memoryview/bytearray do not.
    if isinstance(buf, bytes) and len(buf) < _GIL_FREE_MIN:
        return google_crc32c.extend(crc, buf)
    arr = byte_view(buf)
    if _extend_gil_free is not None and arr.nbytes >= _GIL_FREE_MIN:
        return int(_extend_gil_free(crc, arr.ctypes.data, arr.nbytes))
    return google_crc32c.extend(crc, arr)


_concat_tables: dict[int, np.ndarray] = {}
_concat_lock = threading.Lock()


def _byte_tables(basis: Sequence[int]) -> np.ndarray:
    """[4, 256] uint32: row p, column v = the XOR of basis[8p + i] over the bits i set in v (the
    lookup tables of the linear map whose value on bit b is basis[b])."""
    v = np.arange(256, dtype=np.uint32)
    t = np.zeros((4, 256), dtype=np.uint32)
    for p in range(4):
        for i in range(8):
            t[p] ^= np.where((v >> i) & 1, np.uint32(basis[8 * p + i]), np.uint32(0))
    return t


def _apply(t: np.ndarray, x: int) -> int:
    return int(t[0, x & 0xFF] ^ t[1, (x >> 8) & 0xFF] ^ t[2, (x >> 16) & 0xFF] ^ t[3, x >> 24])


def concat_tables(part_bytes: int, k: int = 2) -> np.ndarray:
    """[k - 1, 4, 256] uint32: block m - 1 holds the byte tables of Z^m, where Z is the linear map
    CRC32C(A + B) = Z(CRC32C(A)) ^ CRC32C(B) for any B of part_bytes bytes (Z(c) = extend(c, zeros)
    ^ extend(0, zeros): the conditioning cancels out), so Z^m moves a CRC past m parts. Z from 32
    basis values; Z^m from Z^(m-1)'s basis through Z's tables. Cached per length, grown to the
    largest k asked (KeyGroupMemory builds them at registration)."""
    t = _concat_tables.get(part_bytes)
    if t is not None and t.shape[0] >= k - 1:
        return t
    if t is None:
        zeros = bytes(part_bytes)
        z0 = google_crc32c.extend(0, zeros)
        basis = [google_crc32c.extend(1 << b, zeros) ^ z0 for b in range(32)]
        t = _byte_tables(basis)[None]
    while t.shape[0] < k - 1:
        z = t[0]
        basis = [_apply(z, _apply_basis(t[-1], b)) for b in range(32)]
        t = np.concatenate([t, _byte_tables(basis)[None]])
    with _concat_lock:  # only ever grown: a thread that built fewer does not put back the shorter one
        have = _concat_tables.get(part_bytes)
        if have is None or have.shape[0] < t.shape[0]:
            _concat_tables[part_bytes] = t
    return t


def _apply_basis(t: np.ndarray, b: int) -> int:
    """The value on bit b of the linear map whose byte tables are t."""
    return int(t[b // 8, 1 << (b % 8)])


def concat_checksums(crcs: Sequence[int] | np.ndarray, k: int, part_bytes: int) -> list[int]:
    """The CRC32C of each run of k consecutive parts of part_bytes bytes, from the CRC32C of every
    part (len(crcs) = k x runs), without touching the bytes: what a daemon block of k engine blocks
    is checked by, computed from the per-block checksums its copy made. CRC(run) = XOR over j of
    Z^(k-1-j)(crc_j): one table lookup per byte of every part's CRC, all at once (a fixed handful of
    numpy calls whatever k: the fold sits between a Store's last copy and its answer)."""
    c = np.asarray(crcs, dtype=np.uint32).reshape(-1, k)
    if k == 1:
        return c[:, 0].tolist()
    t = concat_tables(part_bytes, k).reshape(-1)
    n = len(c)
    m = np.arange(k - 2, -1, -1, dtype=np.intp)  # column j: Z^(k-1-j), the tables' block k-2-j
    rows = (m[:, None] * 4 + np.arange(4, dtype=np.intp)) * 256  # [k-1, 4]: byte p of column j's CRC
    octets = c[:, :k - 1].astype("<u4").view(np.uint8).reshape(n, k - 1, 4)  # byte p = bits 8p..8p+7
    acc = np.bitwise_xor.reduce(t.take(rows + octets).reshape(n, -1), axis=1) ^ c[:, k - 1]
    return acc.tolist()
