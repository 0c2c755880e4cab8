"""DiskRoom (placement/eviction.py): the disk room protected spills may use, counted lazily.

It must answer exactly as summing the whole disk order first would, while reading only as far as
the asks need (an evicting Store used to sum every block of the disk tier)."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from kvservice.placement.eviction import DiskRoom


def eager(free: int, sizes: list[int], asks: list[int]) -> list[bool]:
    room, out = free + sum(sizes), []
    for n in asks:
        ok = n <= room
        room -= n if ok else 0
        out.append(ok)
    return out


@given(st.integers(0, 64), st.lists(st.integers(1, 16), max_size=30), st.lists(st.integers(1, 40), max_size=30))
def test_answers_as_the_full_sum_would(free, sizes, asks):
    room = DiskRoom(free, iter(sizes))
    assert [room.take(n) for n in asks] == eager(free, sizes, asks)


def test_reads_only_as_far_as_the_asks_need():
    read = []
    sizes = (read.append(i) or 4 for i in itertools.count())  # an endless disk order of 4-byte blocks
    room = DiskRoom(8, sizes)
    assert room.take(8)  # free space covers it: nothing read
    assert read == []
    assert room.take(10)  # needs 3 blocks
    assert read == [0, 1, 2] and room.room == 2


def test_a_tier_that_cannot_be_written_has_no_room():
    assert not DiskRoom.none().take(1)
    assert DiskRoom.none().take(0)
