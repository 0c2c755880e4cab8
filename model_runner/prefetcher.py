"""Prefetcher: stages queued requests' disk blocks into the service's host tier, head first, in chunks.

One Prefetch of a whole history (a thousand 2 MiB blocks) lands all at once: the daemon onboards its
blocks when every read of the call is done, so a request admitted while the staging runs finds none
of it in host memory and reads the same blocks from disk again. Here a job's hashes go out as
consecutive Prefetch calls of `chunk_blocks`, from a thread of its own (the engine's loop never waits
for them), at most `depth` calls in flight (the next chunk's read is queued at the disk while the
previous one is answered: no idle disk between calls, and never more than depth x chunk bytes of reads
that a cancel would waste): each chunk is in host memory as soon as it is read, the staged part is
always a prefix of the chain (`PrefetchJob.staged`, which the scheduler reads at admission instead of
asking the daemon again), and the request, once admitted, loads that prefix from host memory and
recomputes or loads the rest. A job stops when its request leaves the queue (cancel), at the first
block the daemon did not stage for good (a miss, a failed read: the chain's tail is of no use without
it), or when the client is closed. A block refused for room -- the session's lease cap, a host tier
pinned by loads and prefetches -- pauses the job instead: room comes back as queued requests load their
leased blocks and spills complete, so it asks again from that block after RETRY_S, doubling up to
RETRY_MAX_S, while its request is queued (the jobs behind it wait: they would be refused the same).

Jobs run in the order submitted, which is the queue's order. Callbacks (metrics, wake, the staging
rate) run on the prefetch thread. `on_rate(blocks, seconds)`: a job's blocks read from disk so far and
the seconds since its first call, reported after 2, 4, 8, ... chunks and when the job ends -- the
disk's read rate as this engine sees it, which the cost model uses for the disk part of a Load.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from engine_client.errors import KVClientError
from engine_client.sync_client import KVClient
from kvwire.v1 import kvcache_pb2

log = logging.getLogger(__name__)

CHUNK_BLOCKS = 32  # blocks per Prefetch call: 64 MiB of 8B-shaped KV, ~50 ms of a 1.3 GB/s disk; a cancel (the
# request admitted) wastes what is in flight, at most DEPTH chunks
DEPTH = 2  # Prefetch calls in flight per job
RETRY_S = 0.05  # a job refused for room (lease cap, no room) asks again after this, doubling up to RETRY_MAX_S
RETRY_MAX_S = 0.8
RETRYABLE = ("lease_cap", "no_room")  # refusals that pass: leases end as requests load, spills free room
_USABLE = (kvcache_pb2.STAGED, kvcache_pb2.ALREADY_IN_HOST)


def refusal_reason(status: int, message: str) -> str:
    """The reason a Prefetch did not stage a block, from its status and the daemon's message: lease_cap
    (this session's or all sessions' prefetch leases are at their cap), no_room (the host tier is pinned
    by loads and prefetches), read_failed, not_found, or other."""
    if status == kvcache_pb2.NOT_FOUND:
        return "not_found"
    text = message.lower()
    for key, reason in (("cap", "lease_cap"), ("no room", "no_room"), ("read failed", "read_failed")):
        if key in text:
            return reason
    return "other"


class PrefetchJob:
    """One request's staging. Besides `staged`, what its request's timings report at admission (written by
    the prefetch thread, read by the loop; each a plain number): t_submit / t_start (monotonic: queued,
    first Prefetch sent; 0 = not yet -- the job waits behind the jobs submitted before it), t_first (its
    first answer; 0 = none yet), answered (chunks answered), read (blocks of the staged prefix read from
    disk; the rest were in host memory already), paused_s (time paused after room refusals) and refusals
    (how many)."""

    __slots__ = ("_wanted", "answered", "cancelled", "done", "hashes", "paused_s", "read", "refusals", "staged",
                 "t_first", "t_start", "t_submit")

    def __init__(self, hashes: Sequence[bytes], wanted: Callable[[], bool]) -> None:
        self.hashes = list(hashes)
        self.staged = 0  # leading blocks the daemon answered STAGED / ALREADY_IN_HOST
        self.cancelled = False
        self.done = False
        self._wanted = wanted
        self.t_submit = time.monotonic()
        self.t_start = 0.0
        self.t_first = 0.0
        self.answered = 0
        self.read = 0
        self.paused_s = 0.0
        self.refusals = 0

    def cancel(self) -> None:
        self.cancelled = True

    @property
    def wanted(self) -> bool:
        return not self.cancelled and self._wanted()


class Prefetcher:
    def __init__(self, client: KVClient, *, chunk_blocks: int = CHUNK_BLOCKS, depth: int = DEPTH,
                 on_statuses: Callable[[Sequence[int]], None] = lambda statuses: None,
                 on_chunk: Callable[[], None] = lambda: None,
                 on_rate: Callable[[int, float], None] = lambda blocks, seconds: None,
                 on_stop: Callable[[int, str], None] = lambda status, message: None,
                 retry_s: float = RETRY_S) -> None:
        """on_statuses: called once per chunk answer with its PrefetchStatus values (count them there, not a
        call per block: it runs on this thread while the engine loop wants the GIL); on_chunk: after each chunk
        (the engine's wake-up: a queued request may now find more in host memory); on_rate: see the
        module docstring; on_stop(status, message): a block the daemon did not stage, with its reason (the
        session's lease cap, no room in the host tier, a failed read; "" for NOT_FOUND): the job stops, or
        pauses and asks again (refusal_reason in RETRYABLE)."""
        if chunk_blocks < 1:
            raise ValueError(f"chunk_blocks must be >= 1, got {chunk_blocks}")
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._client = client
        self._chunk = chunk_blocks
        self._depth = depth
        self._on_statuses = on_statuses
        self._on_chunk = on_chunk
        self._on_rate = on_rate
        self._on_stop = on_stop
        self._retry_s = retry_s
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
        """Cancel every job and stop the thread (the chunks in flight are waited for up to `timeout`)."""
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
        flight: deque[tuple[int, concurrent.futures.Future[list[int]]]] = deque()
        nxt = 0  # first hash not asked yet
        broken = False  # a chunk came back short: ask nothing more, drain what is in flight
        t0 = 0.0
        read = 0  # blocks of this job read from disk (STAGED), in the staged prefix
        answered = 0  # chunks answered
        retry_from = -1  # refused for room: ask again from this block once the chunks in flight are drained
        backoff = self._retry_s
        try:
            while True:
                while (not broken and nxt < n and len(flight) < self._depth and job.wanted
                       and not self._closed):
                    try:
                        fut = self._client.submit_prefetch(job.hashes[nxt: nxt + self._chunk])
                    except KVClientError as err:
                        log.warning("prefetch not sent: %s", err)
                        broken = True
                        break
                    if not t0:
                        t0 = time.monotonic()
                        job.t_start = job.t_start or t0
                    flight.append((nxt, fut))
                    nxt += self._chunk
                if not flight:
                    if retry_from < 0 or not job.wanted or self._closed:
                        return
                    if read and answered >= 2:  # the disk rate up to the pause; measured afresh after it
                        self._on_rate(read, time.monotonic() - t0)
                    t0, read, answered = 0.0, 0, 0
                    t_pause = time.monotonic()
                    with self._cv:
                        if not self._closed:
                            self._cv.wait(backoff)
                    job.paused_s += time.monotonic() - t_pause
                    backoff = min(2 * backoff, RETRY_MAX_S)
                    nxt, retry_from, broken = retry_from, -1, False
                    continue
                lo, fut = flight.popleft()
                try:
                    statuses = fut.result()
                except Exception as err:  # noqa: BLE001  # refused, cancelled, client closed: the job ends
                    log.warning("prefetch failed: %s", err)
                    broken, retry_from = True, -1
                    continue
                self._on_statuses(statuses)
                answered += 1
                job.answered += 1
                job.t_first = job.t_first or time.monotonic()
                if broken or lo != job.staged:
                    continue  # behind a gap: of no use (its leases run out)
                ok = fresh = 0
                for status in statuses:
                    if status not in _USABLE:
                        break
                    ok += 1
                    fresh += status == kvcache_pb2.STAGED
                read += fresh
                job.read += fresh
                job.staged = lo + ok
                self._on_chunk()
                if ok < len(statuses):
                    broken = True  # the chain's tail is no use without this block (until it is staged)
                    message = getattr(statuses, "messages", {}).get(ok, "")
                    self._on_stop(statuses[ok], message)
                    if refusal_reason(statuses[ok], message) in RETRYABLE:
                        retry_from = lo + ok
                        job.refusals += 1
                else:
                    backoff = self._retry_s
                if ok == len(statuses) and answered >= 2 and answered & (answered - 1) == 0 and read:
                    self._on_rate(read, time.monotonic() - t0)
        finally:
            if read and answered >= 2 and answered & (answered - 1):
                self._on_rate(read, time.monotonic() - t0)
