"""The disk write queue (kvservice.disk.write_queue) on its own: batch submission without waiting,
backpressure through room(), cancellation of a producer waiting for room, drain, and the batches its
writers take. Real asyncio tasks and futures; a handler stands for the disk (an Event holds a write)."""

from __future__ import annotations

import asyncio

from kvservice.disk.write_queue import WriteQueue

LIMIT = 5.0  # seconds: a wake-up that never comes fails the test instead of hanging it


def _held_queue(depth: int, policy: str = "wait") -> tuple[WriteQueue, asyncio.Event, list]:
    """A started queue of one writer whose writes all wait for `release`; `written` lists the jobs
    written, in order."""
    release = asyncio.Event()
    written: list = []

    async def handler(job) -> None:
        await release.wait()
        written.append(job)

    q: WriteQueue = WriteQueue(depth=depth, writers=1, policy=policy, handler=handler)
    return q, release, written


async def test_a_batch_is_queued_as_far_as_there_is_room_and_the_rest_after_backpressure() -> None:
    """Scenario: depth 4, one writer stuck on its first write. try_submit_many of 10 jobs queues the
    first 4 and says so; once the writer took one, the next call queues exactly one more; a producer
    then waits in room() for each free place and the queue never holds more than its depth; every
    job is written once, in order."""
    q, release, written = _held_queue(4)
    jobs = list(range(10))
    assert q.try_submit_many(jobs) == 4  # the writer has not run yet: the queue is full
    q.start()
    try:
        await asyncio.sleep(0)  # the writer takes job 0 and blocks on it
        assert (q.waiting, q.in_flight) == (3, 1)
        k = q.try_submit_many(jobs, 4)
        assert k == 5 and q.waiting == 4
        assert q.try_submit_many(jobs, k) == k  # full: nothing queued, nothing lost
        release.set()
        while k < len(jobs):
            await asyncio.wait_for(q.room(), LIMIT)
            k = q.try_submit_many(jobs, k)
            assert q.waiting <= q.capacity
        await asyncio.wait_for(q.drain(), LIMIT)
        assert written == jobs and (q.waiting, q.in_flight, q.depth) == (0, 0, 0)
    finally:
        await q.stop()


async def test_a_cancelled_producer_does_not_keep_the_room_from_the_next_one() -> None:
    """Scenario: depth 1, the writer stuck; two producers wait in room(), the first is cancelled.
    When the writer takes the queued job, the second producer is woken and submits; drain then
    returns with both jobs written."""
    q, release, written = _held_queue(1)
    q.start()
    try:
        assert q.try_submit("first")
        await asyncio.sleep(0)  # the writer takes it and blocks
        assert q.try_submit("second") and not q.try_submit("third")  # full again
        a = asyncio.ensure_future(q.room())
        b = asyncio.ensure_future(q.room())
        await asyncio.sleep(0)
        assert not a.done() and not b.done()
        a.cancel()
        release.set()  # the writer finishes "first" and takes "second": room for one
        await asyncio.wait_for(b, LIMIT)
        assert a.cancelled()
        assert q.try_submit("third")
        await asyncio.wait_for(q.drain(), LIMIT)
        assert written == ["first", "second", "third"]
    finally:
        await q.stop()


async def test_submit_sheds_only_sheddable_jobs_when_full_and_waits_otherwise() -> None:
    """Scenario: "shed" policy, depth 1, the writer stuck. A sheddable job that finds the queue full is
    refused at once (False, not queued); a job that may not be shed waits for room and is written."""
    q, release, written = _held_queue(1, "shed")
    q.start()
    try:
        assert await q.submit("a", sheddable=True)
        await asyncio.sleep(0)
        assert await q.submit("b", sheddable=True)  # room for one
        assert not await q.submit("shed me", sheddable=True)
        keep = asyncio.ensure_future(q.submit("keep", sheddable=False))
        await asyncio.sleep(0)
        assert not keep.done()
        release.set()
        assert await asyncio.wait_for(keep, LIMIT)
        await asyncio.wait_for(q.drain(), LIMIT)
        assert written == ["a", "b", "keep"]
    finally:
        await q.stop()


async def test_batch_writers_split_the_queue_and_bound_each_batch_by_cost() -> None:
    """Scenario: two batch writers, batch_bytes 10, each job costing 3. 12 jobs queued at once: the
    first writer takes its share (half of what waits, cut at the first job that reaches 10 bytes:
    4 jobs), the second the same; the rest follow. Every job is written once, in queue order within
    each batch, and no batch is over 4 jobs."""
    batches: list[list[int]] = []
    gate = asyncio.Event()

    async def batch_handler(jobs: list[int]) -> None:
        batches.append(jobs)
        await gate.wait()

    q: WriteQueue[int] = WriteQueue(depth=64, writers=2, policy="wait", batch_handler=batch_handler,
                                    cost=lambda _: 3, batch_bytes=10)
    q.start()
    try:
        await asyncio.sleep(0)  # both writers idle, waiting for jobs
        assert q.try_submit_many(list(range(12))) == 12
        for _ in range(3):
            await asyncio.sleep(0)
        assert batches[:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        gate.set()
        await asyncio.wait_for(q.drain(), LIMIT)
        assert sorted(j for b in batches for j in b) == list(range(12))
        assert all(len(b) <= 4 and b == sorted(b) for b in batches)
    finally:
        await q.stop()
