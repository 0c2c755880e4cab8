"""The bounded disk write queue and its writer pool.

Primitives:
  submit(job, sheddable) -> bool   enqueue; when full, wait (backpressure) unless the policy is
                                   "shed" and the job is sheddable, then refuse (caller counts it)
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
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

J = TypeVar("J")
log = logging.getLogger(__name__)


class WriteQueue(Generic[J]):
    def __init__(self, depth: int, writers: int, policy: str, handler: Callable[[J], Awaitable[None]] | None = None,
                 *, batch_handler: Callable[[list[J]], Awaitable[None]] | None = None,
                 cost: Callable[[J], int] = lambda _: 1, batch_bytes: int = 1) -> None:
        if (handler is None) == (batch_handler is None):
            raise ValueError("WriteQueue needs exactly one of handler and batch_handler")
        self.capacity = depth
        self.policy = policy
        self._q: asyncio.Queue[J] = asyncio.Queue(maxsize=depth)
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
        return self._q.qsize()

    @property
    def depth(self) -> int:
        """Jobs not finished: waiting plus in progress."""
        return self._q.qsize() + self.in_flight

    async def submit(self, job: J, sheddable: bool) -> bool:
        if self._q.full() and self.policy == "shed" and sheddable:
            return False
        await self._q.put(job)
        # a job an idle writer is about to take is not waiting for one
        busy = self._busy_writers if self._batch_handler is not None else self.in_flight
        idle = max(0, self._n_writers - busy) if self._tasks else 0
        self.high_water = max(self.high_water, self._q.qsize() - idle)
        return True

    def try_submit(self, job: J) -> bool:
        """Enqueue without waiting; False (nothing queued) when the queue is full."""
        if self._q.full():
            return False
        self._q.put_nowait(job)
        return True

    async def drain(self) -> None:
        await self._q.join()

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    def _take_batch(self, first: J) -> list[J]:
        """first, and the jobs queued behind it: up to batch_bytes, and at most this writer's
        share of the queue, so the other idle writers get theirs."""
        idle = max(1, self._n_writers - self._busy_writers)
        share = -(-(self._q.qsize() + 1) // idle)
        jobs, total = [first], self._cost(first)
        while len(jobs) < share and total < self._batch_bytes and not self._q.empty():
            job = self._q.get_nowait()
            jobs.append(job)
            total += self._cost(job)
        return jobs

    async def _batch_writer(self) -> None:
        while True:
            jobs = self._take_batch(await self._q.get())
            self._busy_writers += 1
            self.in_flight += len(jobs)
            try:
                await self._batch_handler(jobs)  # type: ignore[misc]
            except Exception:  # a handler bug must not kill the writer pool
                log.exception("disk write batch of %d jobs failed", len(jobs))
            finally:
                self._busy_writers -= 1
                self.in_flight -= len(jobs)
                for _ in jobs:
                    self._q.task_done()

    async def _writer(self) -> None:
        if self._batch_handler is not None:
            return await self._batch_writer()
        while True:
            job = await self._q.get()
            self.in_flight += 1
            try:
                await self._handler(job)
            except Exception:  # a handler bug must not kill the writer pool
                log.exception("disk write job failed")
            finally:
                self.in_flight -= 1
                self._q.task_done()
