"""Sessions: one per engine connection, each with a lease kept alive by heartbeats.

A session owns its pool mapping and its prefetch leases. When its lease runs out (the engine
died or hung) the cache closes it: the mapping is released, in-flight work cancelled, and
what it pinned unpinned. Stored blocks stay; they belong to the namespace. `now` is passed in.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from kvservice.engine_memory import EngineMemory
from kvservice.sessions_api import PoolSpec
from kvservice.types import BlockKey, CacheError, ErrorCode, NamespaceId, SessionId


@dataclass(slots=True, eq=False)
class Session:
    id: SessionId
    namespace: NamespaceId
    pool: PoolSpec
    memory: EngineMemory
    client_name: str
    opened_at: float
    lease_until: float
    leased: set[BlockKey] = field(default_factory=set)  # prefetch leases it holds

    @property
    def block_bytes(self) -> int:
        return self.pool.block_bytes


class SessionTable:
    def __init__(self, lease_seconds: float, max_sessions: int) -> None:
        self.lease_seconds = lease_seconds
        self.max_sessions = max_sessions
        self._by_id: dict[SessionId, Session] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def all(self) -> list[Session]:
        return list(self._by_id.values())

    def check_room(self) -> None:
        if len(self._by_id) >= self.max_sessions:
            raise CacheError(ErrorCode.RESOURCE_EXHAUSTED, f"too many sessions (max_sessions = {self.max_sessions})")

    def open(self, namespace: NamespaceId, pool: PoolSpec, memory: EngineMemory, client_name: str, now: float) -> Session:
        self.check_room()
        sid = SessionId(secrets.token_hex(16))
        s = Session(sid, namespace, pool, memory, client_name, now, now + self.lease_seconds)
        self._by_id[sid] = s
        return s

    def get(self, session_id: str) -> Session:
        s = self._by_id.get(SessionId(session_id))
        if s is None:
            raise CacheError(ErrorCode.NOT_FOUND, f"unknown or closed session {session_id!r}; open a new one")
        return s

    def heartbeat(self, session_id: str, now: float) -> Session:
        s = self.get(session_id)
        s.lease_until = now + self.lease_seconds
        return s

    def remove(self, session_id: str) -> Session | None:
        return self._by_id.pop(SessionId(session_id), None)

    def expired(self, now: float) -> list[Session]:
        return [s for s in self._by_id.values() if s.lease_until <= now]
