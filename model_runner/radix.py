"""RadixCache: the GPU tier's prefix index, one node per full KV block, keyed by chained block hash.

Primitives:
  match(hashes)           -> nodes of the longest cached prefix of the chain (touched for LRU)
  peek(hashes)            -> length of that prefix, without touching anything
  insert(hashes, blocks)  -> the node of every hash; a hash cached already keeps its own block
  acquire(nodes) / release(nodes)
                          reference counts; a referenced node is never evicted
  evict(n)                -> up to n (hash, block) pairs of unreferenced leaves, least recently used
                          first; a parent only becomes a candidate once its last child is gone

A block hash names its whole prefix (see engine_client.hashing), so a node's children are the
blocks that extend its prefix and the tree needs no token comparison. Pure bookkeeping: no I/O,
no tensors, and "time" is a logical tick advanced by match/insert, so LRU order is deterministic.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from typing import NewType

from kvwire.ids import BlockHash

BlockId = NewType("BlockId", int)  # index into the engine's KV pool

EvictCallback = Callable[[BlockHash, BlockId], None]


class Node:
    __slots__ = ("hash", "block", "parent", "children", "refs", "last_used", "depth", "serial")

    def __init__(self, h: BlockHash, block: BlockId, parent: Node | None, depth: int, serial: int) -> None:
        self.hash = h
        self.block = block
        self.parent = parent
        self.children: dict[BlockHash, Node] = {}
        self.refs = 0
        self.last_used = 0
        self.depth = depth
        self.serial = serial

    def __repr__(self) -> str:
        return f"Node({self.hash.hex()[:8]}, block={self.block}, refs={self.refs}, children={len(self.children)})"


class RadixCache:
    """Which GPU blocks hold which prefixes; what may be evicted, and in which order."""

    def __init__(self, on_evict: EvictCallback | None = None) -> None:
        self._root = Node(BlockHash(b""), BlockId(-1), None, 0, 0)
        self._by_hash: dict[BlockHash, Node] = {}
        self._evictable: dict[BlockHash, Node] = {}  # refs == 0 and no children
        self._on_evict = on_evict
        self._tick = 0
        self._serial = itertools.count(1)

    # --- queries
    def __len__(self) -> int:
        return len(self._by_hash)

    def __contains__(self, h: bytes) -> bool:
        return h in self._by_hash

    @property
    def evictable_count(self) -> int:
        """Leaves that evict() could take right now (more may follow as their parents become leaves)."""
        return len(self._evictable)

    @property
    def referenced_count(self) -> int:
        """Nodes some request (or a store in flight) holds; O(n), for checks and metrics."""
        return sum(1 for n in self._by_hash.values() if n.refs)

    def get(self, h: bytes) -> Node | None:
        return self._by_hash.get(BlockHash(h))

    def peek(self, hashes: Sequence[bytes]) -> int:
        """How many leading hashes are cached; touches nothing."""
        node = self._root
        for i, h in enumerate(hashes):
            node = node.children.get(BlockHash(h))  # type: ignore[assignment]
            if node is None:
                return i
        return len(hashes)

    def match(self, hashes: Sequence[bytes]) -> list[Node]:
        """Nodes of the longest cached prefix of the chain, marked most recently used."""
        self._tick += 1
        out: list[Node] = []
        node = self._root
        for h in hashes:
            child = node.children.get(BlockHash(h))
            if child is None:
                break
            child.last_used = self._tick
            out.append(child)
            node = child
        return out

    # --- updates
    def insert(self, hashes: Sequence[bytes], blocks: Sequence[BlockId]) -> list[Node]:
        """Cache the chain `hashes` held in `blocks`; returns the node of every hash.

        Where nodes[i].block == blocks[i] the tree took block i (or already had it); otherwise the
        hash was cached in another block, and blocks[i] is still the caller's to free.
        """
        if len(hashes) != len(blocks):
            raise ValueError(f"{len(hashes)} hashes but {len(blocks)} blocks")
        self._tick += 1
        out: list[Node] = []
        node = self._root
        for h, b in zip(hashes, blocks):
            h = BlockHash(bytes(h))
            child = node.children.get(h)
            if child is None:
                child = Node(h, b, node, node.depth + 1, next(self._serial))
                node.children[h] = child
                self._by_hash[h] = child
                self._evictable.pop(node.hash, None)  # a parent is no longer a leaf
            child.last_used = self._tick
            out.append(child)
            node = child
        if out:
            self._update(out[-1])
        return out

    def acquire(self, nodes: Sequence[Node]) -> None:
        for n in nodes:
            n.refs += 1
            self._evictable.pop(n.hash, None)

    def release(self, nodes: Sequence[Node]) -> None:
        for n in nodes:
            if n.refs <= 0:
                raise RuntimeError(f"release of an unreferenced node {n!r}")
            n.refs -= 1
            self._update(n)

    def evict(self, n: int) -> list[tuple[BlockHash, BlockId]]:
        """Remove up to n unreferenced leaves, least recently used first (deepest first on ties).

        Each removal is reported to on_evict (then returned) before its parent can be considered,
        so a chain always goes tail first.
        """
        if n <= 0 or not self._evictable:
            return []
        heap = [self._key(node) for node in self._evictable.values()]
        heapq.heapify(heap)
        out: list[tuple[BlockHash, BlockId]] = []
        while heap and len(out) < n:
            *_, node = heapq.heappop(heap)
            if self._evictable.get(node.hash) is not node:
                continue
            del self._evictable[node.hash]
            del self._by_hash[node.hash]
            parent = node.parent
            assert parent is not None
            del parent.children[node.hash]
            node.parent = None
            out.append((node.hash, node.block))
            if self._on_evict is not None:
                self._on_evict(node.hash, node.block)
            if parent is not self._root and self._is_evictable(parent):
                self._evictable[parent.hash] = parent
                heapq.heappush(heap, self._key(parent))
        return out

    # --- internals
    @staticmethod
    def _key(node: Node) -> tuple[int, int, int, Node]:
        return (node.last_used, -node.depth, node.serial, node)

    @staticmethod
    def _is_evictable(node: Node) -> bool:
        return node.refs == 0 and not node.children

    def _update(self, node: Node) -> None:
        if node.parent is not None and self._is_evictable(node):
            self._evictable[node.hash] = node
