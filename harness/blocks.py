"""Block numbers every process agrees on: block i has content(i) and hash h(i), so a test, an
engine process and a benchmark can check any loaded byte without sharing state."""

from __future__ import annotations

import hashlib

BLOCK = 4096


def content(i: int, size: int = BLOCK) -> bytes:
    """Deterministic, distinct bytes for block number i."""
    seed = hashlib.blake2b(i.to_bytes(8, "little"), digest_size=64).digest()
    return (seed * (size // 64 + 1))[:size]


def h(i: int, ns: str = "") -> bytes:
    return hashlib.blake2b(f"{ns}/{i}".encode(), digest_size=32).digest()
