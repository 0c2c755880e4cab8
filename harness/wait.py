"""Polling for a condition that another process brings about (a spill landing, a session reaped)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float = 20.0, what: str = "condition") -> T:
    """Call predicate every 50 ms until it returns something truthy, and return that; fail the test
    with `what` in the message after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)
