"""The model-runner process harness: one `python -m model_runner` subprocess, shared by tests,
benchmarks and the demo.

    r = ModelRunner(["--service", d.target, "--model", "tiny"], log_path=w / "runner.log")
    r.wait_ready()                     # waits for "model-runner listening on http://HOST:PORT"
    r.request("POST", "/v1/completions", body)  -> (status, headers, body bytes)
    r.stop()                           # SIGTERM: the runner flushes its stores and closes its session
"""

from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from harness.daemon import ROOT, child_env, pin, short_tmpdir

LISTENING = re.compile(r"model-runner listening on (http://\S+)")


class ModelRunner:
    def __init__(self, args: list[str], *, log_path: Path | None = None, env: dict[str, str] | None = None,
                 cpus: set[int] | None = None) -> None:
        """Starts the process at once (several runners can start in parallel); wait_ready() waits.
        `--port 0` is added unless args name a port. cpus: the CPUs it may run on (default: any)."""
        self.dir = None if log_path is not None else short_tmpdir("mr")
        self.log_path = log_path if log_path is not None else self.dir / "runner.log"
        self.argv = [sys.executable, "-m", "model_runner", *args]
        if "--port" not in args:
            self.argv += ["--port", "0"]
        self.url = ""
        self.t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=log, text=True, cwd=str(ROOT),
                                         env=child_env(env), preexec_fn=pin(cpus))
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:  # a thread, so that waiting for the listening line can time out
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def wait_ready(self, timeout: float = 60.0) -> float:
        """Wait for the listening line; returns seconds since the start."""
        deadline = self.t0 + timeout
        while not self.url:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.kill()
                raise TimeoutError(f"model runner not listening {timeout:.0f} s after it started:\n"
                                   f"{self.log()[-3000:]}") from None
            if line is None:
                raise RuntimeError(f"model runner exited with {self.proc.wait(10)}:\n{self.log()[-3000:]}")
            m = LISTENING.search(line)
            if m:
                self.url = m.group(1)
        return time.monotonic() - self.t0

    @property
    def pid(self) -> int:
        return self.proc.pid

    def request(self, method: str, path: str, body: bytes | dict | None = None,
                headers: dict[str, str] | None = None, timeout: float = 60.0) -> tuple[int, dict, bytes]:
        """One HTTP request on a fresh connection: (status, headers, body)."""
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        hdrs = {"Content-Type": "application/json", **(headers or {})} if data is not None else (headers or {})
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=hdrs)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()

    def complete(self, prompt: list[int] | str, max_tokens: int = 8, **extra) -> dict:
        """POST /v1/completions, greedy; the parsed JSON reply (raises on a non-200 answer)."""
        status, _, raw = self.request("POST", "/v1/completions",
                                      {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra})
        if status != 200:
            raise RuntimeError(f"model runner: HTTP {status}: {raw[:300]!r}")
        return json.loads(raw)

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM (the runner stops its HTTP server, flushes stores, closes its session) and wait."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(5)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int) -> list[str]:
        return self.log().splitlines()[-n:]

    def __enter__(self) -> "ModelRunner":
        self.wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
