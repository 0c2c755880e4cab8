"""An LRU order over entries where the tail of a chain is evicted before its head.

Callers pass a batch in chain order (head first); `touch` makes the head the most recent,
so when a whole chain ages out its last block goes first and the prefix survives longest.
Keyed by the entry itself (identity hash: no key tuple hashed per block).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from kvservice.placement.index import Entry


class ChainLRU:
    def __init__(self) -> None:
        self._order: OrderedDict[Entry, Entry] = OrderedDict()

    def touch(self, chain: Sequence[Entry]) -> None:
        """Insert or refresh entries given head first; the head ends up most recent."""
        order = self._order
        move = order.move_to_end
        for e in reversed(chain):
            if e in order:
                move(e)
            else:
                order[e] = e

    def add_new(self, chain: Sequence[Entry]) -> None:
        """touch() for entries not in the order (a Store's new blocks), head first: one update."""
        rev = chain[::-1]
        self._order.update(zip(rev, rev))

    def touch_present(self, chain: Sequence[Entry]) -> None:
        """Refresh those of the entries (head first) that are in the order; others are left out."""
        order = self._order
        move = order.move_to_end
        for e in reversed(chain):
            if e in order:
                move(e)

    def append_newest(self, entries: Sequence[Entry]) -> None:
        """Add entries not yet in the order, oldest first, as the most recent (restart, in one pass)."""
        self._order.update((e, e) for e in entries)

    def discard(self, entry: Entry) -> None:
        self._order.pop(entry, None)

    def discard_many(self, entries: Iterable[Entry]) -> None:
        pop = self._order.pop
        for e in entries:
            pop(e, None)

    def __contains__(self, entry: Entry) -> bool:
        return entry in self._order

    def __len__(self) -> int:
        return len(self._order)

    def oldest_first(self) -> Iterator[Entry]:
        # no copy: callers plan first and evict after (mutating while iterating raises, loudly)
        return iter(self._order.values())

    def values(self) -> Iterable[Entry]:
        return self._order.values()
