"""Keys of k engine blocks: a pool registered with blocks_per_key = k, seen by the core in daemon blocks.

An engine whose blocks are small (16 tokens of a small model, or one rank's share at high tensor
parallelism: 64 KiB) pays the daemon's per-block bookkeeping (index entry, slot, LRU place,
checksum, pins) per 64 KiB; vLLM's offloading connector (offloaded block size = a multiple of the
GPU block size) and LMCache (256-token chunks) key such caches coarser for that reason. With
blocks_per_key = k the engine hashes its chains in groups of k blocks and names k block ids per
hash; the daemon keeps a group as one block of k x block_bytes: one entry, one slot, one CRC32C.

  KeyIds(rows)                    a batch's engine ids as a [n, k] array that reads as n keys
  KeyGroupMemory(inner, k)        the EngineMemory protocol in keys, over the pool's own memory:
    gather_into / scatter_from    one copy of the n x k blocks, slot offsets spread to the k parts of
                                  each key's slot (so runs of adjacent slots stay runs); a key's
                                  CRC32C is folded from its blocks' (checksum.concat_checksums)
    alloc_host / scatter          host rows of a key's bytes (disk reads), scattered as k blocks

Nothing on the daemon's hot paths is per engine block but the copy itself: the core sees keys.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from kvservice.checksum import concat_checksums, concat_tables
from kvservice.memory.engine_pool import EngineMemory
from kvservice.memory.host_arena import HostArena


class KeyIds:
    """Engine block ids of n keys of k blocks each, as a [n, k] int64 array: len() is n, a slice is the
    KeyIds of those keys (a view), an index is that key's ids as a tuple. What the core slices and
    passes around where a pool of one block a key has a list of ints."""

    __slots__ = ("rows",)

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return self.rows.shape[0]

    def __bool__(self) -> bool:
        return self.rows.shape[0] > 0

    def __getitem__(self, i: int | slice) -> KeyIds | tuple[int, ...]:
        if isinstance(i, slice):
            return KeyIds(self.rows[i])
        return tuple(self.rows[i].tolist())

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        return map(tuple, self.rows.tolist())

    def __repr__(self) -> str:
        return f"KeyIds({self.rows.tolist()!r})"


def flat_ids(keys: KeyIds | Sequence[Sequence[int]], k: int) -> np.ndarray:
    """The engine block ids of keys (KeyIds, or any sequence of k-id keys the core picked out of
    one), key by key, as one int64 array of k x len(keys)."""
    if isinstance(keys, KeyIds):
        return keys.rows.reshape(-1)
    return np.asarray(keys, dtype=np.int64).reshape(-1) if len(keys) else np.zeros(0, dtype=np.int64)


class KeyGroupMemory:
    """An engine pool's memory in keys of k blocks (blocks_per_key): the calls the core makes on a
    session's memory (copies both ways, host rows for disk reads), for such a session. Block ids are
    per key (KeyIds or k-tuples), slot offsets are the keys' slots of k x the pool's block bytes,
    checksums are of a key's bytes as the slot holds them."""

    def __init__(self, inner: EngineMemory, k: int) -> None:
        self.inner = inner
        self.k = k
        self.part_bytes = inner.block_bytes
        self.block_bytes = inner.block_bytes * k
        self.num_blocks = inner.num_blocks
        self.SIGNALS_ENQUEUED = getattr(inner, "SIGNALS_ENQUEUED", False)
        self._parts = np.arange(k, dtype=np.int64) * self.part_bytes  # a key's parts inside its slot
        concat_tables(self.part_bytes, k)  # built at registration: not in the first Store's copy

    def _part_offsets(self, offsets: Sequence[int]) -> np.ndarray:
        return (np.asarray(offsets, dtype=np.int64)[:, None] + self._parts).reshape(-1)

    def gather_into(self, block_ids: KeyIds | Sequence[Sequence[int]], arena: HostArena, offsets: Sequence[int],
                    enqueued: Callable[[], None] | None = None) -> list[int]:
        """The keys' blocks into their slots (a key's k blocks back to back); the CRC32C of each key."""
        sums = self.inner.gather_into(flat_ids(block_ids, self.k), arena, self._part_offsets(offsets), enqueued)
        return concat_checksums(sums, self.k, self.part_bytes)

    def scatter_from(self, block_ids: KeyIds | Sequence[Sequence[int]], arena: HostArena, offsets: Sequence[int],
                     enqueued: Callable[[], None] | None = None) -> None:
        self.inner.scatter_from(flat_ids(block_ids, self.k), arena, self._part_offsets(offsets), enqueued)

    def alloc_host(self, n: int) -> list[torch.Tensor | None]:
        """n host buffers of a key's bytes (where a disk read of a key lands); None: any will do."""
        return list(self.inner.alloc_host(n, row_bytes=self.block_bytes))

    def scatter(self, block_ids: KeyIds | Sequence[Sequence[int]], srcs: Sequence[Any]) -> None:
        """One host buffer of a key's bytes per key into its k engine blocks."""
        if len(block_ids) != len(srcs):
            raise ValueError(f"{len(block_ids)} keys but {len(srcs)} source buffers")
        pb = self.part_bytes
        parts = [src[j * pb:(j + 1) * pb] for src in srcs for j in range(self.k)]
        self.inner.scatter(flat_ids(block_ids, self.k).tolist(), parts)

    def close(self) -> None:
        self.inner.close()
