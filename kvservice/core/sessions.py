"""Sessions: one per engine registration, bound to the peer the kernel named, kept alive by a lease.

A session owns its pool mapping and its prefetch leases. It is opened on the registration
socket, so the kernel tells the daemon who opened it (SO_PEERCRED: uid, gid, pid); the session
records that peer and the data listener that serves its uid, and its calls are refused on any
other listener. Its id is a secret handed to that peer only; logs and ListSessions name it by a
short label instead. When its lease runs out (the engine died or hung) or its registration
connection closes, the cache closes it: the mapping is released, in-flight work cancelled, and
what it pinned unpinned. Stored blocks stay; they belong to the namespace. `now` is passed in.
"""

from __future__ import annotations

import secrets
from collections import Counter
from dataclasses import dataclass

from kvservice.memory.engine_memory import EngineMemory
from kvservice.core.sessions_api import Peer, PoolSpec
from kvservice.core.types import CacheError, ErrorCode, NamespaceId, SessionId


@dataclass(slots=True, eq=False)
class Session:
    id: SessionId
    label: str  # non-secret: what logs and ListSessions show
    namespace: NamespaceId
    pool: PoolSpec
    memory: EngineMemory
    client_name: str
    peer: Peer
    canary: bytes  # what this session's engine hashes the canary to (fixes the namespace's once it stores)
    opened_at: float
    lease_until: float  # its prefetch leases are in lifecycle.LeaseBook, by session id

    @property
    def block_bytes(self) -> int:
        """Bytes of one of this session's daemon blocks (blocks_per_key engine blocks)."""
        return self.pool.key_bytes


class SessionTable:
    def __init__(self, lease_seconds: float, max_sessions: int, max_sessions_per_uid: int = 0) -> None:
        self.lease_seconds = lease_seconds
        self.max_sessions = max_sessions
        self.max_sessions_per_uid = max_sessions_per_uid or max_sessions
        self._by_id: dict[SessionId, Session] = {}
        self._per_uid: Counter[int] = Counter()
        self._opened = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def all(self) -> list[Session]:
        return list(self._by_id.values())

    def check_room(self, uid: int) -> None:
        if len(self._by_id) >= self.max_sessions:
            raise CacheError(ErrorCode.RESOURCE_EXHAUSTED, f"too many sessions (max_sessions = {self.max_sessions})")
        if self._per_uid[uid] >= self.max_sessions_per_uid:
            raise CacheError(ErrorCode.RESOURCE_EXHAUSTED,
                             f"uid {uid} has {self._per_uid[uid]} open sessions "
                             f"(max_sessions_per_uid = {self.max_sessions_per_uid})")

    def open(self, namespace: NamespaceId, pool: PoolSpec, memory: EngineMemory, client_name: str, peer: Peer,
             canary: bytes, now: float) -> Session:
        self.check_room(peer.uid)
        sid = SessionId(secrets.token_hex(16))
        self._opened += 1
        s = Session(sid, f"s{self._opened}", namespace, pool, memory, client_name, peer, canary, now,
                    now + self.lease_seconds)
        self._by_id[sid] = s
        self._per_uid[peer.uid] += 1
        return s

    def find(self, session_id: str) -> Session | None:
        return self._by_id.get(SessionId(session_id))

    def get(self, session_id: str) -> Session:
        s = self._by_id.get(SessionId(session_id))
        if s is None:
            # the id is a secret and may be anything a client sent: never echo it back
            raise CacheError(ErrorCode.NOT_FOUND,
                             f"unknown or closed session (an id of {len(session_id)} characters); open a new one")
        return s

    def heartbeat(self, session_id: str, now: float) -> Session:
        s = self.get(session_id)
        s.lease_until = now + self.lease_seconds
        return s

    def remove(self, session_id: str) -> Session | None:
        s = self._by_id.pop(SessionId(session_id), None)
        if s is not None:
            self._per_uid[s.peer.uid] -= 1
            if not self._per_uid[s.peer.uid]:
                del self._per_uid[s.peer.uid]
        return s

    def expired(self, now: float) -> list[Session]:
        return [s for s in self._by_id.values() if s.lease_until <= now]
