"""How a large Store or Load is cut into parts that are planned and copied in turn (parts), and
the rules every call that hands work to a copy thread keeps:
  parts(n, ...) -> [(lo, hi)]     the parts of a batch of n blocks (module constants below; tests
                                  set them small to drive the parts path with a few blocks)
  in_parts(n, ...)                whether that is more than one part
  when_copy_ends(fut, fn)         fn once an abandoned copy's thread is done with its memory
  fail_unanswered(results, code)  a block left without a status is reported failed, never success
  Answer(send)                    a caller's hook: a call's results sent as soon as they are final
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable

from kvservice.core.types import LoadResults, StoreResults

# Tuning knobs for benchmark A/Bs are KVTUNE_* environment variables (not KVSERVICE_*: the daemon's
# config refuses any KVSERVICE_ variable that names no setting). The defaults are the measured best.
# A Store chunk of more than 2 x PIPELINE_BLOCKS blocks is planned and copied in parts of that many,
# the next part's plan beside the previous part's copy, at most PIPELINE_DEPTH copies in flight.
# KVTUNE_STORE_PART_BLOCKS overrides the part size (a benchmark's A/B; a huge value: one part)
PIPELINE_BLOCKS = max(1, int(os.environ.get("KVTUNE_STORE_PART_BLOCKS", "2048")))
# the first part: the first copy starts after a short plan; parts double from it (KVTUNE_STORE_FIRST_BLOCKS:
# an A/B; on the H100 the first three parts of a 256 KiB Store took longer to plan and launch than to copy)
PIPELINE_FIRST = max(1, int(os.environ.get("KVTUNE_STORE_FIRST_BLOCKS", "256")))
PIPELINE_DEPTH = max(1, int(os.environ.get("KVTUNE_COPY_DEPTH", "2")))  # an A/B, as the part size
# A Store of more than STORE_FIRST_BYTES goes in parts whatever its block count: the first part that
# many bytes of blocks (at least one; at most PIPELINE_BLOCKS), each later part STORE_GROW times the
# one before, up to PIPELINE_BLOCKS. The first copy starts after the plan of 256 MiB, not of the whole
# batch; the next part's plan (up to 8 x as many blocks) runs beside that copy. H100, 2 GiB Stores,
# 64-region layout, A/B in one call: 2 MiB blocks 0.87 -> 0.91 x D2H (one part of 1024 blocks
# before), 256 KiB 0.67-0.70 -> 0.78 (parts of 256, 512, 1024, ... before); 128 MiB or 512 MiB first
# parts, or parts of 4096, did worse (BENCHMARKS.md). KVTUNE_STORE_FIRST_MIB / KVTUNE_STORE_GROW: A/Bs
# (0: off, the count rule below only). KVTUNE_LOAD_FIRST_MIB / KVTUNE_LOAD_GROW: the same for a Load
# (off by default: not measured yet).
STORE_FIRST_BYTES = max(0, int(float(os.environ.get("KVTUNE_STORE_FIRST_MIB", "256")) * (1 << 20)))
STORE_GROW = max(2, int(os.environ.get("KVTUNE_STORE_GROW", "8")))
LOAD_FIRST_BYTES = max(0, int(float(os.environ.get("KVTUNE_LOAD_FIRST_MIB", "0")) * (1 << 20)))
LOAD_GROW = max(2, int(os.environ.get("KVTUNE_LOAD_GROW", "8")))
# ENQUEUE_FIRST (KVTUNE_COPY_ENQUEUE_FIRST=0 turns it off for an A/B): a Store plans its next part
# only once the copy thread has queued the part just handed to it on the device (a copy memory that
# signals it: SIGNALS_ENQUEUED). The loop's long GIL holds would slow that thread's launches (each
# waits up to the switch interval for the GIL) and the device would run dry. H100, 2 GiB Stores,
# 64-region layout: 256 KiB blocks 0.52 -> 0.63 x D2H, 64 KiB 0.24 -> 0.29 (BENCHMARKS.md).
ENQUEUE_FIRST = os.environ.get("KVTUNE_COPY_ENQUEUE_FIRST", "1") == "1"
# The same for a Load in parts (KVTUNE_LOAD_ENQUEUE_FIRST=1): off until measured on a GPU host (its
# bookkeeping between parts is short; the Store's measured gain does not carry over by itself).
LOAD_ENQUEUE_FIRST = os.environ.get("KVTUNE_LOAD_ENQUEUE_FIRST", "0") == "1"
# Where the work a Store leaves for after its answer runs (freeing the entries it evicted, building blank
# entries for the next Store: Lifecycle.tidy_step): "answer" - all of it at the end of a Store whose answer
# is out (the frames channel's early answer), before the next request is read; a Store answered only by its
# return (gRPC) leaves it to "task" - a task of the cache, a step at a time between other requests - so its
# reply never waits for it (KVTUNE_TIDY=task: always the task, an A/B). H100, 2 GiB batches, the same call:
# the tree with the task everywhere (fdede74) against the one that did it all at the Store's end (d4da5e4):
# 64 KiB Store 0.41-0.44 vs 0.50, Load 0.59 vs 0.71, 256 KiB Load 0.83-0.87 vs 0.89 (the task's steps run
# while the next call's copy thread needs the GIL to launch; BENCHMARKS.md, "Lead, 2026-12-07 15:55").
TIDY = os.environ.get("KVTUNE_TIDY", "answer")


def when_copy_ends(fut: asyncio.Future, fn: Callable[[], object]) -> None:
    """Run fn once an abandoned copy job's thread is done with its memory (now if it is), its outcome
    retrieved: the call's failure is raised already or superseded."""
    if fut.done():
        if not fut.cancelled():
            fut.exception()
        fn()
    else:
        fut.add_done_callback(lambda f: (f.cancelled() or f.exception(), fn()))


