"""Block hashes: chained, cryptographic, identical in every process and on every machine.

    root = blake2b(b"kvservice.v1/root" + namespace.canonical_bytes(), digest_size=32)
    h_i  = blake2b(h_{i-1} + tokens of block i as little-endian int64, digest_size=32)

A hash therefore names a whole prefix (every earlier token and the namespace), not just one
block's tokens. Only full blocks are hashed; a trailing partial block has no hash. Python's
`hash()` is never used: it is salted per process, and a collision would hand one tenant
another tenant's KV.

The hash canary (`BlockHasher.canary()`) is the chain hash of the fixed `CANARY_TOKENS`; the
daemon rejects a client whose canary differs from the one its namespace was first opened with,
so two builds that hash differently fail loudly instead of silently getting 0% hits.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterable

from engine_client.namespace import Namespace
from kvwire.ids import HASH_BYTES, BlockHash

__all__ = ["HASH_BYTES", "CANARY_TOKENS", "ROOT_DOMAIN", "BlockHasher"]

ROOT_DOMAIN = b"kvservice.v1/root"

# 256 = 4 * 64 token ids from a fixed quadratic sequence: t_i = (31*i*i + 7*i + 3) mod 32000.
# The values need not be meaningful tokens; they only have to be the same everywhere, and
# below 32000 so they are valid ids of any real vocabulary.
CANARY_TOKENS: tuple[int, ...] = tuple((31 * i * i + 7 * i + 3) % 32000 for i in range(256))

_INT64_BYTES = 8


class BlockHasher:
    """Hashes token sequences into the block-hash chain of one namespace."""

    __slots__ = ("namespace", "tokens_per_block", "root", "_block_nbytes")

    def __init__(self, namespace: Namespace) -> None:
        self.namespace = namespace
        self.tokens_per_block = namespace.tokens_per_block
        self.root: bytes = hashlib.blake2b(ROOT_DOMAIN + namespace.canonical_bytes(), digest_size=HASH_BYTES).digest()
        self._block_nbytes = self.tokens_per_block * _INT64_BYTES

    def hash_blocks(self, token_ids: Iterable[int], parent: bytes | None = None) -> list[BlockHash]:
        """Hashes of the full blocks of `token_ids`, head first.

        `parent` continues a chain: the hash of the block just before `token_ids[0]` (None: the
        namespace root, i.e. `token_ids` starts the sequence). So for a whole number of blocks
        `a`, hash_blocks(a + b) == hash_blocks(a) + hash_blocks(b, parent=hash_blocks(a)[-1]).
        Accepts any iterable of ints, including numpy arrays and torch tensors; token ids must
        fit in int64 (OverflowError otherwise).
        """
        if parent is None:
            prev = self.root
        elif len(parent) != HASH_BYTES:
            raise ValueError(f"parent hash is {len(parent)} bytes, expected {HASH_BYTES}")
        else:
            prev = bytes(parent)
        data = _int64_le(token_ids)
        n_blocks = len(data) // self._block_nbytes
        step = self._block_nbytes
        out: list[BlockHash] = []
        blake2b = hashlib.blake2b
        for i in range(n_blocks):
            h = blake2b(prev, digest_size=HASH_BYTES)
            h.update(data[i * step : (i + 1) * step])
            prev = h.digest()
            out.append(BlockHash(prev))
        return out

    def canary(self) -> bytes:
        """Last hash of `CANARY_TOKENS`, cycled or truncated to whole blocks of this namespace.

        With tokens_per_block <= 256 that is the first 256 // tokens_per_block blocks of the
        canary; with larger blocks, one block of the canary repeated to fill it.
        """
        n_blocks = max(1, len(CANARY_TOKENS) // self.tokens_per_block)
        needed = n_blocks * self.tokens_per_block
        repeats = -(-needed // len(CANARY_TOKENS))
        tokens = (CANARY_TOKENS * repeats)[:needed]
        return bytes(self.hash_blocks(tokens)[-1])


def _int64_le(token_ids: Iterable[int]) -> memoryview:
    """Token ids as a little-endian int64 byte view (one C-level conversion, no per-token Python)."""
    if not isinstance(token_ids, (list, tuple, array)) and hasattr(token_ids, "tolist"):
        token_ids = token_ids.tolist()  # numpy / torch: one C call instead of per-element iteration
    arr = array("q", token_ids)
    if sys.byteorder == "big":
        arr.byteswap()
    return memoryview(arr).cast("B")
