"""Per-block answers of Store and Load, as the engine sees them.

The daemon answers a batch in packed arrays (a status per block, deadlines or tiers, a message only
for the blocks that have one). StoreResults / LoadResults keep those arrays (`statuses`,
`deadlines` / `tiers`, `messages`: index -> text) and read like a list of per-block results (PrefetchStatuses: a
list of status values with the refusals' `messages`):
`results[i].status`, `for r in results`, `len(results)`. Status and tier values are the
kvservice.v1 enum values (kvcache_pb2.STORED, kvcache_pb2.LOADED, kvcache_pb2.TIER_HOST, ...).
A hot loop should read the arrays; indexing builds a small result tuple per block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, overload


class StoreResult(NamedTuple):
    status: int  # kvcache_pb2.StoreStatus value
    deadline: float = 0.0  # unix seconds; 0 when not retained
    message: str = ""


class LoadResult(NamedTuple):
    status: int  # kvcache_pb2.LoadStatus value
    tier: int = 0  # kvcache_pb2.Tier it was served from
    message: str = ""


class StoreResults(Sequence[StoreResult]):
    __slots__ = ("statuses", "deadlines", "messages")

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.deadlines: list[float] = []
        self.messages: dict[int, str] = {}

    def extend(self, statuses: Sequence[int], deadlines: Sequence[float], messages) -> None:
        """Append one reply's arrays (deadlines may be empty: all 0); `messages` are BlockMessages."""
        lo = len(self.statuses)
        self.statuses.extend(statuses)
        if deadlines:
            self.deadlines.extend(deadlines)
        else:
            self.deadlines.extend([0.0] * len(statuses))
        for m in messages:
            self.messages[lo + m.index] = m.message

    def fill(self, n: int, status: int, message: str) -> None:
        lo = len(self.statuses)
        self.statuses.extend([status] * n)
        self.deadlines.extend([0.0] * n)
        for i in range(lo, lo + n):
            self.messages[i] = message

    def __len__(self) -> int:
        return len(self.statuses)

    @overload
    def __getitem__(self, i: int) -> StoreResult: ...
    @overload
    def __getitem__(self, i: slice) -> list[StoreResult]: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self.statuses)))]
        if i < 0:
            i += len(self.statuses)
        return StoreResult(self.statuses[i], self.deadlines[i], self.messages.get(i, ""))

    def __repr__(self) -> str:
        return f"StoreResults({list(self)!r})"


class LoadResults(Sequence[LoadResult]):
    __slots__ = ("statuses", "tiers", "messages")

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.tiers: list[int] = []
        self.messages: dict[int, str] = {}

    def extend(self, statuses: Sequence[int], tiers: Sequence[int], messages) -> None:
        lo = len(self.statuses)
        self.statuses.extend(statuses)
        self.tiers.extend(tiers)
        for m in messages:
            self.messages[lo + m.index] = m.message

    def fill(self, n: int, status: int, message: str) -> None:
        lo = len(self.statuses)
        self.statuses.extend([status] * n)
        self.tiers.extend([0] * n)
        for i in range(lo, lo + n):
            self.messages[i] = message

    def __len__(self) -> int:
        return len(self.statuses)

    @overload
    def __getitem__(self, i: int) -> LoadResult: ...
    @overload
    def __getitem__(self, i: slice) -> list[LoadResult]: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self.statuses)))]
        if i < 0:
            i += len(self.statuses)
        return LoadResult(self.statuses[i], self.tiers[i], self.messages.get(i, ""))

    def __repr__(self) -> str:
        return f"LoadResults({list(self)!r})"


class PrefetchStatuses(list):
    """A Prefetch's answer: a PrefetchStatus value per hash (it is a list of them), and `messages`
    (index -> why) for the blocks the daemon refused -- the session's lease cap, no room in the host
    tier, a failed disk read -- so an engine can tell a staging that starves from one that fails."""

    __slots__ = ("messages",)

    def __init__(self, statuses: Sequence[int] = ()) -> None:
        super().__init__(statuses)
        self.messages: dict[int, str] = {}

    def extend_reply(self, statuses: Sequence[int], messages) -> None:
        lo = len(self)
        self.extend(statuses)
        for m in messages:
            self.messages[lo + m.index] = m.message

