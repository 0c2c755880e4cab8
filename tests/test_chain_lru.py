"""ChainLRU and StampLRU (kvservice.placement.lru) keep the order an OrderedDict with move_to_end
would: ChainLRU is a plain dict whose refreshes pop and re-insert a batch, StampLRU a deque of groups
whose members carry their own position (stale references skipped, trimmed, compacted), so random
touches, refreshes, discards and additions (chains with an entry twice among them) are checked
against that reference, and StampLRU's stale references stay bounded."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from kvservice.placement import lru as lru_mod
from kvservice.placement.lru import ChainLRU, StampLRU


class _Block:
    """Stands for an Entry: ChainLRU keys by identity only, StampLRU writes its position field."""

    lru_pos = 0


class _Reference:
    def __init__(self) -> None:
        self.order: OrderedDict[_Block, _Block] = OrderedDict()

    def touch(self, chain: list[_Block], present_only: bool) -> None:
        for e in reversed(chain):
            if e in self.order:
                self.order.move_to_end(e)
            elif not present_only:
                self.order[e] = e


def _change(rng: random.Random, lru, ref: _Reference, op: int, chain: list, make, most: int) -> list:
    """One change of the order, made to the LRU and the reference alike: 0 touch(chain), 1
    touch_present(chain), 2 discard_many(chain), 3 add_new of 1..most-1 new blocks (returned)."""
    if op == 0:
        lru.touch(chain)
        ref.touch(chain, present_only=False)
    elif op == 1:
        lru.touch_present(chain)
        ref.touch(chain, present_only=True)
    elif op == 2:
        lru.discard_many(chain)
        for e in chain:
            ref.order.pop(e, None)
    else:
        new = [make() for _ in range(rng.randrange(1, most))]
        lru.add_new(new)
        ref.touch(new, present_only=False)
        return new
    return []


@pytest.mark.parametrize("cls", [ChainLRU, StampLRU])
def test_order_matches_an_ordered_dict_with_move_to_end(cls):
    """Scenario: 2000 random runs of 20 steps each over 30 blocks; after every step the oldest-first
    order is the reference's."""
    rng = random.Random(10)
    for run in range(2000):
        blocks = [_Block() for _ in range(30)]  # fresh: a StampLRU's members carry their position
        lru, ref = cls(), _Reference()
        for step in range(20):
            op = rng.randrange(4)
            chain = [rng.choice(blocks) for _ in range(rng.randrange(7))]
            _change(rng, lru, ref, op, chain, _Block, 4)
            assert list(lru.oldest_first()) == list(ref.order), (run, step)
            assert len(lru) == len(ref.order)
            assert all(e in lru for e in ref.order)


def test_stamp_lru_keeps_its_stale_references_bounded_and_refuses_changes_mid_iteration():
    """A hot chain refreshed 10,000 times and a tier that evicts from the front as it fills: the
    groups hold at most ~2 x the members (+ a constant) and the order stays the reference's; a
    change while oldest_first() is being walked raises, as a dict changed during iteration does."""
    rng = random.Random(3)
    lru, ref = StampLRU(), _Reference()
    hot = [_Block() for _ in range(64)]
    lru.add_new(hot)
    ref.touch(hot, present_only=False)
    for step in range(10_000):
        if step % 3 == 0:
            new = [_Block() for _ in range(rng.randrange(1, 40))]
            lru.add_new(new)
            ref.touch(new, present_only=False)
        else:
            lru.touch_present(hot)
            ref.touch(hot, present_only=True)
        if len(ref.order) > 2000:  # evict the oldest 500 not in the hot chain
            old = [e for e in list(ref.order)[:600] if e not in hot][:500]
            lru.discard_many(old)
            for e in old:
                del ref.order[e]
        assert lru._refs <= lru_mod.STALE_RATIO * len(lru) + 4096 + 64
    assert list(lru.oldest_first()) == list(ref.order) and len(lru) == len(ref.order)
    it = lru.oldest_first()
    next(it)
    lru.touch_present(hot[:1])
    with pytest.raises(RuntimeError):
        list(it)


def test_stamp_lru_lets_go_of_entries_trimmed_off_the_front_of_a_group():
    """Scenario: one Store's batch of 64 blocks is one group; the oldest 40 are evicted (discarded from
    the front) while 24 of the group stay members. The evicted ones are no longer referenced by the
    order (freed now, not when the last of their group goes), and the order and length still hold."""
    import gc
    import weakref

    lru = StampLRU()
    chain = [_Block() for _ in range(64)]
    lru.add_new(chain)  # head first: the tail is the oldest
    oldest = list(lru.oldest_first())
    refs = [weakref.ref(e) for e in oldest[:40]]
    lru.discard_many(oldest[:40])
    keep = oldest[40:]
    del chain, oldest
    gc.collect()
    assert all(r() is None for r in refs)
    assert list(lru.oldest_first()) == keep and len(lru) == 24
    lru.touch(keep[:1])
    assert list(lru.oldest_first()) == keep[1:] + keep[:1]



class _Pinnable(_Block):
    """An Entry's fields take_oldest reads: pins and lease_until (Entry.pinned(now))."""

    def __init__(self) -> None:
        self.pins = 0
        self.lease_until = 0.0


def test_take_oldest_is_a_filtered_walk_then_discard_and_lets_go_of_what_it_takes():
    """StampLRU.take_oldest(want, now) gives what oldest_first() filtered by "not pinned, no lease
    running at now" gives, its first `want`, and leaves the order as discard_many of them would:
    random runs of touches, refreshes, additions, discards, pins and leases (some expired), with a
    take between steps; after each, the order, length and bounded references match the reference,
    and a taken entry is no longer referenced by the order (it is freed with its last reference)."""
    import gc
    import weakref

    rng = random.Random(21)
    now = 100.0
    for run in range(600):
        blocks = [_Pinnable() for _ in range(40)]
        lru, ref = StampLRU(), _Reference()
        for step in range(25):
            op = rng.randrange(6)
            chain = [rng.choice(blocks) for _ in range(rng.randrange(9))]
            if op < 4:
                blocks += _change(rng, lru, ref, (0, 1, 3, 2)[op], chain, _Pinnable, 12)
            elif op == 4:
                for e in chain:
                    e.pins = rng.randrange(2)
                    e.lease_until = rng.choice((0.0, now - 1, now + 5))
            else:
                want = rng.randrange(0, 15)
                expect = [e for e in ref.order if not e.pins and e.lease_until <= now][:want]
                got = lru.take_oldest(want, now)
                assert got == expect, (run, step)
                assert all(e.lru_pos == 0 for e in got)
                for e in got:
                    del ref.order[e]
            assert list(lru.oldest_first()) == list(ref.order), (run, step)
            assert len(lru) == len(ref.order)
            assert lru._refs <= lru_mod.STALE_RATIO * len(lru) + 4096 + 64

    lru = StampLRU()
    chain = [_Pinnable() for _ in range(64)]
    lru.add_new(chain)
    chain[20].pins = 1  # the 44th oldest: kept, and the walk goes past it
    got = lru.take_oldest(50, now)
    assert len(got) == 50 and chain[20] not in got and len(lru) == 14
    refs = [weakref.ref(e) for e in got[:43]]  # the ones before the kept member: the front moved past them
    keep = list(lru.oldest_first())
    del chain, got
    gc.collect()
    assert all(r() is None for r in refs)
    assert len(keep) == 14 and keep[0].pins == 1