def in_parts(n: int, block_bytes: int = 0, first_bytes: int = 0) -> bool:
    """A batch of n blocks goes in more than one part (parts() with the same arguments)."""
    return n > 2 * PIPELINE_BLOCKS or bool(block_bytes and first_bytes and n * block_bytes > first_bytes)


def parts(n: int, block_bytes: int = 0, first_bytes: int = 0, grow: int = 2) -> list[tuple[int, int]]:
    """The (lo, hi) parts a Store chunk or a Load of n blocks is planned and copied in. By bytes
    (block_bytes and first_bytes given, the batch larger than first_bytes): first_bytes of blocks
    first, each part `grow` times the one before, up to PIPELINE_BLOCKS. Otherwise by count: one part
    up to 2 x PIPELINE_BLOCKS; else min(PIPELINE_FIRST, PIPELINE_BLOCKS) blocks first, each part
    twice the one before up to PIPELINE_BLOCKS."""
    if block_bytes and first_bytes and n * block_bytes > first_bytes:
        first = max(1, first_bytes // block_bytes)
    elif n <= 2 * PIPELINE_BLOCKS:
        return [(0, n)]
    else:
        first, grow = PIPELINE_FIRST, 2
    out: list[tuple[int, int]] = []
    size, lo = min(first, PIPELINE_BLOCKS), 0
    while lo < n:
        hi = min(n, lo + size)
        out.append((lo, hi))
        lo, size = hi, min(grow * size, PIPELINE_BLOCKS)
    return out


def copy_call(memory: object, method: str, loop: asyncio.AbstractEventLoop, wanted: bool = True
              ) -> tuple[Callable, asyncio.Future | None]:
    """The copy job to run in a copy thread (memory.<method>: gather_into for a Store, scatter_from
    for a Load) and, when its ENQUEUE_FIRST flag is on, wanted and the memory signals it, a future of
    `loop` that completes once that copy is queued on the device: the caller awaits it (or the job's
    end) before its next bookkeeping."""
    fn = getattr(memory, method)
    on = ENQUEUE_FIRST if method == "gather_into" else LOAD_ENQUEUE_FIRST
    if not (on and wanted and getattr(memory, "SIGNALS_ENQUEUED", False)):
        return fn, None
    fut, signal = enqueued_signal(loop)
    return functools.partial(fn, enqueued=signal), fut


def enqueued_signal(loop: asyncio.AbstractEventLoop) -> tuple[asyncio.Future, Callable[[], None]]:
    """A future of `loop` and a callback any thread may call once to complete it (a no-op once the
    loop is closed: the copy it reports on must not fail for that)."""
    fut = loop.create_future()

    def done() -> None:
        if not fut.done():
            fut.set_result(None)

    def signal() -> None:
        try:
            loop.call_soon_threadsafe(done)
        except RuntimeError:  # the loop is closed
            pass
    return fut, signal


# A Store or Load whose caller passes an Answer (the frames channel) is answered as soon as every block
# has its final status, before the bookkeeping that cannot change it (a Store's commit, a Load's unpins
# and LRU refresh): the engine reads its reply while the daemon does that. KVTUNE_EARLY_ANSWER=0: answered
# after it, as the gRPC servicer does (an A/B).
EARLY_ANSWER = os.environ.get("KVTUNE_EARLY_ANSWER", "1") != "0"


class Answer:
    """A caller's hook, given to BlockCache.store / load: send(results) runs at most once, on the loop,
    from inside the call, once every block has its final status (no status byte 0). The core calls
    it only where nothing that follows in the call can change a status, and with no await between it
    and the call's return: a request that arrives once the answer is out (the engine's next one, on any
    connection) is served after the call's bookkeeping, so it sees what the answer says. The call
    still returns the same results; `sent` tells the caller whether it has been answered already.
    If send raises, nothing was sent: the exception goes up through the call as any other would."""

    __slots__ = ("_send", "sent")

    def __init__(self, send: Callable[[StoreResults | LoadResults], None]) -> None:
        self._send = send
        self.sent = False

    def __call__(self, results: StoreResults | LoadResults) -> None:
        if self.sent or not EARLY_ANSWER or 0 in results.status:
            return
        self._send(results)
        self.sent = True


def fail_unanswered(results: StoreResults | LoadResults, failed: int) -> None:
    """A block the call left without a status (a core bug) is reported failed, never as success."""
    if 0 in results.status:
        for i, st in enumerate(results.status):
            if st == 0:
                results.set(i, failed, message="internal error")
