"""RadixCache and BlockAllocator: the GPU tier's bookkeeping, driven directly (no model, no daemon)."""

from __future__ import annotations

import concurrent.futures
import hashlib

import pytest

from model_runner.allocator import BlockAllocator
from model_runner.radix import BlockId, RadixCache


def chain(name: str, n: int) -> list[bytes]:
    """n chained 32-byte hashes; chain("a", 3)[:2] == chain("a", 2)."""
    out, prev = [], name.encode()
    for i in range(n):
        prev = hashlib.blake2b(prev + i.to_bytes(4, "little"), digest_size=32).digest()
        out.append(prev)
    return out


def blocks(*ids: int) -> list[BlockId]:
    return [BlockId(i) for i in ids]


def test_match_returns_longest_cached_prefix() -> None:
    """Scenario: a 3-block chain is cached; a 5-block request sharing its first 3 blocks matches 3,
    an unrelated chain matches nothing, and peek agrees without touching."""
    r = RadixCache()
    a = chain("a", 5)
    r.insert(a[:3], blocks(10, 11, 12))
    assert [n.block for n in r.match(a)] == [10, 11, 12]
    assert r.match(chain("b", 2)) == []
    assert r.peek(a) == 3 and r.peek(a[:2]) == 2 and r.peek([]) == 0
    assert len(r) == 3 and a[0] in r


def test_insert_keeps_existing_blocks_and_extends_chains() -> None:
    """Scenario: two requests computed the same prefix into different blocks. The second insert keeps
    the first's blocks (the caller still owns its duplicates) and adds only the new tail."""
    r = RadixCache()
    a = chain("a", 4)
    first = r.insert(a[:2], blocks(1, 2))
    second = r.insert(a, blocks(7, 8, 9, 10))
    assert [n.block for n in second] == [1, 2, 9, 10]
    assert second[:2] == first
    assert second[2].parent is second[1]
    with pytest.raises(ValueError):
        r.insert(a, blocks(1))


def test_evicts_lru_leaves_and_a_leaf_before_its_parent() -> None:
    """Scenario: chains A (3 blocks) and B (2 blocks), B used more recently. Evicting everything goes
    A's tail, middle, head, then B's tail and head: the on_evict callback never sees a parent before
    its child, and the least recently used chain goes first."""
    seen: list[int] = []
    r = RadixCache(on_evict=lambda h, b: seen.append(b))
    a, b = chain("a", 3), chain("b", 2)
    r.insert(a, blocks(1, 2, 3))
    r.insert(b, blocks(4, 5))
    r.match(b)
    out = r.evict(10)
    assert seen == [3, 2, 1, 5, 4]
    assert [blk for _, blk in out] == seen
    assert [h for h, _ in out] == [a[2], a[1], a[0], b[1], b[0]]
    assert len(r) == 0 and r.evictable_count == 0


def test_touch_reorders_eviction() -> None:
    """Scenario: A inserted before B, but A matched afterwards: B is now the LRU leaf and goes first."""
    r = RadixCache()
    a, b = chain("a", 1), chain("b", 1)
    r.insert(a, blocks(1))
    r.insert(b, blocks(2))
    r.match(a)
    assert r.evict(1) == [(b[0], 2)]


def test_referenced_nodes_and_their_ancestors_are_never_evicted() -> None:
    """Scenario: a request holds the tail of a 3-block chain; the whole chain is pinned (its ancestors
    are not leaves). A sibling branch is evictable. After release everything can go."""
    r = RadixCache()
    a = chain("a", 3)
    nodes = r.insert(a, blocks(1, 2, 3))
    r.acquire(nodes[2:])
    assert r.referenced_count == 1
    side = r.insert(a[:1] + chain("side", 1), blocks(1, 9))  # shares a[0], branches off it
    assert side[0] is nodes[0]
    assert r.evict(10) == [(chain("side", 1)[0], 9)]
    assert len(r) == 3
    r.release(nodes[2:])
    assert [blk for _, blk in r.evict(10)] == [3, 2, 1]


def test_refcounts_stack_and_release_is_checked() -> None:
    """Scenario: two requests share a block; it stays until both released it; an extra release is a bug."""
    r = RadixCache()
    (n,) = r.insert(chain("a", 1), blocks(4))
    r.acquire([n])
    r.acquire([n])
    r.release([n])
    assert r.evict(1) == []
    r.release([n])
    assert r.evict(1) == [(n.hash, 4)]
    with pytest.raises(RuntimeError):
        r.release([n])


def test_evict_takes_at_most_n_and_parents_join_the_candidates() -> None:
    """Scenario: a single 4-block chain, evict(2) twice: tail pair first, then the head pair."""
    r = RadixCache()
    a = chain("a", 4)
    r.insert(a, blocks(1, 2, 3, 4))
    assert [blk for _, blk in r.evict(2)] == [4, 3]
    assert [n.block for n in r.match(a)] == [1, 2]
    assert [blk for _, blk in r.evict(2)] == [2, 1]


def test_allocator_all_or_nothing_and_held_blocks_wait_for_their_offload() -> None:
    """Scenario: a 4-block pool. Allocation is all or nothing; blocks held for an offload come back only
    when its future is done; a double free is caught."""
    al = BlockAllocator(4)
    got = al.allocate(3)
    assert got is not None and len(set(got)) == 3
    assert al.allocate(2) is None and al.free_count == 1
    fut: concurrent.futures.Future[None] = concurrent.futures.Future()
    al.hold(got[:2], fut)
    assert al.reclaim() == 0 and al.held_count == 2 and al.free_count == 1
    fut.set_result(None)
    assert al.reclaim() == 2 and al.free_count == 3 and al.held_count == 0
    with pytest.raises(RuntimeError):
        al.free(got[:1])
