"""Named ids, enums and per-block results shared by the daemon's core objects.

Ids are NewTypes so that `(slot, block)` cannot be swapped without a type checker noticing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple, NewType

BlockHash = NewType("BlockHash", bytes)  # 32-byte chained hash, opaque to the daemon
NamespaceId = NewType("NamespaceId", str)  # hex digest of the namespace tuple
BlockId = NewType("BlockId", int)  # index of a block in an engine's registered pool
SessionId = NewType("SessionId", str)

HASH_BYTES = 32


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
