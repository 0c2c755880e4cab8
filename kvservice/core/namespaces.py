"""Namespaces: the id of a namespace tuple, and the hash canary each namespace is held to.

The first session of a namespace that stores a block fixes its canary (persisted under the
disk path, so a restart keeps it); a later client whose canary differs hashes tokens differently
and would silently get 0% hits, so it is refused. Opening a session fixes nothing: a probe with
a bogus canary that never stores cannot lock a namespace. An operator can reset a canary
(Admin.ResetCanary) when a wrong one got fixed anyway.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass

from kvservice.ops.quoting import quoted
from kvservice.core.sessions_api import NamespaceSpec, PoolSpec
from kvservice.core.types import HASH_BYTES, CacheError, ErrorCode, NamespaceId

NAMESPACE_ID_RE = re.compile(r"[0-9a-f]{32}")


def namespace_id(ns: NamespaceSpec, pool: PoolSpec, tenant: str = "") -> NamespaceId:
    """Blocks mean the same bytes only for the same tuple and the same block byte layout. `tenant`
    scopes the namespace to a uid other than the daemon's (and root's), so uids never share blocks:
    another tenant cannot probe which prompts this one has seen. "" keeps the ids of earlier runs."""
    h = hashlib.blake2b(digest_size=16)
    parts = [ns.model_id, ns.kv_dtype, str(ns.tokens_per_block), ns.layout, str(ns.tp_rank), str(ns.tp_size),
             ns.cache_salt, ",".join(str(r.block_bytes) for r in pool.regions)]
    if pool.blocks_per_key > 1:  # a key of k engine blocks is other bytes than one block (1: the ids of before)
        parts.append(f"blocks_per_key={pool.blocks_per_key}")
    for part in parts + ([f"tenant={tenant}"] if tenant else []):
        b = part.encode()
        h.update(len(b).to_bytes(4, "little") + b)
    return NamespaceId(h.hexdigest())


def validate_namespace(ns: NamespaceSpec) -> None:
    def bad(field: str, why: str) -> CacheError:
        return CacheError(ErrorCode.INVALID_ARGUMENT, f"namespace.{field}: {why}")

    if not ns.model_id or len(ns.model_id) > 256:
        raise bad("model_id", "must be 1..256 characters")
    if ns.tokens_per_block <= 0:
        raise bad("tokens_per_block", "must be > 0")
    if ns.tp_size <= 0:
        raise bad("tp_size", "must be > 0")
    if ns.tp_rank >= ns.tp_size:
        raise bad("tp_rank", f"must be < tp_size ({ns.tp_size}), got {ns.tp_rank}")
    for field in ("kv_dtype", "layout", "cache_salt"):
        if len(getattr(ns, field)) > 256:
            raise bad(field, "longer than 256 characters")


@dataclass(slots=True)
class NamespaceRecord:
    id: NamespaceId
    spec: NamespaceSpec | None  # None for namespaces known only from disk until a client opens one
    block_bytes: int
    canary: bytes | None  # None until a session of the namespace stores a block


class NamespaceRegistry:
    def __init__(self, disk_root: str = "") -> None:
        self._root = disk_root
        self.records: dict[NamespaceId, NamespaceRecord] = {}

    def _canary_path(self, ns_id: NamespaceId) -> str:
        return os.path.join(self._root, ns_id, "canary")

    def admit(self, ns: NamespaceSpec, pool: PoolSpec, canary: bytes, tenant: str = "") -> NamespaceRecord:
        """The namespace's record, creating it if new; refuses a canary that differs from a fixed one."""
        validate_namespace(ns)
        if len(canary) != HASH_BYTES:
            raise CacheError(ErrorCode.INVALID_ARGUMENT, f"hash_canary must be {HASH_BYTES} bytes, got {len(canary)}")
        ns_id = namespace_id(ns, pool, tenant)
        rec = self.records.get(ns_id)
        if rec is None:
            rec = NamespaceRecord(ns_id, ns, pool.key_bytes, self._load_canary(ns_id))
            self.records[ns_id] = rec
        rec.spec = rec.spec or ns
        self.check_canary(ns_id, canary)
        return rec

    def check_canary(self, ns_id: NamespaceId, canary: bytes) -> None:
        rec = self.records.get(ns_id)
        if rec is None or rec.canary is None or rec.canary == canary:
            return
        model = quoted(rec.spec.model_id) if rec.spec else "?"
        raise CacheError(
            ErrorCode.FAILED_PRECONDITION,
            f"hash canary differs from namespace {ns_id}'s (model {model}): the hash functions differ "
            "(engine_client version, hash algorithm or token encoding), so this client would never hit "
            "blocks stored by the others; refusing the session (an operator can reset the canary with "
            "Admin.ResetCanary)",
        )

    def fix_canary(self, ns_id: NamespaceId, canary: bytes) -> bool:
        """Called after a session stored a block: fixes the canary if none is. True if it fixed it."""
        rec = self.records.get(ns_id)
        if rec is None or rec.canary is not None:
            return False
        rec.canary = canary
        self._save_canary(ns_id, canary)
        return True

    def reset_canary(self, ns_id: NamespaceId) -> bool:
        """Forget the namespace's canary, in memory and on disk. True if one was fixed."""
        if not NAMESPACE_ID_RE.fullmatch(ns_id):
            raise CacheError(ErrorCode.INVALID_ARGUMENT,
                             f"namespace_id {quoted(ns_id)} is not a namespace id (32 hex digits, as ListNamespaces shows)")
        rec = self.records.get(ns_id)
        had = rec is not None and rec.canary is not None
        if rec is not None:
            rec.canary = None
        if self._root:
            try:
                os.unlink(self._canary_path(ns_id))
                had = True
            except FileNotFoundError:
                pass
        return had

    def known_from_disk(self, ns_id: NamespaceId, block_bytes: int) -> None:
        if ns_id not in self.records:
            canary = self._load_canary(ns_id)
            if canary is not None:
                self.records[ns_id] = NamespaceRecord(ns_id, None, block_bytes, canary)

    def _load_canary(self, ns_id: NamespaceId) -> bytes | None:
        if not self._root:
            return None
        try:
            with open(self._canary_path(ns_id), "rb") as f:
                data = f.read()
            return data if len(data) == HASH_BYTES else None
        except OSError:
            return None

    def _save_canary(self, ns_id: NamespaceId, canary: bytes) -> None:
        if not self._root:
            return
        path = self._canary_path(ns_id)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(canary)
        os.replace(tmp, path)
