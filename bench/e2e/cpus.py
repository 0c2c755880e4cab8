"""CPU placement for the end-to-end benchmark (--pin-cpus).

The reference engine's decode is bound by its loop thread's Python (one forward per sequence per token:
~30-40 ms of kernel launches on the 8B shape), so an engine whose loop thread shares a physical core with
a busy daemon or benchmark thread decodes slower for reasons that have nothing to do with the service.
On the H200 host, runs of identical code moved the decode step between 33 and 43 ms. Pinned, each engine
owns whole physical cores (all their hyperthreads) and the daemons, the benchmark client and everything
else share the rest, as a deployment would place a latency-critical engine.
"""

from __future__ import annotations

import os
from pathlib import Path


def physical_cores() -> list[list[int]]:
    """The CPUs this process may use, grouped by physical core (hyperthread siblings together)."""
    mine = sorted(os.sched_getaffinity(0))
    groups: dict[str, list[int]] = {}
    for c in mine:
        f = Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list")
        key = f.read_text().strip() if f.exists() else str(c)
        groups.setdefault(key, []).append(c)
    return sorted(groups.values())


def plan(engines: list[str], cores_each: int = 1) -> tuple[dict[str, set[int]], set[int]]:
    """({engine: its CPUs}, the CPUs left for daemons and the client); raises when too few cores."""
    cores = physical_cores()
    need = len(engines) * cores_each
    if len(cores) < need + 2:
        raise RuntimeError(f"--pin-cpus needs {need + 2} physical cores ({cores_each} per engine and 2 for the "
                           f"rest); this process may use {len(cores)}")
    out: dict[str, set[int]] = {}
    for i, key in enumerate(engines):
        out[key] = {c for core in cores[i * cores_each:(i + 1) * cores_each] for c in core}
    rest = {c for core in cores[need:] for c in core}
    return out, rest
