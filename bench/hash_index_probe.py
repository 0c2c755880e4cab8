#!/usr/bin/env python3
"""Could the block index (hash -> entry) leave the Python dict for numpy? A probe for issue 10's 64 KiB line.

    .venv/bin/python bench/hash_index_probe.py [--live 98304] [--batches 32768,2048] [--rounds 5]

The index costs a 64 KiB Store a dict insert per new block and a dict pop per victim, and a Load a dict get per
block: ~0.15-0.4 us each on the CPU box in the daemon (memory-bound: index slot, entry, stored key). This
times, on one table of --live keys (32-byte hashes, a full host tier of two 2 GiB batches of 64 KiB blocks
plus the batch coming in), per key and best of --rounds:
  dict       the daemon's structure: get of present keys (equal but distinct bytes objects, as decoded from
             the wire: hash computed, stored key compared), setdefault of new keys, pop of old ones
  buckets    a vectorised numpy table: 8 ways a bucket (one 64-byte line of tags), tag = hash word 0,
             bucket = word 1, overflow into the next bucket counted per bucket; lookup = tags of the home
             bucket compared at once, then the one matching way's full key; insert ranks a batch's keys
             within their buckets (argsort) and takes the k-th free way; remove clears bits.
A batch op costs numpy a fixed ~10-20 ops plus its element work; it pays only if that beats the dict's
per-key C loop. The 2026-12-07 run (CPU box) said no: see BENCHMARKS.md, "hash index probe".
"""

from __future__ import annotations

import argparse
import time

import numpy as np

WAYS = 8
KTH_FREE = np.full((256, WAYS), WAYS, np.int8)  # KTH_FREE[occupancy, r]: the r-th free way of a bucket
for _occ in range(256):
    for _r, _b in enumerate(b for b in range(WAYS) if not (_occ >> b) & 1):
        KTH_FREE[_occ, _r] = _b
POPCOUNT = np.array([bin(i).count("1") for i in range(256)], np.int16)
BITS = np.arange(WAYS, dtype=np.uint8)


