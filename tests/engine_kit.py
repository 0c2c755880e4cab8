"""Drive tests/engine_proc.py engine processes from a test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class EngineProc:
    def __init__(self, target: str, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "engine_proc.py"), target, *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
        self.hello = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"engine process exited ({self.proc.wait(5)})")
        return json.loads(line)

    def send(self, op: str, **kw) -> None:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()

    def call(self, op: str, **kw) -> dict:
        self.send(op, **kw)
        return self._read()

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("exit")
                self.proc.wait(10)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> "EngineProc":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
