"""Counters and latency histograms kept by the core; Admin.Stats and /metrics read them.

Field names match kvservice.v1.Counters so the servicer copies them by name.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, fields

# Store/Load latency buckets (seconds): 50 us .. 10 s
LATENCY_BOUNDS: tuple[float, ...] = (
    5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)


@dataclass(slots=True)
class Counters:
    stores: int = 0  # blocks stored (new)
    store_hits: int = 0  # blocks already present at Store
    loads_host: int = 0
    loads_disk: int = 0
    load_misses: int = 0
    load_failures: int = 0
    spills: int = 0  # host victims written to disk
    disk_onboards: int = 0  # disk blocks read back into the host tier
    host_evictions: int = 0
    disk_evictions_unmarked: int = 0
    disk_evictions_expired: int = 0
    disk_evictions_retained: int = 0
    drops_gate: int = 0
    drops_pressure: int = 0
    drops_no_disk: int = 0
    admission_refusals: int = 0
    retain_cap_refusals: int = 0
    checksum_failures: int = 0
    io_errors: int = 0
    prefetch_staged: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0
    evictions_admin: int = 0

    @property
    def blocks_offloaded(self) -> int:
        return self.stores

    @property
    def blocks_loaded_back(self) -> int:
        return self.loads_host + self.loads_disk

    @property
    def recovery_rate(self) -> float:
        return self.blocks_loaded_back / self.blocks_offloaded if self.blocks_offloaded else 0.0

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["blocks_offloaded"] = self.blocks_offloaded
        out["blocks_loaded_back"] = self.blocks_loaded_back
        out["recovery_rate"] = self.recovery_rate
        return out


@dataclass(slots=True)
class Histogram:
    name: str
    bounds: tuple[float, ...] = LATENCY_BOUNDS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BOUNDS) + 1))
    count: int = 0
    sum: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.count += 1
        self.sum += seconds


class CounterSet:
    """Global counters plus one Counters per namespace; `bump` adds to both."""

    def __init__(self) -> None:
        self.total = Counters()
        self.by_namespace: dict[str, Counters] = {}

    def ns(self, namespace: str) -> Counters:
        c = self.by_namespace.get(namespace)
        if c is None:
            c = self.by_namespace[namespace] = Counters()
        return c

    def bump(self, namespace: str, name: str, n: int = 1) -> None:
        setattr(self.total, name, getattr(self.total, name) + n)
        c = self.ns(namespace)
        setattr(c, name, getattr(c, name) + n)
