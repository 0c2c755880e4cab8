"""Exponential backoff with jitter for re-attaching to a restarting daemon."""

from __future__ import annotations

import random


class Backoff:
    """Delays initial, 2*initial, ... capped at `cap`; each drawn uniformly from [d/2, d].

    The jitter keeps many engines on one node from re-attaching in lockstep after a restart.
    """

    __slots__ = ("initial", "cap", "_next", "_rng")

    def __init__(self, initial: float = 0.05, cap: float = 2.0, rng: random.Random | None = None) -> None:
        if not 0 < initial <= cap:
            raise ValueError(f"need 0 < initial ({initial}) <= cap ({cap})")
        self.initial = initial
        self.cap = cap
        self._next = initial
        self._rng = rng or random.Random()

    def next(self) -> float:
        """The next delay in seconds."""
        d = self._next
        self._next = min(self.cap, d * 2)
        return d / 2 + self._rng.random() * d / 2

    def reset(self) -> None:
        self._next = self.initial
