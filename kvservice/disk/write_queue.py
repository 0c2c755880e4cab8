"""The bounded disk write queue and its writer pool.

Primitives:
  submit(job, sheddable) -> bool   enqueue; when full, wait (backpressure) unless the policy is
                                   "shed" and the job is sheddable, then refuse (caller counts it)
  try_submit_many(jobs, start) -> k  enqueue jobs[start:] while there is room, without waiting;
                                   jobs[start:k] were queued
  room()                           wait until the queue has room for a job
  drain()                          wait until every queued job has been handled
  stop()                           cancel the writers (after drain on SIGTERM)
Writers are asyncio tasks; each hands its job to `handler`, which does the file I/O in a
thread pool, so the event loop never blocks on the disk.

Batches (batch_handler given): a writer that takes a job also takes the jobs queued behind it,
up to `batch_bytes` of `cost(job)` and its fair share of what waits (the queue split over the
writers not busy), and hands them to batch_handler as one list. So a burst of spills reaches
the disk as a few large writes, several in flight at once (one per writer), instead of one
small write per job; a lone job still goes at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

J = TypeVar("J")
log = logging.getLogger(__name__)


class WriteQueue(Generic[J]):
    """A deque and its waiters rather than an asyncio.Queue: a batch of spills is queued with one
    call (asyncio.Queue's put and get per job, with their checks and wake-ups, cost ~3 us of the loop
    a spilled 64 KiB block), and a writer takes its batch with one pop per job and one wake-up of
    the producers waiting for room."""

    def __init__(self, depth: int, writers: int, policy: str, handler: Callable[[J], Awaitable[None]] | None = None,
                 *, batch_handler: Callable[[list[J]], Awaitable[None]] | None = None,
                 cost: Callable[[J], int] = lambda _: 1, batch_bytes: int = 1) -> None:
        if (handler is None) == (batch_handler is None):
            raise ValueError("WriteQueue needs exactly one of handler and batch_handler")
        self.capacity = depth  # <= 0: unbounded
        self.policy = policy
        self._jobs: deque[J] = deque()
        self._unfinished = 0  # queued or being written
        self._getters: deque[asyncio.Future[None]] = deque()  # idle writers, woken when jobs arrive
        self._putters: deque[asyncio.Future[None]] = deque()  # producers waiting for room
        self._drained: deque[asyncio.Future[None]] = deque()  # drain() callers, woken when nothing is unfinished
        self._handler = handler
        self._batch_handler = batch_handler
        self._cost = cost
        self._batch_bytes = batch_bytes
        self._busy_writers = 0
        self._n_writers = writers
        self._tasks: list[asyncio.Task[None]] = []
        self.in_flight = 0  # jobs a writer is doing now
        self.high_water = 0  # most jobs ever waiting for a writer at once

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._writer(), name=f"disk-writer-{i}") for i in range(self._n_writers)]

    @property
    def waiting(self) -> int:
        """Jobs no writer has taken yet (at most `capacity`)."""
        return len(self._jobs)

    @property
    def depth(self) -> int:
        """Jobs not finished: waiting plus in progress."""
        return len(self._jobs) + self.in_flight

    def _room(self) -> int:
        return self.capacity - len(self._jobs) if self.capacity > 0 else 1 << 62

    async def submit(self, job: J, sheddable: bool) -> bool:
        if self._room() <= 0 and self.policy == "shed" and sheddable:
            return False
        await self.room()
        self.try_submit_many((job,))
        return True

    def try_submit(self, job: J) -> bool:
        """Enqueue without waiting; False (nothing queued) when the queue is full."""
        return self.try_submit_many((job,)) == 1

    def try_submit_many(self, jobs: Sequence[J], start: int = 0) -> int:
        """Queue jobs[start:], in order, while there is room, without waiting. Returns k: jobs[start:k]
        were queued (k == len(jobs): all of them)."""
        end = min(len(jobs), start + max(0, self._room()))
        if end <= start:
            return start
        self._jobs.extend(itertools.islice(jobs, start, end) if start or end < len(jobs) else jobs)
        self._unfinished += end - start
        # a job an idle writer is about to take is not waiting for one
        busy = self._busy_writers if self._batch_handler is not None else self.in_flight
        idle = max(0, self._n_writers - busy) if self._tasks else 0
        self.high_water = max(self.high_water, len(self._jobs) - idle)
        _wake(self._getters, end - start)
        return end

    async def room(self) -> None:
        """Return once the queue has room for a job (at once if it has)."""
        while self._room() <= 0:
            await _wait(self._putters)

    async def drain(self) -> None:
        while self._unfinished:
            await _wait(self._drained)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def _next(self) -> None:
        """Wait until a job is queued."""
        while not self._jobs:
            await _wait(self._getters)

    def _take(self, share_of_idle: bool) -> list[J]:
        """The first job and, in batch mode, the jobs queued behind it: up to batch_bytes, and at
        most this writer's share of the queue, so the other idle writers get theirs."""
        jobs = self._jobs
        first = jobs.popleft()
        out = [first]
        if share_of_idle:
            idle = max(1, self._n_writers - self._busy_writers)
            share = -(-(len(jobs) + 1) // idle)
            total, cost, limit = self._cost(first), self._cost, self._batch_bytes
            while len(out) < share and total < limit and jobs:
                job = jobs.popleft()
                out.append(job)
                total += cost(job)
        _wake(self._putters, len(self._putters))  # room now: each re-checks
        return out

    def _finished(self, n: int) -> None:
        self._unfinished -= n
        if not self._unfinished and self._drained:
            _wake(self._drained, len(self._drained))

    async def _writer(self) -> None:
        batch = self._batch_handler is not None
        while True:
            await self._next()
            jobs = self._take(batch)
            if batch:
                self._busy_writers += 1
            self.in_flight += len(jobs)
            try:
                if batch:
                    await self._batch_handler(jobs)  # type: ignore[misc]
                else:
                    await self._handler(jobs[0])  # type: ignore[misc]
            except Exception:  # a handler bug must not kill the writer pool
                if batch:
                    log.exception("disk write batch of %d jobs failed", len(jobs))
                else:
                    log.exception("disk write job failed")
            finally:
                if batch:
                    self._busy_writers -= 1
                self.in_flight -= len(jobs)
                self._finished(len(jobs))


async def _wait(waiters: deque[asyncio.Future[None]]) -> None:
    """Wait in `waiters` until woken. Cancelled after a wake-up, the wake-up goes to the next one
    (as asyncio.Queue does), so no job or room is left unclaimed."""
    fut = asyncio.get_running_loop().create_future()
    waiters.append(fut)
    try:
        await fut
    except BaseException:
        if fut.done() and not fut.cancelled():
            _wake(waiters, 1)
        else:
            fut.cancel()
            try:
                waiters.remove(fut)
            except ValueError:
                pass
        raise


def _wake(waiters: deque[asyncio.Future[None]], n: int) -> None:
    """Wake up to n of the waiters, first come first."""
    while n > 0 and waiters:
        fut = waiters.popleft()
        if not fut.done():
            fut.set_result(None)
            n -= 1
