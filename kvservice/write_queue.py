"""The bounded disk write queue and its writer pool.

Primitives:
  submit(job, sheddable) -> bool   enqueue; when full, wait (backpressure) unless the policy is
                                   "shed" and the job is sheddable, then refuse (caller counts it)
  drain()                          wait until every queued job has been handled
  stop()                           cancel the writers (after drain on SIGTERM)
Writers are asyncio tasks; each hands its job to `handler`, which does the file I/O in a
thread pool, so the event loop never blocks on the disk.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

J = TypeVar("J")
log = logging.getLogger(__name__)


class WriteQueue(Generic[J]):
    def __init__(self, depth: int, writers: int, policy: str, handler: Callable[[J], Awaitable[None]]) -> None:
        self.capacity = depth
        self.policy = policy
        self._q: asyncio.Queue[J] = asyncio.Queue(maxsize=depth)
        self._handler = handler
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
        idle = max(0, self._n_writers - self.in_flight) if self._tasks else 0
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

    async def _writer(self) -> None:
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
