"""Tests use the shared engine-process harness (harness/engine.py); this name stays for their imports."""

from harness.engine import EngineProc

__all__ = ["EngineProc"]
