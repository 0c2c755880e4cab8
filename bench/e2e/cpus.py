"""CPU placement for the end-to-end benchmark (--pin-cpus).

The reference engine's decode is bound by its loop thread's Python (one forward per sequence per token:
~30-40 ms of kernel launches on the 8B shape), so an engine whose loop thread shares a physical core with
a busy daemon or benchmark thread decodes slower for reasons that have nothing to do with the service.
On the H200 host, runs of identical code moved the decode step between 33 and 43 ms. Pinned, each engine
owns whole physical cores (all their hyperthreads, at least two logical CPUs) and the daemons, the
benchmark client and everything else share the rest, as a deployment would place a latency-critical
engine. Measured once on the H200 with one vCPU per engine (that host shows no hyperthread siblings):
the decode step did not settle (prefetch 0: 30.3 ms, prefetch 4: 44.3 ms in the same run), so pinning
is not the cure for the run-to-run spread; the two-CPU placement has not been measured.
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


MIN_CPUS_PER_ENGINE = 2  # the loop thread and the rest (HTTP, KVClient loop, gRPC): one vCPU shared by all of them
# made the H200 run's service engine decode 4% slower than the engine alone (29.8 vs 28.7 ms a step; unpinned: equal)


def plan(engines: list[str]) -> tuple[dict[str, set[int]], set[int]]:
    """({engine: its CPUs}, the CPUs left for daemons and the client): each engine gets whole physical
    cores, at least MIN_CPUS_PER_ENGINE logical CPUs; raises when too few cores."""
    cores = physical_cores()
    per_core = max(1, min(len(c) for c in cores))
    cores_each = -(-MIN_CPUS_PER_ENGINE // per_core)
    need = len(engines) * cores_each
    if len(cores) < need + 2:
        raise RuntimeError(f"--pin-cpus needs {need + 2} physical cores ({cores_each} per engine and 2 for the "
                           f"rest); this process may use {len(cores)}")
    out: dict[str, set[int]] = {}
    for i, key in enumerate(engines):
        out[key] = {c for core in cores[i * cores_each:(i + 1) * cores_each] for c in core}
    rest = {c for core in cores[need:] for c in core}
    return out, rest
