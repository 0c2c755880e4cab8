"""A real kvservice daemon in a subprocess, for tests that cross the wire or kill processes.

    d = Daemon(disk_capacity="1MiB").start()      # waits until grpc.health.v1 says SERVING
    d.stats()                                      # Admin.Stats over the Unix socket
    d.kill9(); d.start()                           # crash and restart on the same disk tier
    d.stop()                                       # SIGTERM, waits for a clean exit
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvservice.v1 import admin_pb2, admin_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def short_tmpdir(prefix: str = "kvt") -> Path:
    """Unix socket paths must stay under ~107 bytes; pytest's tmp_path can be longer."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


class Daemon:
    def __init__(self, workdir: Path | None = None, *, host_capacity: str = "1MiB", disk_capacity: str = "4MiB",
                 tcp: bool = False, extra: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        self.dir = workdir or short_tmpdir()
        self._own_dir = workdir is None
        self.socket_path = str(self.dir / "kv.sock")
        self.disk_path = str(self.dir / "disk")
        self.target = f"unix://{self.socket_path}"
        self.tcp_address = f"127.0.0.1:{free_tcp_port()}" if tcp else ""
        self.args = ["--socket-path", self.socket_path, "--host-capacity", host_capacity, "--io-backend", "posix",
                     "--lease-seconds", "2", "--log-level", "info"]
        if disk_capacity:
            self.args += ["--disk-path", self.disk_path, "--disk-capacity", disk_capacity]
        if tcp:
            self.args += ["--tcp", self.tcp_address]
        self.args += extra or []
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.log_path = self.dir / "daemon.log"

    def start(self, timeout: float = 30.0) -> "Daemon":
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvservice", "serve", *self.args],
                                     stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=str(ROOT))
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            if os.path.exists(self.socket_path) and self.serving():
                return self
            time.sleep(0.05)
        raise TimeoutError(f"daemon not serving after {timeout}s:\n{self.log()}")

    def serving(self) -> bool:
        try:
            with grpc.insecure_channel(self.target) as ch:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                return r.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def admin(self, method: str, request=None, **kw):
        with grpc.insecure_channel(self.target) as ch:
            stub = admin_pb2_grpc.AdminStub(ch)
            req = request if request is not None else getattr(admin_pb2, f"{method}Request")(**kw)
            return getattr(stub, method)(req, timeout=10)

    def stats(self) -> admin_pb2.StatsReply:
        return self.admin("Stats")

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            raise

    def close(self) -> None:
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(5)
        finally:
            if self._own_dir:
                shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "Daemon":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
