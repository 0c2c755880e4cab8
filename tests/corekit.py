"""Small helpers for tests that drive BlockCache directly (no gRPC): a shared-memory pool,
random block contents and a started cache with a FakeClock."""

from __future__ import annotations

import hashlib
import os
from contextlib import asynccontextmanager
from dataclasses import replace
from multiprocessing import shared_memory

from kvservice.core.cache import BlockCache
from kvservice.core.clock import FakeClock
from kvservice.ops.config import Config
from kvservice.disk.tier_io import disk_capacity_for
from kvservice.core.sessions_api import NamespaceSpec, PoolRegion, PoolSpec
from harness.blocks import BLOCK, content, h  # noqa: F401  (re-exported for the tests)

CANARY = hashlib.blake2b(b"test-canary", digest_size=32).digest()


def ns_spec(model: str = "m", rank: int = 0, size: int = 1) -> NamespaceSpec:
    return NamespaceSpec(model, "float32", 16, "block-contiguous", rank, size, "")


class Pool:
    """An engine pool in POSIX shared memory, block-contiguous."""

    def __init__(self, num_blocks: int = 16, block_bytes: int = BLOCK, blocks_per_key: int = 1) -> None:
        self.num_blocks, self.block_bytes, self.blocks_per_key = num_blocks, block_bytes, blocks_per_key
        self.shm = shared_memory.SharedMemory(create=True, size=num_blocks * block_bytes)

    @property
    def spec(self) -> PoolSpec:
        """What the registration socket would build: the layout and a new descriptor of the segment
        (the cache consumes it), as an engine passes it with SCM_RIGHTS."""
        n, bb = self.num_blocks, self.block_bytes
        return PoolSpec("shm", n, (PoolRegion(0, bb, bb),), n * bb, shm_fd=os.dup(self.shm._fd),
                        blocks_per_key=self.blocks_per_key)

    def write(self, block_id: int, data: bytes) -> None:
        self.shm.buf[block_id * self.block_bytes:(block_id + 1) * self.block_bytes] = data

    def read(self, block_id: int) -> bytes:
        return bytes(self.shm.buf[block_id * self.block_bytes:(block_id + 1) * self.block_bytes])

    def close(self) -> None:
        self.shm.close()
        self.shm.unlink()


def small_config(tmp_path, disk_blocks: int = 8, **kw) -> Config:
    """Host tier of 4 blocks; a disk tier that holds `disk_blocks` blocks of BLOCK bytes (0: none),
    its metadata reserve included (disk tier v2 counts it in the capacity)."""
    base = Config(socket_path=str(tmp_path / "kv.sock"), host_capacity_bytes=4 * BLOCK,
                  disk_path=str(tmp_path / "disk"),
                  disk_capacity_bytes=disk_capacity_for(disk_blocks, BLOCK) if disk_blocks else 0,
                  writer_threads=2, reader_threads=2, io_backend="posix")
    return replace(base, **kw)


@asynccontextmanager
async def started_cache(config: Config, clock: FakeClock | None = None, io=None):
    if config.disk_path:
        os.makedirs(config.disk_path, exist_ok=True)
    cache = BlockCache(config, clock or FakeClock(), io=io)
    await cache.start()
    try:
        yield cache
    finally:
        await cache.drain_and_stop()


@asynccontextmanager
async def engine_on(cache: BlockCache, num_blocks: int = 16):
    """An Engine on a fresh Pool of `num_blocks`; afterwards its session is closed and the pool unlinked."""
    pool = Pool(num_blocks=num_blocks)
    eng = Engine(cache, pool)
    try:
        yield eng
    finally:
        await cache.close_session(eng.sid)
        pool.close()


class Engine:
    """One session on a cache, with helpers that store/load numbered blocks."""

    def __init__(self, cache: BlockCache, pool: Pool, ns=None) -> None:
        self.cache, self.pool = cache, pool
        self.sid = cache.open_session(ns or ns_spec(), pool.spec, CANARY, "test").session_id

    async def store(self, numbers: list[int], ttl: float = 0.0):
        for slot, i in enumerate(numbers):
            self.pool.write(slot, content(i, self.pool.block_bytes))
        return await self.cache.store(self.sid, [h(i) for i in numbers], list(range(len(numbers))), ttl)

    async def load(self, numbers: list[int]):
        """Load into fresh slots (zeroed first) and check bytes; returns results."""
        base = self.pool.num_blocks // 2
        for k in range(len(numbers)):
            self.pool.write(base + k, bytes(self.pool.block_bytes))
        res = await self.cache.load(self.sid, [h(i) for i in numbers], [base + k for k in range(len(numbers))])
        for k, (i, r) in enumerate(zip(numbers, res)):
            if r.status == 1:  # LOADED: bytes must be exact
                assert self.pool.read(base + k) == content(i, self.pool.block_bytes), f"wrong bytes for block {i}"
        return res
