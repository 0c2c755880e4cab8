"""BlockIndex.prefix_tiers (the Lookup path) answers as the one-block-at-a-time walk would: random
chains of stored, missing, reserved (not ready, with or without a slot), host and disk blocks."""

from __future__ import annotations

import random

from kvservice.core.types import NamespaceId, Tier
from kvservice.placement.index import BlockIndex, DiskState, Entry, reserved_entry

NS = NamespaceId("ns")


def walk(index: BlockIndex, hashes: list[bytes]) -> list[int]:
    """The reference: stop at the first hash not stored, not ready, or in neither tier."""
    out = []
    d = index.namespace(NS)
    for h in hashes:
        e = d.get(h)
        if e is None or not e.ready:
            break
        if e.slot >= 0:
            out.append(int(Tier.HOST))
        elif e.disk == DiskState.ON_DISK:
            out.append(int(Tier.DISK))
        else:
            break
    return out


def test_prefix_tiers_matches_the_walk():
    rng = random.Random(3)
    for _ in range(3000):
        index = BlockIndex()
        hashes = [rng.randbytes(32) for _ in range(rng.randrange(12))]
        for k, h in enumerate(hashes):
            kind = rng.choice(["host", "host", "host", "disk", "disk", "missing", "reserved", "placed", "queued"])
            if kind == "missing":
                continue
            if kind in ("reserved", "placed"):
                e = reserved_entry(NS, h, 4096, 0.0)
                e.slot = 4096 * k if kind == "placed" else -1
            else:
                e = Entry(NS, h, 4096, 0, 0.0)
                e.slot = 4096 * k if kind == "host" else -1
                e.disk = DiskState.ON_DISK if kind == "disk" else DiskState.QUEUED if kind == "queued" else e.disk
            index.add(e)
        assert index.prefix_tiers(NS, hashes) == walk(index, hashes)
    assert BlockIndex().prefix_tiers(NS, [b"x" * 32]) == []


def test_entry_fields_and_constructor_are_unchanged_by_the_lookup_layout():
    """Entry keeps the Lookup's fields (ready, slot, disk) in a base class's slots, first in the
    object; its dataclass fields, their order and positional construction (the disk tier's
    restart builds entries so) are what they were, with lru_pos (the host LRU's StampLRU position)
    added last."""
    names = ["namespace", "hash", "size", "checksum", "stored_at", "deadline", "reuse", "slot", "spilling", "staged",
             "release_pending", "disk", "disk_path", "disk_loc", "disk_deadline", "pins", "lease_until",
             "lease_owner", "ready", "lru_pos"]
    assert list(Entry.__dataclass_fields__) == names
    assert Entry.__mro__[1].__slots__ == ("ready", "slot", "disk")
    values = [NS, b"h" * 32, 4096, 7, 1.5, 2.5, 3, 8192, True, True, True, DiskState.ON_DISK, "p", 9, 4.5, 2, 5.5,
              "owner", False, 17]
    e = Entry(*values)
    assert [getattr(e, n) for n in names] == values
    d = Entry(NS, b"h" * 32, 4096, 0, 0.0)
    assert (d.slot, d.disk, d.ready, d.pins) == (-1, DiskState.NONE, True, 0)
    assert not hasattr(d, "__dict__")  # still slotted: no per-entry dict
    r = reserved_entry(NS, b"r" * 32, 4096, 0.0)
    assert (r.slot, r.disk, r.ready, r.pins, r.lru_pos) == (-1, DiskState.NONE, False, 1, 0)
