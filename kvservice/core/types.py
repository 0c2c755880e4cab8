"""Named ids, enums and per-block results shared by the daemon's core objects.

Ids are NewTypes so that `(slot, block)` cannot be swapped without a type checker noticing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from kvwire.ids import HASH_BYTES, BlockHash, BlockId, NamespaceId, SessionId  # noqa: F401 (re-exported)


class BlockKey(NamedTuple):
    """Where a block lives in the index: blocks are only ever shared inside a namespace.
    A NamedTuple, not a dataclass: millions are built and hashed on the Lookup path."""

    namespace: NamespaceId
    hash: BlockHash


class Tier(enum.IntEnum):
    """Values match kvservice.v1.Tier."""

    NONE = 0  # not stored
    GPU = 1  # the engine's own tier; the daemon never reports it
    HOST = 2  # daemon host memory
    DISK = 3  # daemon disk tier


class StoreStatus(enum.IntEnum):
    """Values match kvservice.v1.StoreStatus."""

    STORED = 1  # bytes copied out of the engine pool
    ALREADY_STORED = 2  # present already; touched (and retained if asked)
    STORED_NOT_RETAINED = 3  # stored, but the retained-bytes cap refused the TTL
    FAILED = 4  # see message
    NOT_STORED = 5  # no room for it right now


class LoadStatus(enum.IntEnum):
    """Values match kvservice.v1.LoadStatus."""

    LOADED = 1  # bytes are in the engine's pool
    MISSING = 2  # not stored
    FAILED = 3  # checksum mismatch or I/O error; the block was discarded


class PrefetchStatus(enum.IntEnum):
    """Values match kvservice.v1.PrefetchStatus."""

    STAGED = 1  # read from disk into the host tier, pinned by a lease
    ALREADY_IN_HOST = 2  # in the host tier already; lease taken
    NOT_FOUND = 3
    FAILED = 4


@dataclass(frozen=True, slots=True)
class StoreResult:
    status: StoreStatus
    deadline: float = 0.0  # unix seconds; 0 when not retained
    message: str = ""


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    status: PrefetchStatus
    message: str = ""  # why, for FAILED


@dataclass(frozen=True, slots=True)
class LoadResult:
    status: LoadStatus
    tier: Tier = Tier.NONE
    message: str = ""


class StoreResults:
    """A Store's per-block outcome as parallel arrays (what StoreReply carries): a status per block,
    a deadline per block (None: all 0), a message only for the blocks that have one. Indexing or
    iterating builds a StoreResult per block (tests, in-process callers); the servicer reads the arrays.
    The statuses are a bytearray (every StoreStatus is < 256; 0: not answered yet): a batch's whole-run
    answer is one slice of bytes, "is any block unanswered" one memchr, and the frames channel's
    reply field (one byte a status) one memcpy, where a list of 32768 IntEnums cost ~1 ms to turn
    into bytes on the GPU host's reply path."""

    __slots__ = ("status", "deadline", "messages")

    def __init__(self, n: int) -> None:
        self.status = bytearray(n)
        self.deadline: list[float] | None = None
        self.messages: dict[int, str] = {}

    def set(self, i: int, status: StoreStatus, deadline: float = 0.0, message: str = "") -> None:
        self.status[i] = status
        if deadline:
            if self.deadline is None:
                self.deadline = [0.0] * len(self.status)
            self.deadline[i] = deadline
        if message:
            self.messages[i] = message

    def merge(self, other: StoreResults, base: int) -> None:
        """other's outcomes as this one's from position base on (the rest of a batch stored apart)."""
        self.status[base:base + len(other.status)] = other.status
        if other.deadline is not None:
            if self.deadline is None:
                self.deadline = [0.0] * len(self.status)
            self.deadline[base:base + len(other.deadline)] = other.deadline
        for i, m in other.messages.items():
            self.messages[base + i] = m

    def __len__(self) -> int:
        return len(self.status)

    def __getitem__(self, i: int) -> StoreResult:
        return StoreResult(StoreStatus(self.status[i]), self.deadline[i] if self.deadline else 0.0,
                           self.messages.get(i, ""))

    def __iter__(self):
        return (self[i] for i in range(len(self.status)))


class LoadResults:
    """A Load's per-block outcome as parallel arrays (what LoadReply carries): status and source tier
    per block, a message only for the blocks that have one. Indexing builds a LoadResult. Both arrays
    are bytearrays, as StoreResults' statuses (every LoadStatus and Tier is < 256)."""

    __slots__ = ("status", "tier", "messages")

    def __init__(self, n: int) -> None:
        self.status = bytearray(n)
        self.tier = bytearray(n)
        self.messages: dict[int, str] = {}

    def set(self, i: int, status: LoadStatus, tier: Tier = Tier.NONE, message: str = "") -> None:
        self.status[i] = status
        self.tier[i] = tier
        if message:
            self.messages[i] = message

    def __len__(self) -> int:
        return len(self.status)

    def __getitem__(self, i: int) -> LoadResult:
        return LoadResult(LoadStatus(self.status[i]), Tier(self.tier[i]), self.messages.get(i, ""))

    def __iter__(self):
        return (self[i] for i in range(len(self.status)))


class ErrorCode(enum.Enum):
    """Request-level failures; the servicer maps each to the gRPC status of the same name."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"  # malformed input: bad id, hash length, name
    FAILED_PRECONDITION = "FAILED_PRECONDITION"  # e.g. hash canary differs from the namespace's
    NOT_FOUND = "NOT_FOUND"  # unknown or closed session
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"  # oversize batch, too many sessions
    PERMISSION_DENIED = "PERMISSION_DENIED"  # admin token missing or wrong
    UNAVAILABLE = "UNAVAILABLE"  # shutting down


class CacheError(Exception):
    """A request the core refuses as a whole; the message says what was wrong."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
