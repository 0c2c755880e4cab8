"""Namespace: the tuple that decides whether two engines' KV bytes mean the same thing.

Blocks are shared only inside a namespace. The namespace is also the root of every block-hash
chain (see `hashing.py`), so its byte encoding is part of the wire contract: `canonical_bytes()`
is versioned and must never change for a given version.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvwire.v1 import kvcache_pb2

CANONICAL_VERSION = 1  # bump (and keep the old encoder) if the encoding below ever changes

_U32_MAX = 2**32 - 1


@dataclass(frozen=True, slots=True)
class Namespace:
    """(model id, KV dtype, tokens per block, block byte layout, TP rank/size, cache salt).

    Two engines share blocks iff every field is equal. `cache_salt` scopes the cache further
    (a LoRA adapter, a tenant); empty means none. Fields are validated on construction:
    strings other than the salt are non-empty, ints fit the proto's uint32, tp_rank < tp_size.
    """

    model_id: str
    kv_dtype: str
    tokens_per_block: int
    layout: str
    tp_rank: int = 0
    tp_size: int = 1
    cache_salt: str = ""

    def __post_init__(self) -> None:
        for name in ("model_id", "kv_dtype", "layout", "cache_salt"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(f"Namespace.{name} must be a str, got {type(value).__name__}")
            if not value and name != "cache_salt":
                raise ValueError(f"Namespace.{name} must not be empty")
        for name in ("tokens_per_block", "tp_rank", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"Namespace.{name} must be an int, got {type(value).__name__}")
            if not 0 <= value <= _U32_MAX:
                raise ValueError(f"Namespace.{name}={value} is outside [0, 2**32)")
        if self.tokens_per_block < 1:
            raise ValueError("Namespace.tokens_per_block must be >= 1")
        if self.tp_size < 1:
            raise ValueError("Namespace.tp_size must be >= 1")
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"Namespace.tp_rank={self.tp_rank} must be < tp_size={self.tp_size}")

    def to_proto(self) -> kvcache_pb2.Namespace:
        return kvcache_pb2.Namespace(
            model_id=self.model_id,
            kv_dtype=self.kv_dtype,
            tokens_per_block=self.tokens_per_block,
            layout=self.layout,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            cache_salt=self.cache_salt,
        )

    @classmethod
    def from_proto(cls, msg: kvcache_pb2.Namespace) -> Namespace:
        return cls(
            model_id=msg.model_id,
            kv_dtype=msg.kv_dtype,
            tokens_per_block=msg.tokens_per_block,
            layout=msg.layout,
            tp_rank=msg.tp_rank,
            tp_size=msg.tp_size,
            cache_salt=msg.cache_salt,
        )

    def canonical_bytes(self) -> bytes:
        """Unambiguous, versioned encoding of every field, in declaration order.

        u16 version, then each str as u32 byte length + UTF-8 and each int as u32, all
        little-endian. Length prefixes make ("ab", "c") and ("a", "bc") encode differently.
        """
        parts = [struct.pack("<H", CANONICAL_VERSION)]
        parts.append(_str(self.model_id))
        parts.append(_str(self.kv_dtype))
        parts.append(struct.pack("<I", self.tokens_per_block))
        parts.append(_str(self.layout))
        parts.append(struct.pack("<II", self.tp_rank, self.tp_size))
        parts.append(_str(self.cache_salt))
        return b"".join(parts)


def _str(value: str) -> bytes:
    data = value.encode("utf-8")
    return struct.pack("<I", len(data)) + data
