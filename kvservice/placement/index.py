"""Block index: (namespace, hash) -> Entry, the one record of where a block's bytes are.
An Entry keeps namespace and hash as two fields (no key tuple built per block; `key` builds one).

An entry exists while the block is in the host tier, waiting in the write queue, or on disk.
Tiers keep their own ordering structures (LRU, deadline heap) over the same entries.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from kvservice.core.types import BlockHash, BlockKey, NamespaceId, Tier


class DiskState(enum.IntEnum):
    NONE = 0  # no disk copy
    QUEUED = 1  # spill waiting in the write queue or being written
    ON_DISK = 2  # complete file under the disk path


class _LookupFields:
    """The slots a Lookup reads of each entry (BlockIndex.prefix_tiers), first in the object: right
    after its header (refcount, type), which the dict probe's reference already brought into the CPU
    cache. As the dataclass's last fields they were 2 cache lines away from it; with a large index
    (200k entries) that was one more cache miss a hash (4-5% of a 1024-hash BlockCache.lookup on the
    CPU box, bench/lookup_parts.py; 8-10% of the bare probe loop).
    Entry's fields, their order and its __init__ are unchanged: dataclass(slots=True) leaves out
    of Entry's __slots__ the names a base class has (Python >= 3.11; 3.10 repeats them: same
    behaviour, old layout)."""

    __slots__ = ("ready", "slot", "disk")


@dataclass(slots=True, eq=False)
class Entry(_LookupFields):
    namespace: NamespaceId  # the block's key is (namespace, hash): two fields, no key tuple built per block
    hash: BlockHash
    size: int
    checksum: int
    stored_at: float
    deadline: float = 0.0  # retention deadline, unix seconds; 0: never retained
    reuse: int = 0  # times loaded
    slot: int = -1  # byte offset of its slot in the host arena; -1: not in host memory
    spilling: bool = False  # evicted from the host tier: the slot goes once its disk write ends
    staged: bool = False  # while spilling: its bytes count on the spill staging budget, not the tier
    release_pending: bool = False  # the slot is to go, once the copies pinning it are done
    disk: DiskState = DiskState.NONE
    disk_path: str = ""
    disk_loc: int = -1  # disk tier v2 (segments): the block's segment slot, kvservice.disk.make_loc
    disk_deadline: float = 0.0  # deadline written in the disk header
    pins: int = 0  # copies or reads in flight that need the bytes to stay
    lease_until: float = 0.0  # prefetch lease: evictable again after this
    lease_owner: str = ""  # session that holds the prefetch lease
    ready: bool = True  # False while a Store is still copying its bytes in
    lru_pos: int = 0  # its place in the host tier's LRU (placement.lru.StampLRU); 0: not in it

    @property
    def key(self) -> BlockKey:
        return BlockKey(self.namespace, self.hash)

    def retained(self, now: float) -> bool:
        return self.deadline > now

    def pinned(self, now: float) -> bool:
        return self.pins > 0 or self.lease_until > now

    @property
    def in_memory(self) -> bool:
        """Bytes available without disk I/O: in the host tier, or in a slot a spill still holds."""
        return self.slot >= 0

    @property
    def host_buf(self) -> int | None:
        """The slot offset while the block's bytes count on the host tier (not on the spill staging
        budget); None otherwise. What the host tier's used bytes add up (tests count by it)."""
        return self.slot if self.slot >= 0 and not self.staged else None

    @property
    def tier(self) -> Tier:
        if self.slot >= 0:
            return Tier.HOST
        if self.disk == DiskState.ON_DISK:
            return Tier.DISK
        return Tier.NONE


_new = object.__new__


def _blank_entries(n: int) -> list[Entry]:
    """n entries in the state reserved_entries gives a new one, but for namespace, hash, size and
    stored_at (set when one is taken). Built field by field on bare objects in one loop: the
    dataclass __init__ with every field passed costs more (argument binding), and so does a function
    call per entry (0.35 vs 0.25 us an entry on the CPU box)."""
    out: list[Entry] = []
    add = out.append
    new, cls, none = _new, Entry, DiskState.NONE
    for _ in range(n):
        e = new(cls)
        e.checksum = 0
        e.deadline = 0.0
        e.reuse = 0
        e.slot = -1
        e.spilling = False
        e.staged = False
        e.release_pending = False
        e.disk = none
        e.disk_path = ""
        e.disk_loc = -1
        e.disk_deadline = 0.0
        e.pins = 1
        e.lease_until = 0.0
        e.lease_owner = ""
        e.ready = False
        e.lru_pos = 0
        add(e)
    return out


