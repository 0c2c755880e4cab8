"""Clocks are injected: retention deadlines, leases and reaping take `now` from one of these.

Deadlines are unix seconds (they are persisted on disk and must survive a restart), so the
system clock is wall time. Tests advance a FakeClock instead of sleeping.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since the epoch."""
        ...


class SystemClock:
    def now(self) -> float:
        return time.time()


class FakeClock:
    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += seconds
