"""The one kvservice daemon process harness, shared by tests, benchmarks and the demo.

    d = Daemon(host_capacity="1MiB", disk_capacity="4MiB").start()   # waits for grpc.health.v1 SERVING
    d.stats()                                      # Admin.Stats over the Unix socket
    d.kill9(); d.start()                           # crash and restart on the same disk tier
    d.stop()                                       # SIGTERM, waits for a clean exit
    with Daemon(workdir=w, tag="host", ...) as d:  # start on enter; SIGTERM, then kill, on exit

A real `python -m kvservice serve` subprocess over a real Unix socket: nothing in here talks to the
daemon except through its public gRPC surface.
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

ROOT = Path(__file__).resolve().parent.parent


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def short_tmpdir(prefix: str = "kvt") -> Path:
    """Unix socket paths must stay under ~107 bytes; pytest's tmp_path can be longer."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def pin(cpus: set[int] | None):
    """A Popen preexec_fn that confines the child to `cpus` (None when no pinning is asked)."""
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child process: this checkout first on PYTHONPATH, the caller's after it
    (a GPU host's carried wheels live there)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **(extra or {})}


class Daemon:
    def __init__(self, workdir: Path | None = None, *, tag: str = "", host_capacity: str | int = "1MiB",
                 disk_capacity: str | int = "4MiB", disk_path: str = "", tcp: bool | int = False,
                 io_backend: str = "posix", lease_seconds: float | None = 2, log_level: str = "info",
                 extra: list[str] | None = None, env: dict[str, str] | None = None,
                 cpus: set[int] | None = None) -> None:
        """tcp: False (none), True (a free loopback port) or a port number. disk_capacity 0 or "":
        no disk tier. disk_path defaults to <workdir>/disk[-tag]."""
        self.dir = Path(workdir) if workdir is not None else short_tmpdir()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._own_dir = workdir is None
        suffix = f"-{tag}" if tag else ""
        self.socket_path = str(self.dir / f"kv{suffix}.sock")
        self.disk_path = disk_path or str(self.dir / f"disk{suffix}")
        self.target = f"unix://{self.socket_path}"
        port = free_tcp_port() if tcp is True else int(tcp)
        self.tcp_address = f"127.0.0.1:{port}" if port else ""
        self.args = ["--socket-path", self.socket_path, "--host-capacity", str(host_capacity),
                     "--io-backend", io_backend, "--log-level", log_level]
        if lease_seconds is not None:
            self.args += ["--lease-seconds", str(lease_seconds)]
        if disk_capacity:
            self.args += ["--disk-path", self.disk_path, "--disk-capacity", str(disk_capacity)]
        if self.tcp_address:
            self.args += ["--tcp", self.tcp_address]
        self.args += extra or []
        self.env = child_env(env)
        self.cpus = cpus  # the CPUs it may run on (None: any)
        self.proc: subprocess.Popen | None = None
        self.log_path = self.dir / f"daemon{suffix}.log"
        self.start_seconds = 0.0  # how long the last start() took to reach SERVING

    # --- process
    def start(self, timeout: float = 30.0) -> "Daemon":
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvservice", "serve", *self.args],
                                         stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=str(ROOT),
                                         preexec_fn=pin(self.cpus))
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            if os.path.exists(self.socket_path) and self.serving():
                self.start_seconds = time.monotonic() - t0
                return self
            time.sleep(0.05)
        raise TimeoutError(f"daemon not SERVING {timeout:.0f} s after it started:\n{self.log()[-4000:]}")

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait for the exit status (the daemon drains its disk writes first)."""
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
        return self.start(timeout=120)

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop(timeout=120)
        finally:
            self.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    # --- the daemon's public surface
    def health(self) -> str:
        """grpc.health.v1 status name, or UNREACHABLE."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            with grpc.insecure_channel(self.target) as ch:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
        except grpc.RpcError:
            return "UNREACHABLE"

    def serving(self) -> bool:
        return self.health() == "SERVING"

    def admin(self, method: str, request=None, timeout: float = 30, **kw):
        """One Admin call over the Unix socket: d.admin("Evict", all=True)."""
        import grpc

        from kvwire.v1 import admin_pb2, admin_pb2_grpc

        with grpc.insecure_channel(self.target) as ch:
            req = request if request is not None else getattr(admin_pb2, f"{method}Request")(**kw)
            return getattr(admin_pb2_grpc.AdminStub(ch), method)(req, timeout=timeout)

    def stats(self):
        return self.admin("Stats")

    def evict_all(self) -> int:
        return int(self.admin("Evict", all=True).evicted_blocks)

    def evict_namespace(self, namespace_id: str) -> int:
        return int(self.admin("Evict", namespace_id=namespace_id).evicted_blocks)

    def settle(self, timeout: float = 30.0):
        """Poll Stats until no disk write or read is queued or running; returns that Stats reply
        (also when the timeout ran out: check its queue depths)."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            busy = s.write_queue_depth + s.read_queue_depth + getattr(s, "writes_in_progress", 0)
            if busy == 0 or time.monotonic() > deadline:
                return s
            time.sleep(0.05)