class BlankEntries:
    """Entries built ahead of the Stores that take them (a free list of fresh objects): a Store's new
    blocks get theirs from here and set four fields each, where building one (an allocation and 20
    field writes, ~0.4-0.6 us a block on the CPU box, 1.5-2x that on the GPU hosts) was one of the
    largest parts of a small-block Store's time before its copies. refill() builds the list back up
    to `limit` once a Store has been answered (Lifecycle.tidy_step: at the end of a Store answered early,
    else a step at a time between requests; pipeline.TIDY); the daemon fills it at start. Only fresh
    objects: an entry that was ever taken is never put back, so a stale reference elsewhere can never
    see another block through it.
    `limit` entries are kept (~190 bytes each: 65536 = ~12 MiB of the daemon's fixed overhead)."""

    __slots__ = ("_free", "limit")

    def __init__(self, limit: int) -> None:
        self._free: list[Entry] = []
        self.limit = max(0, limit)

    def __len__(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[Entry]:
        """Up to n blank entries (fewer, or none, when not as many are ready)."""
        free = self._free
        if not free:
            return []
        k = min(n, len(free))
        out = free[-k:]
        del free[-k:]
        return out

    def refill(self, most: int | None = None) -> int:
        """Build blanks up to the limit (at most `most` of them now). Returns how many were built."""
        k = self.limit - len(self._free)
        if most is not None:
            k = min(k, most)
        if k <= 0:
            return 0
        self._free += _blank_entries(k)
        return k


def reserved_entries(namespace: NamespaceId, hashes: Sequence[BlockHash], size: int, stored_at: float,
                     blanks: BlankEntries | None = None) -> list[Entry]:
    """A Store's new entries, one per hash: not ready, one pin (the reserving call's), no slot.
    Taken from `blanks` where it has them (four fields set each), built for the rest."""
    n = len(hashes)
    out = blanks.take(n) if blanks is not None else []
    if len(out) < n:
        out += _blank_entries(n - len(out))
    for e, h in zip(out, hashes):
        e.namespace = namespace
        e.hash = h
        e.size = size
        e.stored_at = stored_at
    return out


def reserved_entry(namespace: NamespaceId, hash: BlockHash, size: int, stored_at: float) -> Entry:
    """One entry as reserved_entries builds them."""
    return reserved_entries(namespace, (hash,), size, stored_at)[0]


class BlockIndex:
    """One dict per namespace keyed by the 32-byte hash itself: the hot paths (Lookup, Store, Load)
    look a batch up with one dict.get per hash on slices of the request's packed field, with no
    key object built per block. Entries that are not ready (a Store still copying) are in it too:
    get() hides them, namespace() callers check e.ready."""

    __slots__ = ("_by_ns",)

    def __init__(self) -> None:
        self._by_ns: dict[NamespaceId, dict[bytes, Entry]] = {}

    def namespace(self, ns: NamespaceId) -> dict[bytes, Entry]:
        """The namespace's hash -> entry dict (created empty), for batch loops; ready or not."""
        d = self._by_ns.get(ns)
        if d is None:
            d = self._by_ns[ns] = {}
        return d

    def prefix_tiers(self, ns: NamespaceId, hashes: Sequence[bytes]) -> list[int]:
        """Tier value (HOST / DISK) of each block of the stored prefix of a chain: stops at the
        first hash that is not stored (or not ready). A plain loop over map(dict.get) (the probes
        called from C, the map stops where the loop does): Python 3.11's specialised slot reads make
        it ~2x faster than C-level map(attrgetter) passes over the batch. The first hash not in the
        index ends it as None.ready's AttributeError (every indexed value is an Entry, marks
        included): no `is None` test a hash, ~4% of a 1024-hash Lookup."""
        d = self._by_ns.get(ns)
        if d is None:
            return []
        on_disk = DiskState.ON_DISK
        host, disk = int(Tier.HOST), int(Tier.DISK)
        out: list[int] = []
        add = out.append
        try:
            for e in map(d.get, hashes):
                if not e.ready:
                    break
                if e.slot >= 0:
                    add(host)
                elif e.disk == on_disk:
                    add(disk)
                else:
                    break
        except AttributeError:  # e is None: not stored
            pass
        return out

    def get(self, key: BlockKey) -> Entry | None:
        d = self._by_ns.get(key.namespace)
        e = d.get(key.hash) if d is not None else None
        return e if e is not None and e.ready else None

    def get_any(self, key: BlockKey) -> Entry | None:
        d = self._by_ns.get(key.namespace)
        return d.get(key.hash) if d is not None else None

    def add(self, entry: Entry) -> None:
        self.namespace(entry.namespace)[entry.hash] = entry

    def add_many(self, entries: Iterable[Entry]) -> None:
        """Index many entries at once (restart: the disk tier's blocks)."""
        for e in entries:
            self.namespace(e.namespace)[e.hash] = e

    def remove(self, entry: Entry) -> None:
        d = self._by_ns.get(entry.namespace)
        if d is not None and d.get(entry.hash) is entry:
            del d[entry.hash]

    def holds(self, entry: Entry) -> bool:
        """entry is the one indexed under its key (ready or not), not one forgotten or replaced."""
        d = self._by_ns.get(entry.namespace)
        return d is not None and d.get(entry.hash) is entry

    def remove_many(self, entries: Sequence[Entry]) -> None:
        """remove() for each (the namespace's dict looked up again only when the namespace changes),
        with one probe a key: a pop, the value put back in the rare case it is another entry (an
        entry replaced under its key), where get-then-del probes twice (~50-100 ns a block of an
        evicting Store, CPU box)."""
        by_ns = self._by_ns
        ns = d = pop = None
        for e in entries:
            if e.namespace is not ns:
                ns = e.namespace
                d = by_ns.get(ns)
                pop = d.pop if d is not None else None
            if pop is not None:
                h = e.hash
                v = pop(h, None)
                if v is not e and v is not None:
                    d[h] = v

    def __len__(self) -> int:
        return sum(len(d) for d in self._by_ns.values())

    def has_namespace(self, ns: NamespaceId) -> bool:
        """Some entry (ready or not) is indexed under ns."""
        return bool(self._by_ns.get(ns))

    def namespaces(self) -> Iterator[tuple[NamespaceId, Entry]]:
        """Each namespace with an entry, in the order values() meets them, with the first one it meets."""
        for ns, d in list(self._by_ns.items()):
            if d:
                yield ns, next(iter(d.values()))

    def values(self) -> Iterator[Entry]:
        for d in list(self._by_ns.values()):
            yield from d.values()
