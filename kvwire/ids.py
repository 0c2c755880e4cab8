"""Ids both sides of the protocol name: NewTypes, so that `(slot, block)` cannot be swapped without a
type checker noticing."""

from __future__ import annotations

from typing import NewType

BlockHash = NewType("BlockHash", bytes)  # 32-byte chained hash, opaque to the daemon
NamespaceId = NewType("NamespaceId", str)  # hex digest of the namespace tuple
BlockId = NewType("BlockId", int)  # index of a block in an engine's registered pool
SessionId = NewType("SessionId", str)

HASH_BYTES = 32
MAX_BLOCKS_PER_KEY = 16  # PoolDescription.blocks_per_key: a daemon block (key) of at most 16 engine blocks
