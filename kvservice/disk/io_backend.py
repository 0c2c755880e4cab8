"""Disk I/O backends: one small interface, two implementations, chosen once at start.

Primitives of `BlockIO` (all blocking; call them from the disk tier's reader/writer threads):
- `write_file(path, chunks)`: write the concatenation of `chunks` to a temporary name beside
  `path`, then `os.replace` it onto `path`. A reader, or a restart after kill -9, sees the old
  file or the complete new one, never a torn one under the real name.
- `read_into(path, offset, out)`: fill `out` with exactly len(out) bytes of the file from `offset`.
- `pwrite(path, offset, data)`: overwrite bytes in place (used to rewrite a block header).
- `remove(path)`: unlink; a missing file is fine.

Backends (`open_backend`, setting `io_backend`):
- `PosixIO` ("posix"): os.pwritev/os.preadv straight from/into the caller's host memory, no
  Python-level copies; the only backend on CPU-only hosts.
- `KvikioIO` ("kvikio-gds" / "kvikio-compat"): PosixIO for host memory, plus kvikio.CuFile for
  CUDA memory, through GPUDirect Storage when the node has it and bounce buffers otherwise.

Errors, one family: everything a disk operation raises is an `OSError`. What the OS reports
(ENOENT, ENOSPC, EIO...) propagates as the OS's own subclass; what this layer detects is a
`BlockIOError` (`ShortReadError`, `ShortWriteError`, and in block_file `CorruptHeaderError`,
`ChecksumMismatchError`). The core catches `OSError` around a disk read or write.

Temporary files end in `.tmp` (TMP_SUFFIX) and carry the pid and a sequence number, so two
writers of the same path never share one; restart recovery (block_file.scan) deletes them.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import Any, Protocol

from kvservice.checksum import Buffer, byte_view

TMP_SUFFIX = ".tmp"
KVIKIO_DEFAULT_THREADS = 8
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_tmp_seq = itertools.count()  # next() on a count is atomic under the GIL


class BlockIOError(OSError):
    """A disk operation failed in a way this layer detected (not an errno from the OS)."""


class ShortReadError(BlockIOError):
    """The file ended before `wanted` bytes could be read from `offset`."""

    def __init__(self, path: str, offset: int, wanted: int, got: int) -> None:
        super().__init__(
            f"short read of {path}: wanted {wanted} bytes at offset {offset}, "
            f"got {got} before end of file"
        )
        self.path = path
        self.offset, self.wanted, self.got = offset, wanted, got


class ShortWriteError(BlockIOError):
    """Fewer than `wanted` bytes reached the file; `cause` is the OS error that stopped it, if any."""

    def __init__(self, path: str, wanted: int, got: int, cause: OSError | None = None) -> None:
        reason = f": {cause.strerror or cause}" if cause is not None else ""
        super().__init__(f"short write to {path}: wrote {got} of {wanted} bytes{reason}")
        self.path = path
        self.wanted, self.got = wanted, got
        if cause is not None:
            self.errno = cause.errno


class BlockIO(Protocol):
    name: str  # "posix" | "kvikio-gds" | "kvikio-compat"; reported in Stats
    fsync: bool  # write_file/pwrite make data and rename durable before returning

    def write_file(self, path: str, chunks: Sequence[Buffer]) -> None: ...

    def read_into(self, path: str, offset: int, out: Buffer) -> None: ...

    def pwrite(self, path: str, offset: int, data: Buffer) -> None: ...

    def remove(self, path: str) -> None: ...


def nbytes(buf: Buffer) -> int:
    """Size in bytes of a host buffer, numpy array, or (CPU or CUDA) torch tensor / CuPy array."""
    if hasattr(buf, "element_size") and hasattr(buf, "numel"):  # torch.Tensor, any device
        return buf.numel() * buf.element_size()
    if hasattr(buf, "nbytes"):  # numpy, cupy
        return int(buf.nbytes)
    return memoryview(buf).nbytes


def tmp_path_for(path: str) -> str:
    return f"{path}.{os.getpid()}-{next(_tmp_seq)}{TMP_SUFFIX}"


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pwrite_all(fd: int, path: str, views: list[Any], offset: int) -> None:
    """pwritev `views` at `offset`, resuming after partial writes; at most IOV_MAX per call."""
    pending = [v for v in views if v.nbytes]
    wanted = sum(v.nbytes for v in pending)
    done = 0
    i = 0
    while i < len(pending):
        try:
            n = os.pwritev(fd, pending[i : i + _IOV_MAX], offset + done)
        except OSError as e:
            if done:  # a partial file is a short write, whatever stopped it
                raise ShortWriteError(path, wanted, done, e) from e
            raise
        if n == 0:
            raise ShortWriteError(path, wanted, done)
        done += n
        while n:
            head = pending[i]
            if n >= head.nbytes:
                n -= head.nbytes
                i += 1
            else:
                pending[i] = head[n:]
                n = 0


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class PosixIO:
    """Plain POSIX I/O on host memory. Stateless and thread-safe: every call opens its own fd."""

    name = "posix"

    def __init__(self, fsync: bool = False) -> None:
        self.fsync = fsync

    def write_file(self, path: str, chunks: Sequence[Buffer]) -> None:
        views = [byte_view(c) for c in chunks]  # validate every chunk before creating anything
        tmp = tmp_path_for(path)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            try:
                _pwrite_all(fd, path, views, 0)
                if self.fsync:
                    os.fsync(fd)  # data before the rename, or a crash could expose a hole
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            _remove(tmp)
            raise
        if self.fsync:
            fsync_dir(os.path.dirname(path) or ".")

    def read_into(self, path: str, offset: int, out: Buffer) -> None:
        view = byte_view(out, writable=True)
        wanted = view.nbytes
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            got = 0
            while got < wanted:
                n = os.preadv(fd, [view[got:]], offset + got)
                if n == 0:
                    raise ShortReadError(path, offset, wanted, got)
                got += n
        finally:
            os.close(fd)

    def pwrite(self, path: str, offset: int, data: Buffer) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            _pwrite_all(fd, path, [byte_view(data)], offset)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def remove(self, path: str) -> None:
        _remove(path)


class KvikioIO(PosixIO):
    """PosixIO plus CUDA memory: a read into, or a write from, a CUDA buffer goes through
    kvikio.CuFile (GPUDirect Storage where available, else kvikio's bounce buffers); host-only
    operations stay on the POSIX path, which is what kvikio itself would do with host memory,
    minus a hop through its thread pool. Needs libcuda; build it through open_backend.
    A CUDA buffer must be ready when passed (its producing stream synchronised): kvikio copies
    it on its own streams.

    "kvikio-gds" means the cuFile driver reports GDS and kvikio is not preferring its
    compatibility mode; a file on a filesystem without GDS support still falls back per file.
    `threads` sizes kvikio's (process-wide) thread pool, which runs every CUDA transfer: with
    kvikio's default of 1 thread, concurrent reads from our reader pool are serialised (on an
    H200 host, 8 threads read into GPU memory about 1.8x faster than 1). None: KVIKIO_NTHREADS
    when set, else KVIKIO_DEFAULT_THREADS.
    """

    def __init__(self, fsync: bool = False, threads: int | None = None) -> None:
        super().__init__(fsync)
        import kvikio
        import kvikio.defaults

        self._kvikio = kvikio
        if threads is None and "KVIKIO_NTHREADS" not in os.environ:
            threads = KVIKIO_DEFAULT_THREADS
        if threads is not None:
            kvikio.defaults.set("num_threads", threads)
        self.name = "kvikio-gds" if _gds_available() else "kvikio-compat"

    def write_file(self, path: str, chunks: Sequence[Buffer]) -> None:
        if all(on_host(c) for c in chunks):
            return super().write_file(path, chunks)
        bufs = [(b, n) for b, n in ((_kvikio_buffer(c), nbytes(c)) for c in chunks) if n]
        wanted = sum(n for _, n in bufs)
        tmp = tmp_path_for(path)
        try:
            try:
                with self._kvikio.CuFile(tmp, "w") as f:
                    futures, offset = [], 0
                    for buf, n in bufs:
                        futures.append(f.pwrite(buf, n, offset))
                        offset += n
                    written = _wait_all(futures)
                    if written != wanted:
                        raise ShortWriteError(path, wanted, written)
                    if self.fsync:
                        os.fsync(f.fileno())
            except RuntimeError as e:  # kvikio reports every failure as RuntimeError
                raise BlockIOError(f"kvikio write of {path} failed: {e}") from e
            os.replace(tmp, path)
        except BaseException:
            _remove(tmp)
            raise
        if self.fsync:
            fsync_dir(os.path.dirname(path) or ".")

    def read_into(self, path: str, offset: int, out: Buffer) -> None:
        if on_host(out):
            return super().read_into(path, offset, out)
        buf, wanted = _kvikio_buffer(out), nbytes(out)
        if wanted == 0:
            return
        try:
            with self._kvikio.CuFile(path, "r") as f:
                got = f.pread(buf, wanted, offset).get()
        except RuntimeError as e:
            size = os.stat(path).st_size  # a missing file raises FileNotFoundError, as in posix
            if size < offset + wanted:  # kvikio's POSIX path throws at EOF instead of returning short
                raise ShortReadError(path, offset, wanted, max(0, size - offset)) from e
            raise BlockIOError(f"kvikio read of {path} failed: {e}") from e
        if got != wanted:
            raise ShortReadError(path, offset, wanted, got)


def on_host(buf: Buffer) -> bool:
    """False for CUDA memory (a torch CUDA tensor, or anything with __cuda_array_interface__)."""
    device = getattr(buf, "device", None)
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        return False
    return not hasattr(buf, "__cuda_array_interface__")


def _gds_available() -> bool:
    try:
        import kvikio.cufile_driver
        import kvikio.defaults

        return bool(kvikio.cufile_driver.get("is_gds_available")) and not bool(
            kvikio.defaults.is_compat_mode_preferred()
        )
    except Exception:  # no libcufile, or a driver that cannot be opened: compat mode
        return False


def _kvikio_buffer(buf: Buffer) -> Any:
    """What CuFile accepts: a CUDA array (via __cuda_array_interface__) or a host buffer."""
    if hasattr(buf, "is_contiguous") and not on_host(buf):  # torch CUDA tensor
        if not buf.is_contiguous():
            raise ValueError("tensor is not contiguous; its bytes are not one run of memory")
        return buf.detach()
    if hasattr(buf, "__cuda_array_interface__"):  # CuPy, Numba
        return buf
    return byte_view(buf)


def _wait_all(futures: list[Any]) -> int:
    # Wait for every future even if one fails: kvikio threads may still be using the buffers.
    total, first_error = 0, None
    for fut in futures:
        try:
            total += fut.get()
        except RuntimeError as e:
            first_error = first_error or e
    if first_error is not None:
        raise first_error
    return total


def kvikio_unavailable_reason() -> str | None:
    """Why the kvikio backend cannot run on this host, or None when it can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    try:
        import kvikio  # noqa: F401
    except Exception as e:  # ImportError, or libkvikio failing to load
        return f"kvikio does not import ({e}); install the 'gpu' extra (kvikio-cu13)"
    return None


def open_backend(name: str = "auto", fsync: bool = False) -> BlockIO:
    """The backend for setting `io_backend`: "auto" (kvikio on a CUDA host, else posix),
    "posix" or "kvikio". ValueError, naming the setting, when the choice cannot run here."""
    if name == "posix":
        return PosixIO(fsync=fsync)
    if name not in ("auto", "kvikio"):
        raise ValueError(f"io_backend must be 'auto', 'posix' or 'kvikio', got {name!r}")
    reason = kvikio_unavailable_reason()
    if reason is None:
        return KvikioIO(fsync=fsync)
    if name == "kvikio":
        raise ValueError(
            f"io_backend='kvikio' cannot run on this host: {reason}; "
            "set io_backend to 'posix' or 'auto'"
        )
    return PosixIO(fsync=fsync)


__all__ = [
    "TMP_SUFFIX",
    "BlockIO",
    "BlockIOError",
    "KvikioIO",
    "PosixIO",
    "ShortReadError",
    "ShortWriteError",
    "fsync_dir",
    "kvikio_unavailable_reason",
    "nbytes",
    "on_host",
    "open_backend",
    "tmp_path_for",
]
