"""BlockCache: the daemon's core object. The gRPC servicers are thin translations onto it.

Primitives (all per block, batched per call; the session must be open):
  open_session / heartbeat / close_session / reap_sessions   leases and pool mappings
  lookup(hashes) -> tiers of the stored prefix
  store(refs, ttl) -> StoreResult per block; returns once the bytes left the engine pool
  load(refs) -> LoadResult per block; returns once the bytes are in the engine pool
  prefetch(hashes) -> stage disk blocks into the host tier under a short pin lease
  retain(hashes, ttl) -> new deadline per block (deadlines only ever extend)
  evict(...) / stats() / namespaces() / sessions()           admin
Request-level errors raise CacheError(code, message); per-block outcomes are results.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvservice.clock import Clock
from kvservice.config import Config
from kvservice.sessions_api import NamespaceSpec, OpenedSession, PoolSpec, SessionInfo
from kvservice.stats import Counters, Histogram
from kvservice.types import BlockHash, BlockId, LoadResult, NamespaceId, PrefetchStatus, SessionId, StoreResult, Tier


class BlockCache:
    def __init__(self, config: Config, clock: Clock) -> None:
        raise NotImplementedError

    # --- lifecycle
    async def start(self) -> None:
        """Open the I/O backend, recover the disk tier, start the writer pool."""
        raise NotImplementedError

    async def drain_and_stop(self) -> None:
        """Finish every queued disk write, close sessions and mappings. Used on SIGTERM."""
        raise NotImplementedError

    @property
    def io_backend_name(self) -> str:
        raise NotImplementedError

    # --- sessions
    def open_session(self, ns: NamespaceSpec, pool: PoolSpec, canary: bytes, client_name: str) -> OpenedSession:
        raise NotImplementedError

    def heartbeat(self, session_id: SessionId) -> float:
        raise NotImplementedError

    def close_session(self, session_id: SessionId) -> None:
        raise NotImplementedError

    def reap_sessions(self) -> list[SessionId]:
        """Close sessions whose lease ran out and expire prefetch pins; call about once a second."""
        raise NotImplementedError

    # --- data
    def lookup(self, session_id: SessionId, hashes: Sequence[bytes]) -> list[Tier]:
        raise NotImplementedError

    async def store(self, session_id: SessionId, refs: Sequence[tuple[bytes, int]], ttl_seconds: float) -> list[StoreResult]:
        raise NotImplementedError

    async def load(self, session_id: SessionId, refs: Sequence[tuple[bytes, int]]) -> list[LoadResult]:
        raise NotImplementedError

    async def prefetch(self, session_id: SessionId, hashes: Sequence[bytes]) -> list[PrefetchStatus]:
        raise NotImplementedError

    def retain(self, session_id: SessionId, hashes: Sequence[bytes], ttl_seconds: float) -> list[float]:
        raise NotImplementedError

    # --- admin
    async def evict(self, *, namespace: NamespaceId | None = None, expired: bool = False, all: bool = False) -> int:
        raise NotImplementedError

    def sessions(self) -> list[SessionInfo]:
        raise NotImplementedError

    def namespace_stats(self) -> list[dict]:
        """One dict per namespace: namespace_id, model_id, tp_rank, tp_size, block_bytes, host_blocks,
        host_bytes, disk_blocks, disk_bytes, retained_bytes, retained_cap_bytes, sessions, counters (Counters)."""
        raise NotImplementedError

    def tier_stats(self) -> list[dict]:
        """One dict per tier: name, capacity_bytes, used_bytes, blocks, pinned_blocks, retained_blocks."""
        raise NotImplementedError

    @property
    def counters(self) -> Counters:
        raise NotImplementedError

    @property
    def latencies(self) -> list[Histogram]:
        raise NotImplementedError

    def queue_depths(self) -> dict[str, int]:
        """write_queue_depth, write_queue_capacity, read_queue_depth."""
        raise NotImplementedError
