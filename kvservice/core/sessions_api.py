"""Plain descriptions of what a session registers; the servicer builds them from protobuf."""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvservice.core.types import NamespaceId, SessionId

MAIN_LISTENER = "main"  # the data listener of the daemon's own uid (and root): socket_path itself


@dataclass(frozen=True, slots=True)
class Peer:
    """The process that registered a session, as the kernel named it (SO_PEERCRED), and the data
    listener (Unix socket) whose callers are that uid: the only one the session's calls may use."""

    uid: int
    gid: int
    pid: int
    listener: str = MAIN_LISTENER

    @classmethod
    def this_process(cls) -> Peer:
        """The daemon itself: in-process callers (tests, benchmarks) that hand the cache a pool."""
        return cls(os.getuid(), os.getgid(), os.getpid())


@dataclass(frozen=True, slots=True)
class NamespaceSpec:
    """The tuple that decides whether two engines' KV bytes mean the same thing."""

    model_id: str
    kv_dtype: str
    tokens_per_block: int
    layout: str
    tp_rank: int
    tp_size: int
    cache_salt: str = ""


@dataclass(frozen=True, slots=True)
class PoolRegion:
    offset: int
    block_stride: int
    block_bytes: int


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """An engine's KV pool: block b of region r is at regions[r].offset + b * block_stride."""

    kind: str  # "shm" | "cuda"
    num_blocks: int
    regions: tuple[PoolRegion, ...]
    size: int  # bytes of the whole allocation
    shm_fd: int = -1  # the daemon's descriptor of the segment, received from the peer (SCM_RIGHTS); consumed
    cuda_handle: bytes = b""
    cuda_device_index: int = -1
    cuda_device_uuid: str = ""
    cuda_event_handle: bytes = b""
    blocks_per_key: int = 1  # engine blocks per daemon block (PoolDescription.blocks_per_key)

    @property
    def block_bytes(self) -> int:
        """Bytes of one engine block (the sum of its rows in every region)."""
        return sum(r.block_bytes for r in self.regions)

    @property
    def key_bytes(self) -> int:
        """Bytes of one daemon block of this pool: blocks_per_key engine blocks, back to back."""
        return self.block_bytes * self.blocks_per_key


@dataclass(frozen=True, slots=True)
class SessionInfo:
    label: str
    namespace_id: NamespaceId
    client_name: str
    pool_kind: str
    pool_blocks: int
    opened_at: float
    lease_expires_in: float
    pinned_blocks: int
    uid: int
    pid: int
    blocks_per_key: int = 1


@dataclass(frozen=True, slots=True)
class OpenedSession:
    session_id: SessionId
    namespace_id: NamespaceId
    lease_seconds: float
    max_batch_blocks: int
    block_bytes: int
    label: str = ""
