"""ChainLRU (kvservice.placement.lru) keeps the order an OrderedDict with move_to_end would: it is a
plain dict whose refreshes pop and re-insert a batch, so random touches, refreshes, discards and
additions (chains with an entry twice among them) are checked against that reference."""

from __future__ import annotations

import random
from collections import OrderedDict

from kvservice.placement.lru import ChainLRU


class _Block:
    """Stands for an Entry: the LRU keys by identity only."""


class _Reference:
    def __init__(self) -> None:
        self.order: OrderedDict[_Block, _Block] = OrderedDict()

    def touch(self, chain: list[_Block], present_only: bool) -> None:
        for e in reversed(chain):
            if e in self.order:
                self.order.move_to_end(e)
            elif not present_only:
                self.order[e] = e


def test_order_matches_an_ordered_dict_with_move_to_end():
    """Scenario: 2000 random runs of 20 steps each over 30 blocks; after every step the oldest-first
    order is the reference's."""
    rng = random.Random(10)
    blocks = [_Block() for _ in range(30)]
    for run in range(2000):
        lru, ref = ChainLRU(), _Reference()
        for step in range(20):
            op = rng.randrange(4)
            chain = [rng.choice(blocks) for _ in range(rng.randrange(7))]
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
                new = [_Block() for _ in range(rng.randrange(1, 4))]
                lru.add_new(new)
                ref.touch(new, present_only=False)
            assert list(lru.oldest_first()) == list(ref.order), (run, step)
            assert len(lru) == len(ref.order)
            assert all(e in lru for e in ref.order)
