"""An LRU order over entries where the tail of a chain is evicted before its head.

Callers pass a batch in chain order (head first); `touch` makes the head the most recent,
so when a whole chain ages out its last block goes first and the prefix survives longest.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from kvservice.placement.index import Entry
from kvservice.core.types import BlockKey


class ChainLRU:
    def __init__(self) -> None:
        self._order: OrderedDict[BlockKey, Entry] = OrderedDict()

    def touch(self, chain: Sequence[Entry]) -> None:
        """Insert or refresh entries given head first; the head ends up most recent."""
        for e in reversed(chain):
            self._order[e.key] = e
            self._order.move_to_end(e.key)

    def append_newest(self, entries: Sequence[Entry]) -> None:
        """Add entries not yet in the order, oldest first, as the most recent (restart, in one pass)."""
        self._order.update((e.key, e) for e in entries)

    def discard(self, entry: Entry) -> None:
        self._order.pop(entry.key, None)

    def __contains__(self, entry: Entry) -> bool:
        return entry.key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def oldest_first(self) -> Iterator[Entry]:
        # no copy: callers plan first and evict after (mutating while iterating raises, loudly)
        return iter(self._order.values())

    def values(self) -> Iterable[Entry]:
        return self._order.values()
