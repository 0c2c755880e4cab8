"""Segment files: preallocated files of equal slots, opened only if they are ours.

    <root>/seg-<id:08d>-<slot_bytes>.kvseg      slots * slot_bytes bytes, made with posix_fallocate

Each file has two descriptors: a buffered one, and an O_DIRECT one where the filesystem takes
it (ext4, xfs, tmpfs since Linux 6.6; an EINVAL from open means no, and the buffered one serves
everything). A file is opened only when lstat and fstat agree that it is a regular file with one
link, owned by this uid, of the expected size, and O_NOFOLLOW|O_NONBLOCK make sure a planted
symlink or FIFO is refused instead of followed or waited on.

The I/O boundary: every syscall on segment data goes through `os_open`, `os_pwritev`,
`os_preadv` and `os_fallocate` below, so tests inject faults (EIO, short transfers) there and
nowhere else. `write_all` / `read_all` turn partial transfers into ShortWriteError /
ShortReadError.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import stat
from dataclasses import dataclass

import numpy as np

from kvservice.disk.io_backend import ShortReadError, ShortWriteError

SUFFIX = ".kvseg"
NAME_RE = re.compile(r"seg-(\d{8})-(\d+)\.kvseg")
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_O_DIRECT = getattr(os, "O_DIRECT", 0)

# --- the I/O boundary (tests replace these, nothing else)
os_open = os.open
os_pwritev = os.pwritev
os_preadv = os.preadv
os_fallocate = os.posix_fallocate


class UnsafeFileError(OSError):
    """A path in the disk directory is not a regular file this daemon made."""


def segment_name(seg_id: int, slot_bytes: int) -> str:
    return f"seg-{seg_id:08d}-{slot_bytes}{SUFFIX}"


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned, zeroed host buffer (anonymous mmap) that O_DIRECT can use directly."""
    return np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=np.uint8)[:nbytes]


def _check(st: os.stat_result, path: str, size: int | None) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFileError(errno.EPERM, f"not a regular file (mode {stat.filemode(st.st_mode)}); refused", path)
    if st.st_uid != os.geteuid() or st.st_nlink != 1:
        raise UnsafeFileError(errno.EPERM, f"owned by uid {st.st_uid} with {st.st_nlink} links, not a file this "
                              "daemon made; refused", path)
    if size is not None and st.st_size != size:
        raise UnsafeFileError(errno.EPERM, f"is {st.st_size} bytes, its metadata says {size}; refused", path)


@dataclass(slots=True)
class SegmentFile:
    id: int
    slot_bytes: int
    slots: int
    path: str
    fd: int  # buffered
    dfd: int | None  # O_DIRECT, or None where the filesystem refuses it
    writable: bool

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * self.slots

    def offset(self, slot: int) -> int:
        return slot * self.slot_bytes

    @classmethod
    def create(cls, root: str, seg_id: int, slot_bytes: int, slots: int, *, direct: bool) -> SegmentFile:
        """Make and preallocate a new file (O_EXCL: never an existing path). On failure nothing
        is left behind."""
        path = os.path.join(root, segment_name(seg_id, slot_bytes))
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os_open(path, flags, 0o600)
        try:
            try:
                os_fallocate(fd, 0, slots * slot_bytes)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
                    raise
                os.ftruncate(fd, slots * slot_bytes)  # no fallocate here: a sparse file
            dfd = _open_direct(path) if direct else None
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        return cls(seg_id, slot_bytes, slots, path, fd, dfd, True)

    @classmethod
    def open(cls, root: str, seg_id: int, slot_bytes: int, slots: int, *, direct: bool) -> SegmentFile:
        """Open an existing segment after the safety checks; UnsafeFileError when refused.
        Read-only when the filesystem is (EROFS)."""
        path = os.path.join(root, segment_name(seg_id, slot_bytes))
        size = slots * slot_bytes
        before = os.lstat(path)
        _check(before, path, size)
        writable = True
        base = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os_open(path, os.O_RDWR | base)
        except OSError as e:
            if e.errno != errno.EROFS:
                raise
            fd, writable = os_open(path, os.O_RDONLY | base), False
        try:
            st = os.fstat(fd)
            _check(st, path, size)
            if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
                raise UnsafeFileError(errno.EPERM, "was replaced while being opened; refused", path)
            dfd = _open_direct(path, writable) if direct else None
        except BaseException:
            os.close(fd)
            raise
        return cls(seg_id, slot_bytes, slots, path, fd, dfd, writable)

    def close(self) -> None:
        for fd in (self.fd, self.dfd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def sync(self) -> None:
        os.fdatasync(self.fd)


def _open_direct(path: str, writable: bool = True) -> int | None:
    if not _O_DIRECT:
        return None
    mode = os.O_RDWR if writable else os.O_RDONLY
    try:
        return os_open(path, mode | _O_DIRECT | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.EINVAL:  # the filesystem does not do direct I/O
            return None
        raise


def write_all(fd: int, views: list[np.ndarray], offset: int, path: str) -> None:
    """pwritev every byte of `views` at `offset`, resuming after partial writes."""
    pending = [v for v in views if v.nbytes]
    wanted = sum(v.nbytes for v in pending)
    done, i = 0, 0
    while i < len(pending):
        try:
            n = os_pwritev(fd, pending[i:i + _IOV_MAX], offset + done)
        except OSError as e:
            if done:
                raise ShortWriteError(path, wanted, done, e) from e
            raise
        if n <= 0:
            raise ShortWriteError(path, wanted, done)
        done += n
        while n:
            if n >= pending[i].nbytes:
                n -= pending[i].nbytes
                i += 1
            else:
                pending[i] = pending[i][n:]
                n = 0


def read_all(fd: int, views: list[np.ndarray], offset: int, path: str) -> None:
    """preadv until every view is full; ShortReadError at end of file."""
    pending = [v for v in views if v.nbytes]
    wanted = sum(v.nbytes for v in pending)
    done, i = 0, 0
    while i < len(pending):
        n = os_preadv(fd, pending[i:i + _IOV_MAX], offset + done)
        if n <= 0:
            raise ShortReadError(path, offset, wanted, done)
        done += n
        while n:
            if n >= pending[i].nbytes:
                n -= pending[i].nbytes
                i += 1
            else:
                pending[i] = pending[i][n:]
                n = 0
