"""Tests use the shared process harness (harness/daemon.py); this name stays for their imports."""

from harness.daemon import ROOT, Daemon, free_tcp_port, short_tmpdir

__all__ = ["ROOT", "Daemon", "free_tcp_port", "short_tmpdir"]
