"""An LRU order over entries where the tail of a chain is evicted before its head.

Callers pass a batch in chain order (head first); `touch` makes the head the most recent,
so when a whole chain ages out its last block goes first and the prefix survives longest.
Keyed by the entry itself (identity hash: no key tuple hashed per block).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from itertools import repeat

from kvservice.placement.index import Entry


class ChainLRU:
    """A plain dict in insertion order (oldest first): inserting and popping a batch cost about half
    of an OrderedDict's, which a Store pays per new block and per victim. A refresh moves entries
    to the end by popping and re-inserting them as one batch; the holes popped entries leave at the
    front are skipped by C code when the oldest are walked, and dropped when the dict resizes."""

    def __init__(self) -> None:
        self._order: dict[Entry, Entry] = {}

    def touch(self, chain: Sequence[Entry]) -> None:
        """Insert or refresh entries given head first; the head ends up most recent."""
        self._to_end(chain[::-1])

    def _to_end(self, rev: Sequence[Entry]) -> None:
        """Move (or add) entries to the newest end, in the order given: the last one newest."""
        order = self._order
        pop = order.pop
        deque(map(pop, rev, repeat(None)), 0)  # the pops called from C: no bytecode a block
        before = len(order)
        order.update(zip(rev, rev))
        if len(order) - before < len(rev):  # an entry twice: each occurrence moves it to the end in turn
            for e in rev:
                pop(e, None)
                order[e] = e

    def add_new(self, chain: Sequence[Entry]) -> None:
        """touch() for entries not in the order (a Store's new blocks), head first: one update."""
        rev = chain[::-1]
        self._order.update(zip(rev, rev))

    def touch_present(self, chain: Sequence[Entry]) -> None:
        """Refresh those of the entries (head first) that are in the order; others are left out."""
        self._to_end(list(filter(self._order.__contains__, reversed(chain))))

    def append_newest(self, entries: Sequence[Entry]) -> None:
        """Add entries not yet in the order, oldest first, as the most recent (restart, in one pass)."""
        self._order.update((e, e) for e in entries)

    def discard(self, entry: Entry) -> None:
        self._order.pop(entry, None)

    def discard_many(self, entries: Iterable[Entry]) -> None:
        deque(map(self._order.pop, entries, repeat(None)), 0)

    def __contains__(self, entry: Entry) -> bool:
        return entry in self._order

    def __len__(self) -> int:
        return len(self._order)

    def oldest_first(self) -> Iterator[Entry]:
        # no copy: callers plan first and evict after (mutating while iterating raises, loudly)
        return iter(self._order.values())

    def values(self) -> Iterable[Entry]:
        return self._order.values()
