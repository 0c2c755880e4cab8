"""Disk bandwidth caps: a BlockIO wrapper that paces reads and writes with token buckets.

An operator sharing a disk with other tenants sets `disk_read_bytes_per_second` /
`disk_write_bytes_per_second` (0: unlimited). Each read_into / write_file / pwrite takes its
byte count from the matching bucket before it runs, sleeping in the calling reader or writer
thread (never on the event loop) until the bucket has paid for it. The bucket may go into
debt, so concurrent threads queue behind each other and the sum of their bandwidth stays at
the cap; idle time refills at most `burst` bytes of credit. remove() is not throttled.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from kvservice.checksum import Buffer
from kvservice.disk.io_backend import BlockIO, nbytes


class TokenBucket:
    """`rate` bytes per second, at most `burst` bytes of saved credit; sleep and now injected."""

    def __init__(self, rate: int, burst: int = 0, *, sleep: Callable[[float], None] = time.sleep,
                 now: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be positive, got {rate}")
        self.rate, self.burst = rate, burst
        self._sleep, self._now = sleep, now
        self._tokens, self._at = float(burst), now()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        with self._lock:  # reserve under the lock, sleep outside it
            t = self._now()
            self._tokens = min(float(self.burst), self._tokens + (t - self._at) * self.rate) - n
            self._at = t
            wait = -self._tokens / self.rate
        if wait > 0:
            self._sleep(wait)


class ThrottledIO:
    """`inner` with its reads and/or writes capped; reported as e.g. "posix+throttled"."""

    def __init__(self, inner: BlockIO, read: TokenBucket | None, write: TokenBucket | None) -> None:
        self.inner, self.read_bucket, self.write_bucket = inner, read, write
        self.name = f"{inner.name}+throttled"
        self.fsync = inner.fsync

    def write_file(self, path: str, chunks: Sequence[Buffer]) -> None:
        if self.write_bucket is not None:
            self.write_bucket.take(sum(nbytes(c) for c in chunks))
        self.inner.write_file(path, chunks)

    def read_into(self, path: str, offset: int, out: Buffer) -> None:
        if self.read_bucket is not None:
            self.read_bucket.take(nbytes(out))
        self.inner.read_into(path, offset, out)

    def pwrite(self, path: str, offset: int, data: Buffer) -> None:
        if self.write_bucket is not None:
            self.write_bucket.take(nbytes(data))
        self.inner.pwrite(path, offset, data)

    def remove(self, path: str) -> None:
        self.inner.remove(path)


def throttled(io: BlockIO, read_bytes_per_second: int = 0, write_bytes_per_second: int = 0) -> BlockIO:
    """`io` itself when both caps are 0 (unlimited), else a ThrottledIO around it."""
    if not read_bytes_per_second and not write_bytes_per_second:
        return io
    read = TokenBucket(read_bytes_per_second) if read_bytes_per_second else None
    write = TokenBucket(write_bytes_per_second) if write_bytes_per_second else None
    return ThrottledIO(io, read, write)
