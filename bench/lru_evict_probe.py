#!/usr/bin/env python3
"""Choosing an evicting Store's victims from the host LRU: StampLRU.take_oldest against the three passes it
replaced (oldest_first() walked a chunk at a time and filtered, then discard_many: positions cleared, the trim).

    .venv/bin/python bench/lru_evict_probe.py [--members 32768] [--part 2048] [--rounds 30]

Two batches of --members are added, then refreshed by a Load each (every member's older reference goes
stale, as in bench/gpu_bandwidth.py's rounds), and victims are taken --part at a time, 8 parts a round.
ns a victim, min and median of --rounds; the two ways alternate in one process.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvservice.placement.lru import StampLRU  # noqa: E402


class Member:
    __slots__ = ("lru_pos", "pins", "lease_until")

    def __init__(self) -> None:
        self.lru_pos = 0
        self.pins = 0
        self.lease_until = 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--members", type=int, default=32768)
    ap.add_argument("--part", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=30)
    a = ap.parse_args()

    def order() -> StampLRU:
        lru = StampLRU()
        batches = [[Member() for _ in range(a.members)] for _ in range(2)]
        for b in batches:
            lru.add_new(b)
        for b in batches:
            lru.touch_present(b)
        return lru

    def three_passes(lru: StampLRU) -> list:
        chunk = list(itertools.islice(iter(lru.oldest_first()), a.part))
        victims = [e for e in chunk if not e.pins and e.lease_until <= 0.0]
        lru.discard_many(victims)
        return victims

    def one_walk(lru: StampLRU) -> list:
        return lru.take_oldest(a.part, 0.0)

    ways = {"filtered walk + discard_many": three_passes, "StampLRU.take_oldest": one_walk}
    res: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(a.rounds):
        for name, fn in ways.items():
            lru = order()
            t0 = time.perf_counter()
            for _ in range(8):
                assert len(fn(lru)) == a.part
            res[name].append((time.perf_counter() - t0) / (8 * a.part) * 1e9)
    print(f"victims from a refreshed LRU, {a.part} at a time, ns a victim")
    print("| way | min | median |")
    print("| --- | ---: | ---: |")
    for name, v in res.items():
        print(f"| {name} | {min(v):.0f} | {statistics.median(v):.0f} |")


if __name__ == "__main__":
    main()
