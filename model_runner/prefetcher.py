"""Prefetcher: stages queued requests' disk blocks into the service's host tier, head first, in chunks.

One Prefetch of a whole history (a thousand 2 MiB blocks) lands all at once: the daemon onboards its
blocks when every read of the call is done, so a request admitted while the staging runs finds none
of it in host memory and reads the same blocks from disk again. Here a job's hashes go out as
consecutive Prefetch calls of `chunk_blocks`, one after another, from a thread of its own (the
engine's loop never waits for them): each chunk is in host memory as soon as it is read, the staged
part is always a prefix of the chain, and the request, once admitted, loads that prefix from host
memory (its Lookup is asked again) and recomputes or loads the rest. A job stops when its request
leaves the queue (cancel), at the first block the daemon did not stage (a miss, a refused lease, a
failed read: the chain's tail is of no use without it), or when the client is closed.

Jobs run in the order submitted, which is the queue's order. Callbacks (metrics, wake) run on the
prefetch thread.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence

from engine_client.errors import KVClientError
from engine_client.sync_client import KVClient
from kvwire.v1 import kvcache_pb2

log = logging.getLogger(__name__)

CHUNK_BLOCKS = 64  # blocks per Prefetch call: 128 MiB of 8B-shaped KV, ~0.1 s of a 1-2 GB/s disk
_USABLE = (kvcache_pb2.STAGED, kvcache_pb2.ALREADY_IN_HOST)


class PrefetchJob:
    __slots__ = ("_wanted", "cancelled", "done", "hashes", "staged")

    def __init__(self, hashes: Sequence[bytes], wanted: Callable[[], bool]) -> None:
        self.hashes = list(hashes)
        self.staged = 0  # leading blocks the daemon answered STAGED / ALREADY_IN_HOST
        self.cancelled = False
        self.done = False
        self._wanted = wanted

    def cancel(self) -> None:
        self.cancelled = True

    @property
    def wanted(self) -> bool:
        return not self.cancelled and self._wanted()


class Prefetcher:
    def __init__(self, client: KVClient, *, chunk_blocks: int = CHUNK_BLOCKS,
                 on_status: Callable[[int], None] = lambda status: None,
                 on_chunk: Callable[[], None] = lambda: None) -> None:
        """on_status: called per block answer (a PrefetchStatus value); on_chunk: after each chunk
        (the engine's wake-up: a queued request's Lookup may now find more in host memory)."""
        if chunk_blocks < 1:
            raise ValueError(f"chunk_blocks must be >= 1, got {chunk_blocks}")
        self._client = client
        self._chunk = chunk_blocks
        self._on_status = on_status
        self._on_chunk = on_chunk
        self._jobs: deque[PrefetchJob] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._active = 0  # 1 while a job is staging
        self._thread: threading.Thread | None = None

    def submit(self, hashes: Sequence[bytes], wanted: Callable[[], bool] = lambda: True) -> PrefetchJob:
        """Queue a job (any thread); `wanted` is asked before each chunk (False ends the job, as cancel)."""
        job = PrefetchJob(hashes, wanted)
        with self._cv:
            if self._closed:
                job.done = True
                return job
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="engine-prefetch", daemon=True)
                self._thread.start()
            self._cv.notify()
        return job

    def pending(self) -> int:
        """Jobs queued or staging (any thread)."""
        with self._cv:
            return sum(1 for job in self._jobs if job.wanted) + self._active

    def close(self, timeout: float = 5.0) -> None:
        """Cancel every job and stop the thread (a chunk in flight is waited for up to `timeout`)."""
        with self._cv:
            self._closed = True
            for job in self._jobs:
                job.cancel()
                job.done = True
            self._jobs.clear()
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = self._jobs.popleft()
                self._active = 1
            try:
                self._stage(job)
            finally:
                job.done = True
                with self._cv:
                    self._active = 0

    def _stage(self, job: PrefetchJob) -> None:
        n = len(job.hashes)
        for lo in range(0, n, self._chunk):
            if not job.wanted or self._closed:
                return
            try:
                statuses = self._client.prefetch(job.hashes[lo: lo + self._chunk])
            except KVClientError as err:
                log.warning("prefetch failed: %s", err)
                return
            ok = 0
            for status in statuses:
                self._on_status(status)
            for status in statuses:
                if status not in _USABLE:
                    break
                ok += 1
            job.staged = lo + ok
            self._on_chunk()
            if ok < len(statuses):
                return  # the chain's tail is no use without this block