class BucketTable:
    def __init__(self, buckets_pow: int) -> None:
        self.nb = 1 << buckets_pow
        self.keys = np.zeros((self.nb, WAYS, 4), np.uint64)
        self.tags = np.zeros((self.nb, WAYS), np.uint64)
        self.occ = np.zeros(self.nb, np.uint8)
        self.over = np.zeros(self.nb, np.int32)  # keys placed past this bucket while it was full
        self.val = np.full((self.nb, WAYS), -1, np.int64)

    def home(self, keys: np.ndarray) -> np.ndarray:
        return (keys[:, 1] & np.uint64(self.nb - 1)).astype(np.int64)

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        out = np.full(len(keys), -1, np.int64)
        b = self.home(keys)
        idx = np.arange(len(keys))
        while True:
            k = keys[idx]
            eq = (self.tags[b] == k[:, 0:1]) & ((self.occ[b][:, None] >> BITS) & 1).astype(bool)
            way = eq.argmax(1)
            hit = eq[np.arange(len(b)), way]
            hit[hit] = (self.keys[b[hit], way[hit]] == k[hit]).all(1)
            out[idx[hit]] = self.val[b[hit], way[hit]]
            go = ~hit & (self.over[b] > 0)
            if not go.any():
                return out
            idx, b = idx[go], (b[go] + 1) & (self.nb - 1)

    def insert(self, keys: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Keys known absent. Returns each one's (bucket, way)."""
        n = len(keys)
        idx, b = np.arange(n), self.home(keys)
        at_b, at_w = np.empty(n, np.int64), np.empty(n, np.int64)
        while len(idx):
            order = np.argsort(b, kind="stable")
            bs = b[order]
            first = np.r_[True, bs[1:] != bs[:-1]]
            rank = np.arange(len(bs)) - np.maximum.accumulate(np.where(first, np.arange(len(bs)), 0))
            occ = self.occ[bs]
            ok = rank < WAYS - POPCOUNT[occ]
            sel, wb = order[ok], bs[ok]
            way = KTH_FREE[occ[ok], rank[ok]].astype(np.int64)
            src = idx[sel]
            self.keys[wb, way] = keys[src]
            self.tags[wb, way] = keys[src, 0]
            self.val[wb, way] = vals[src]
            np.bitwise_or.at(self.occ, wb, (1 << way).astype(np.uint8))
            at_b[src], at_w[src] = wb, way
            left = order[~ok]
            np.add.at(self.over, b[left], 1)
            idx, b = idx[left], (b[left] + 1) & (self.nb - 1)
        return at_b, at_w

    def remove(self, keys: np.ndarray, at_b: np.ndarray, at_w: np.ndarray) -> None:
        np.bitwise_and.at(self.occ, at_b, ~(1 << at_w).astype(np.uint8))
        home = self.home(keys)
        dist = (at_b - home) & (self.nb - 1)
        for h, d in zip(home[dist > 0].tolist(), dist[dist > 0].tolist()):  # (rare: overflowed keys)
            for j in range(d):
                self.over[(h + j) & (self.nb - 1)] -= 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--live", type=int, default=98304)
    p.add_argument("--batches", default="32768,2048")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    rng = np.random.default_rng(1)

    def hashes(n: int) -> np.ndarray:
        return rng.integers(0, 2**63, size=(n, 4), dtype=np.int64).view(np.uint64)

    rows = []
    for n in map(int, a.batches.split(",")):
        best: dict[str, float] = {}

        def keep(name: str, seconds: float) -> None:
            best[name] = min(best.get(name, 1e9), seconds / n * 1e9)

        # dict: the live keys, then rounds of (pop the oldest batch, setdefault a new one, get it back)
        d: dict[bytes, int] = {}
        batches = [[bytes(r) for r in hashes(n)] for _ in range(max(1, a.live // n))]
        for bt in batches:
            d.update(zip(bt, range(len(bt))))
        for _ in range(a.rounds):
            new = [bytes(r) for r in hashes(n)]
            old = batches.pop(0)
            t0 = time.perf_counter()
            for k in old:
                d.pop(k, None)
            t1 = time.perf_counter()
            list(map(d.setdefault, new, range(n)))
            t2 = time.perf_counter()
            wire = [bytes(bytearray(k)) for k in new]  # equal, distinct objects: what a Load decodes
            t3 = time.perf_counter()
            found = list(map(d.get, wire))
            t4 = time.perf_counter()
            assert found == list(range(n))
            batches.append(new)
            keep("dict pop", t1 - t0)
            keep("dict setdefault (new)", t2 - t1)
            keep("dict get (hit)", t4 - t3)
        # the bucket table, sized as the dict would be (~2.7 slots a key: load 0.375)
        t = BucketTable(max(4, int(np.ceil(np.log2(a.live * 8 / 3 / WAYS)))))
        live = []
        for _ in range(max(1, a.live // n)):
            k = hashes(n)
            live.append((k, *t.insert(k, np.arange(n))))
        for _ in range(a.rounds):
            k = hashes(n)
            ok, ob, ow = live.pop(0)
            t0 = time.perf_counter()
            t.remove(ok, ob, ow)
            t1 = time.perf_counter()
            miss = t.lookup(k)
            t2 = time.perf_counter()
            at = t.insert(k, np.arange(n))
            t3 = time.perf_counter()
            hit = t.lookup(k)
            t4 = time.perf_counter()
            assert (miss == -1).all() and (hit == np.arange(n)).all()
            live.append((k, *at))
            keep("buckets remove", t1 - t0)
            keep("buckets lookup (miss)", t2 - t1)
            keep("buckets insert (new)", t3 - t2)
            keep("buckets lookup (hit)", t4 - t3)
        rows.append((n, best))
    print(f"index probe: {a.live} live keys, best of {a.rounds} rounds, ns a key")
    names = list(rows[0][1])
    print("| op | " + " | ".join(f"batch {n}" for n, _ in rows) + " |")
    print("| --- |" + " ---: |" * len(rows))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{b[name]:.0f}" for _, b in rows) + " |")
    for n, b in rows:
        print(f"batch {n}: buckets / dict, Load-side (lookup hit / get) {b['buckets lookup (hit)'] / b['dict get (hit)']:.2f}, "
              f"Store-side (lookup miss + insert + remove / setdefault + pop) "
              f"{(b['buckets lookup (miss)'] + b['buckets insert (new)'] + b['buckets remove']) / (b['dict setdefault (new)'] + b['dict pop']):.2f}")


if __name__ == "__main__":
    main()
