"""Drive harness/engine_proc.py engine processes (one JSON command a line) from a test or a benchmark.

    with EngineProc(d.target, "--blocks", "64") as e:          # shm pool
        e.call("store", numbers=[0, 1])
    g = EngineProc(d.target, "--pool", "cuda", "--layout", "layer-first", "--layers", "4")
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from harness.daemon import ROOT, child_env


class EngineProc:
    def __init__(self, target: str, *args: str, env: dict[str, str] | None = None, require_ready: bool = False) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "harness.engine_proc", target, *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=child_env(env), cwd=str(ROOT))
        self.hello = self._read()
        if require_ready:
            assert self.hello.get("ready"), self.hello

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
                self.proc.wait(20)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> "EngineProc":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
