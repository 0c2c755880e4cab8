"""The daemon's asyncio face of the DiskStore: per-block awaitables, batched underneath.

Primitives (event loop thread):
  TierIO.open(config, durable) -> TierIO        blocking (run it in an executor): opens the store
  reserve(size) -> loc | None                   a slot for one spill, no I/O (reserve_many: a batch's)
  await write(loc, block, buf) -> DiskFault|None
  await read(loc, out) -> DiskFault|None
  write_many(locs, blocks, bufs) -> future of [DiskFault|None]   one store call, as given
  read_many(locs, outs) -> future of [DiskFault|None]            (the write queue's batches, a Load's disk blocks)
  free(loc) / free_many(locs) / set_deadline(loc, deadline) / cancel(loc)
  close()                                       blocking

Batching: every write (read) awaited in the same turn of the event loop joins one
DiskStore.write (read) call, run on the writer (reader) pool, so the concurrent spills of the
write queue's writers, or the disk blocks of one Load, become a few large requests instead of
one syscall per block. A caller cancelled while its write is in flight does not leak the slot:
a write that completes for nobody is freed again.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable
from concurrent.futures import Executor

from kvservice.checksum import Buffer
from kvservice.disk.batch_io import HostSlots
from kvservice.disk.store import BlockWrite, DiskFault, DiskStore
from kvservice.disk.io_backend import nbytes
from kvservice.disk.io_throttle import TokenBucket

_Pending = tuple[int, object, Buffer, asyncio.Future]
CANARY_ALLOWANCE = 256 << 10  # <disk_path>/<namespace>/canary files (4 KiB each on disk) of up to 64 namespaces


class TierIO:
    def __init__(self, store: DiskStore, writers: Executor, readers: Executor,
                 read_bucket: TokenBucket | None = None, write_bucket: TokenBucket | None = None) -> None:
        self.store = store
        self._writers, self._readers = writers, readers
        self._read_bucket, self._write_bucket = read_bucket, write_bucket  # disk_*_bytes_per_second caps
        self._writes: list[_Pending] = []
        self._reads: list[_Pending] = []
        direct = all(f.dfd is not None for f in store._files.values()) if store._files else store._direct
        self.name = "segments+O_DIRECT" if direct else "segments"

    @classmethod
    def open(cls, root: str, capacity: int, *, max_ttl_seconds: float, writers: Executor, readers: Executor,
             now: Callable[[], float], io_threads: int = 32, durable: bool = False,
             read_bytes_per_second: int = 0, write_bytes_per_second: int = 0) -> TierIO:
        store = DiskStore(root, capacity, max_ttl_seconds=max_ttl_seconds, now=now, io_threads=io_threads,
                          durable=durable, other_bytes=CANARY_ALLOWANCE)
        return cls(store, writers, readers,
                   TokenBucket(read_bytes_per_second) if read_bytes_per_second else None,
                   TokenBucket(write_bytes_per_second) if write_bytes_per_second else None)

    # --- no I/O
    def reserve(self, size: int) -> int | None:
        return self.store.reserve([size])[0]

    def reserve_many(self, sizes: list[int]) -> list[int | None]:
        return self.store.reserve(sizes)

    def cancel(self, loc: int) -> None:
        self.store.cancel([loc])

    def free(self, loc: int) -> None:
        self.store.free([loc])

    def free_many(self, locs: list[int]) -> None:
        self.store.free(locs)

    def set_deadline(self, loc: int, deadline: float) -> None:
        self.store.set_deadline(loc, deadline)

    # --- batched I/O
    def write(self, loc: int, block: BlockWrite, buf: Buffer) -> asyncio.Future:
        return self._join(self._writes, self._flush_writes, (loc, block, buf))

    def read(self, loc: int, out: Buffer) -> asyncio.Future:
        return self._join(self._reads, self._flush_reads, (loc, None, out))

    def write_many(self, locs: list[int], blocks: list[BlockWrite], bufs: list[Buffer]) -> asyncio.Future:
        """One DiskStore.write of a whole batch on the writer pool. The future is the executor's:
        cancelling an await of it (shield it) does not stop the write; settle in a done callback."""
        return asyncio.get_running_loop().run_in_executor(
            self._writers, _paced, self._write_bucket, self.store.write, locs, blocks, bufs)

    def read_many(self, locs: list[int], outs: list[Buffer], fanout: int = 0) -> asyncio.Future:
        """One coalesced DiskStore.read of a batch on the reader pool (see write_many); fanout:
        requests to split it into (0: the store's default)."""
        read = functools.partial(self.store.read, fanout=fanout) if fanout else self.store.read
        return asyncio.get_running_loop().run_in_executor(
            self._readers, _paced, self._read_bucket, read, locs, outs)

    def _join(self, pending: list[_Pending], flush, item) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if not pending:
            loop.call_soon(flush)
        pending.append((*item, fut))
        return fut

    def _flush_writes(self) -> None:
        batch, self._writes[:] = list(self._writes), []
        job = asyncio.get_running_loop().run_in_executor(
            self._writers, _paced, self._write_bucket, self.store.write,
            [b[0] for b in batch], [b[1] for b in batch], [b[2] for b in batch])
        job.add_done_callback(lambda j: self._settle(batch, j, written=True))

    def _flush_reads(self) -> None:
        batch, self._reads[:] = list(self._reads), []
        job = asyncio.get_running_loop().run_in_executor(
            self._readers, _paced, self._read_bucket, self.store.read, [b[0] for b in batch], [b[2] for b in batch])
        job.add_done_callback(lambda j: self._settle(batch, j, written=False))

    def _settle(self, batch: list[_Pending], job: asyncio.Future, *, written: bool) -> None:
        err = job.exception() if not job.cancelled() else asyncio.CancelledError()
        results: list[DiskFault | None] = job.result() if err is None else [None] * len(batch)
        orphans = []
        for (loc, _, _, fut), res in zip(batch, results):
            if fut.done():  # the caller was cancelled meanwhile
                if written and err is None and res is None:
                    orphans.append(loc)
                continue
            if err is not None:
                fut.set_exception(err)
            else:
                fut.set_result(res)
        if orphans:
            self.store.free(orphans)

    def close(self) -> None:
        self.store.close()


def _paced(bucket: TokenBucket | None, op, locs, *args):
    """op(locs, *args) on a worker thread, after the bandwidth cap has paid for its bytes."""
    if bucket is not None:
        bufs = args[-1]
        bucket.take(int(bufs.lengths.sum()) if isinstance(bufs, HostSlots) else sum(nbytes(b) for b in bufs))
    return op(locs, *args)


__all__ = ["BlockWrite", "DiskFault", "TierIO", "disk_capacity_for", "remove_v1_blocks"]


def disk_capacity_for(blocks: int, block_bytes: int) -> int:
    """The --disk-capacity whose tier holds `blocks` blocks of block_bytes in the daemon: their
    slots, each slot's metadata share and the fixed metadata reserve (WAL, schema, canaries)."""
    from kvservice.disk.slots import slot_class
    from kvservice.disk.store import META_PER_SLOT, metadata_fixed_bytes

    data = blocks * (slot_class(block_bytes) + META_PER_SLOT)
    cap = data
    for _ in range(4):  # the fixed part grows with the capacity (the WAL limit)
        cap = data + metadata_fixed_bytes(cap, CANARY_ALLOWANCE)
    return cap


def remove_v1_blocks(root: str) -> int:
    """Delete block files of the one-file-per-block format (<root>/<ns>/<xx>/*.kvb and their
    *.tmp), which the segments format neither reads nor counts; namespace canaries stay."""
    removed = 0
    if not os.path.isdir(root):
        return 0
    for ns in os.scandir(root):
        if not ns.is_dir(follow_symlinks=False):
            continue
        for shard in os.scandir(ns.path):
            if not (shard.is_dir(follow_symlinks=False) and len(shard.name) == 2):
                continue
            for f in os.scandir(shard.path):
                if f.name.endswith((".kvb", ".tmp")) and not f.is_dir(follow_symlinks=False):
                    os.unlink(f.path)
                    removed += 1
            try:
                os.rmdir(shard.path)
            except OSError:
                pass
    return removed
