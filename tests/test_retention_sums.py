"""Retention keeps each namespace's retained bytes incrementally (a heap of deadlines, no walk per
block); the running figure must equal the walk it replaces at every step of a random history of
extends (deadlines only extend), forgets, recoveries (track) and clock advances."""

from __future__ import annotations

import random

from kvservice.placement.index import Entry
from kvservice.placement.retention import Retention


def extend(r: Retention, e: Entry, ttl: float, now: float) -> float | None:
    """What kvservice.core.lifecycle.Lifecycle.retain does with a Retention: ask, move the deadline, count it."""
    deadline = r.extend_to(e, now + ttl, now)
    if deadline is not None and deadline != e.deadline:
        e.deadline = deadline
        r.counted(e, now)
    return deadline


def walked(entries, live, ns, now):
    return sum(e.size for k, e in enumerate(entries) if k in live and e.namespace == ns and e.deadline > now)


def test_running_retained_bytes_equal_the_walk_through_a_random_history():
    rng = random.Random(7)
    r = Retention(max_ttl_seconds=1e9, cap_bytes=0)
    entries = [Entry(f"ns{i % 2}", bytes([i]) * 32, rng.randint(1, 9), 0, 0.0) for i in range(60)]
    live = set(range(60))
    now = 0.0
    for _ in range(20000):
        i = rng.randrange(60)
        e, op = entries[i], rng.random()
        if op < 0.5 and i in live:
            extend(r, e, rng.choice([1, 5, 20, 100]), now)
        elif op < 0.55 and i in live:
            r.forget(e)
            live.discard(i)
        elif op < 0.58 and i not in live:  # the hash is stored again: a new block, never retained
            e.deadline = 0.0
            live.add(i)
        elif op < 0.6 and i in live and e.deadline == 0:  # recovered from disk with a deadline
            e.deadline = now + rng.choice([-5, 5])
            r.track(e)
        else:
            now += rng.choice([0, 0.5, 3])
        for ns in ("ns0", "ns1"):
            assert r.retained_bytes(ns, now) == walked(entries, live, ns, now)


def test_the_cap_refuses_past_its_bytes_and_admits_again_after_expiry():
    r = Retention(max_ttl_seconds=1000, cap_bytes=10)
    a, b, c = (Entry("ns", bytes([k]) * 32, 5, 0, 0.0) for k in range(3))
    assert extend(r, a, 10, 0.0) == 10 and extend(r, b, 20, 0.0) == 20
    assert extend(r, c, 30, 0.0) is None  # 5 + 5 + 5 > 10
    assert extend(r, a, 50, 1.0) == 51  # already retained: extending needs no room
    assert extend(r, c, 30, 21.0) == 51  # b expired at 20: its 5 bytes are free again
    assert r.retained_bytes("ns", 21.0) == 10
