"""Read a daemon's call timelines (KVTUNE_TRACE=FILE, kvservice/ops/trace.py) and print where each
Store's and Load's wall time goes: per call kind and size, each stage's time from the call's start
(median over the calls after the first, and the first call's own), in the order they happen.

    .venv/bin/python bench/trace_timeline.py FILE [--skip 0]

Stages: store = validated and reserved (`reserved`), per part the host room made (`room`), the copy
handed to a copy thread (`submitted`), queued on the device (`enqueued`), its end awaited (`copied`),
`committed`, `end`; load = `pinned`, `submitted`, `copied`, `end`. The copy threads' own stamps
(gather.* / scatter.*: start, every chunk queued, done; a gather also its lane and staging, its ids on
the device, and its first chunk's kernel, CRC and D2H launched) are those inside the call's window,
in time order; `channel.received` / `channel.sent` are the frames channel's last receipt before the call and
first reply after it (the daemon's share outside the core). A stage marked N times shows as tag#k.
Spill batches (`spill:n`, one DiskStore.write of n blocks, stamped when `written`) are summed up at
the end instead: how long the disk had a spill in flight over the span from the first to the last
one, and how many blocks were in flight on average (a disk idle between Stores shows up here).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics


def calls(path: str) -> dict[str, list[list[tuple[str, float]]]]:
    """kind:n -> per call, its (stage, ms from the call's start), in time order."""
    events = [json.loads(line) for line in open(path)]
    events.sort(key=lambda e: e["t"])
    by_call: dict[int, list[dict]] = collections.defaultdict(list)
    free: list[dict] = []  # copy threads' and the channel's stamps (call 0)
    for e in events:
        (by_call[e["call"]] if e["call"] else free).append(e)
    out: dict[str, list[list[tuple[str, float]]]] = collections.defaultdict(list)
    for cid in sorted(by_call):
        evs = by_call[cid]
        kind, t0 = evs[0]["tag"], evs[0]["t"]
        t1 = evs[-1]["t"]
        stages = [(e["tag"], e["t"]) for e in evs[1:]]
        before = [e for e in free if e["tag"] == "channel.received" and e["t"] <= t0]
        if before:
            stages.append(("channel.received", before[-1]["t"]))
        after = [e for e in free if e["tag"] == "channel.sent" and e["t"] >= t1]
        if after:
            stages.append(("channel.sent", after[0]["t"]))
        stages += [(e["tag"], e["t"]) for e in free if t0 <= e["t"] <= t1 and not e["tag"].startswith("channel")]
        stages.sort(key=lambda x: x[1])
        seen: collections.Counter = collections.Counter()
        row = []
        for tag, t in stages:
            seen[tag] += 1
            row.append((f"{tag}#{seen[tag]}" if seen[tag] > 1 else tag, 1e3 * (t - t0)))
        out[kind].append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("file")
    p.add_argument("--skip", type=int, default=1, help="calls of each kind left out of the median (warm-up)")
    a = p.parse_args()
    by_kind = calls(a.file)
    spills = {k: v for k, v in by_kind.items() if k.startswith("spill:")}
    for kind, rows in by_kind.items():
        if kind in spills:
            continue
        steady = rows[a.skip:] or rows
        order: dict[str, float] = {}
        for r in steady:
            for tag, ms in r:
                order.setdefault(tag, ms)
        med = {tag: statistics.median([ms for r in steady for t, ms in r if t == tag]) for tag in order}
        # each stage's own time in each call (from the stage just before it in that call's order): the
        # medians of the first column come from different calls, so their differences can mislead
        gaps: dict[str, list[float]] = collections.defaultdict(list)
        for r in steady:
            prev = 0.0
            for tag, ms in sorted(r, key=lambda x: x[1]):
                gaps[tag].append(ms - prev)
                prev = ms
        first = dict(rows[0])
        print(f"\n### {kind} ({len(rows)} calls; median of {len(steady)} after the first {len(rows) - len(steady)})")
        print("| stage | ms from start (median) | ms from the stage before, in each call (median / max) | first call |")
        print("| --- | ---: | ---: | ---: |")
        for tag in sorted(med, key=med.get):
            f = first.get(tag)
            g = gaps[tag]
            print(f"| {tag} | {med[tag]:.2f} | {statistics.median(g):.2f} / {max(g):.2f} | {'' if f is None else f'{f:.2f}'} |")
    if spills:
        print(spill_summary(a.file))


def spill_summary(path: str) -> str:
    """Spill batches: count, blocks, the span from the first one's start to the last one's end,
    the time some batch was in flight (the union of their windows), and the mean blocks in flight."""
    starts: dict[int, tuple[float, int]] = {}
    windows: list[tuple[float, float, int]] = []
    for e in sorted((json.loads(line) for line in open(path)), key=lambda e: e["t"]):
        if e["tag"].startswith("spill:"):
            starts[e["call"]] = (e["t"], int(e["tag"][6:]))
        elif e["tag"] == "written" and e["call"] in starts:
            t0, n = starts.pop(e["call"])
            windows.append((t0, e["t"], n))
    if not windows:
        return "\n(no spill batch was written)"
    windows.sort()
    span = max(b for _, b, _ in windows) - windows[0][0]
    busy, cur_a, cur_b = 0.0, windows[0][0], windows[0][1]
    for a, b, _ in windows[1:]:
        if a > cur_b:
            busy, cur_a, cur_b = busy + cur_b - cur_a, a, b
        else:
            cur_b = max(cur_b, b)
    busy += cur_b - cur_a
    blocks = sum(n for _, _, n in windows)
    in_flight = sum((b - a) * n for a, b, n in windows) / span if span > 0 else float("nan")
    return (f"\n### spills\n{len(windows)} batches, {blocks} blocks (mean {blocks / len(windows):.1f} a batch, "
            f"{1e3 * sum(b - a for a, b, _ in windows) / len(windows):.1f} ms each); span {1e3 * span:.0f} ms, "
            f"some batch in flight {1e3 * busy:.0f} ms ({busy / span if span > 0 else float('nan'):.0%}); "
            f"mean blocks in flight {in_flight:.1f}")


if __name__ == "__main__":
    main()
