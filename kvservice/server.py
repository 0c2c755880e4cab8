"""The daemon process: BlockCache behind a grpc.aio server on a Unix socket (and optionally TCP).

`running_server` is the whole lifecycle as an async context manager (tests use it in-process);
`serve` adds signal handling for the real daemon: SIGTERM/SIGINT -> health NOT_SERVING, stop
accepting, finish in-flight RPCs, drain queued disk writes, exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import stat
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import SERVICE_NAME as HEALTH_SERVICE_NAME
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from kvservice.cache import BlockCache
from kvservice.clock import Clock, SystemClock
from kvservice.config import Config, format_bytes
from kvservice.metrics import make_registry, start_metrics_server
from kvservice.servicer_admin import AdminServicer
from kvservice.servicer_kvcache import KVCacheServicer
from kvservice.v1 import admin_pb2, admin_pb2_grpc, kvcache_pb2, kvcache_pb2_grpc

log = logging.getLogger(__name__)

KVCACHE_SERVICE = kvcache_pb2.DESCRIPTOR.services_by_name["KVCache"].full_name
ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name
REAP_INTERVAL_S = 0.5
STOP_GRACE_S = 5.0
MAX_MESSAGE_BYTES = 64 << 20  # a Store of max_batch_blocks refs is ~0.4 MiB; this is headroom, not a target


class StartupError(Exception):
    """The daemon cannot start for a reason outside the configuration's values (e.g. socket in use)."""


@dataclass
class RunningServer:
    config: Config
    cache: BlockCache
    server: grpc.aio.Server
    health: health_aio.HealthServicer
    address: str  # "unix:/path/to.sock", usable as a grpc target
    tcp_address: str | None  # "host:port" actually bound (port 0 in the config picks one)
    registry: CollectorRegistry
    metrics_address: str | None  # "host:port" of /metrics actually bound, None when off


def _prepare_socket_path(path: str) -> None:
    """Create the directory (0700) and remove a stale socket, but never one a live daemon listens on."""
    directory = os.path.dirname(path) or "."
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except OSError as e:
        raise StartupError(f"socket_path: cannot create directory {directory}: {e}") from None
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise StartupError(f"socket_path: {path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError as e:
        if e.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise StartupError(f"socket_path: cannot probe existing socket {path}: {e}") from None
        os.unlink(path)  # stale: left behind by a daemon that did not exit cleanly
        log.info("removed stale socket %s", path)
    else:
        raise StartupError(f"socket_path: another process is already listening on {path}")
    finally:
        probe.close()


def _bind_unix(server: grpc.aio.Server, path: str) -> str:
    _prepare_socket_path(path)
    address = f"unix:{path}"
    # grpc binds during add_insecure_port; the umask makes the socket 0600 from its first instant.
    old = os.umask(0o177)
    try:
        server.add_insecure_port(address)
    except RuntimeError as e:
        raise StartupError(f"socket_path: cannot listen on {path}: {e}") from None
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    return address


def _bind_tcp(server: grpc.aio.Server, address: str) -> str:
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as e:
        raise StartupError(f"tcp_address: cannot listen on {address}: {e}") from None
    return f"{address.rpartition(':')[0]}:{port}"


def _log_startup(config: Config, cache: BlockCache, srv_address: str, tcp: str | None, recovered: int | None) -> None:
    log.info("kvservice listening on %s%s", srv_address, f" and tcp {tcp}" if tcp else "")
    log.info("io backend: %s (requested %s)", cache.io_backend_name, config.io_backend)
    tiers = {str(t.get("name")): t for t in cache.tier_stats()}
    log.info("host tier: %s", format_bytes(config.host_capacity_bytes))
    if config.has_disk:
        disk = tiers.get("disk", {})
        log.info(
            "disk tier: %s at %s; recovered %d blocks (%s in use)",
            format_bytes(config.disk_capacity_bytes),
            config.disk_path,
            recovered if isinstance(recovered, int) else int(disk.get("blocks", 0)),
            format_bytes(int(disk.get("used_bytes", 0))),
        )
    else:
        log.info("disk tier: off")
    log.info(
        "admission gate: %s; protect_unexpired=%s; write queue %d (%s), %d writers, %d readers",
        config.admission_gate,
        config.protect_unexpired,
        config.write_queue_depth,
        config.write_queue_policy,
        config.writer_threads,
        config.reader_threads,
    )


async def _reap_forever(cache: BlockCache) -> None:
    while True:
        await asyncio.sleep(REAP_INTERVAL_S)
        try:
            reaped = cache.reap_sessions()
        except Exception:
            log.exception("reap_sessions failed")
            continue
        for session_id in reaped:
            log.debug("session %s reaped: lease expired", session_id)


@contextlib.asynccontextmanager
async def running_server(
    config: Config, clock: Clock | None = None, cache: BlockCache | None = None
) -> AsyncIterator[RunningServer]:
    """Start cache, gRPC listeners, health, reflection, reaper and metrics; on exit shut down in order.

    The config is used as given (load_config validates; tests build Config directly).
    """
    clock = clock or SystemClock()
    if cache is None:
        cache = BlockCache(config, clock)
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),  # a second daemon on the same TCP port must fail, not share it
        ]
    )
    kvcache_pb2_grpc.add_KVCacheServicer_to_server(KVCacheServicer(cache), server)
    admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(cache, config, clock), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection((KVCACHE_SERVICE, ADMIN_SERVICE, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME), server)
    # Bind before starting the cache: a daemon that finds its socket taken must not touch the disk tier.
    address = _bind_unix(server, config.socket_path)
    metrics_server = None
    reaper: asyncio.Task[None] | None = None
    cache_started = False
    try:
        tcp = _bind_tcp(server, config.tcp_address) if config.tcp_address else None
        recovered = await cache.start()
        cache_started = True
        await server.start()
        for name in ("", KVCACHE_SERVICE, ADMIN_SERVICE):
            await health.set(name, health_pb2.HealthCheckResponse.SERVING)
        reaper = asyncio.create_task(_reap_forever(cache), name="kvservice-reaper")
        registry = make_registry(cache, asyncio.get_running_loop())
        metrics = None
        if config.metrics_address:
            try:
                metrics_server, _thread = start_metrics_server(config.metrics_address, registry)
            except OSError as e:
                raise StartupError(f"metrics_address: cannot listen on {config.metrics_address}: {e}") from None
            metrics = f"{config.metrics_address.rpartition(':')[0]}:{metrics_server.server_port}"
        _log_startup(config, cache, address, tcp, recovered)
        yield RunningServer(config, cache, server, health, address, tcp, registry, metrics)
        log.info("shutting down: NOT_SERVING, finishing in-flight requests")
        await health.enter_graceful_shutdown()
    finally:
        await server.stop(grace=STOP_GRACE_S)
        if reaper is not None:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
        if cache_started:
            log.info("draining queued disk writes")
            await cache.drain_and_stop()
        if metrics_server is not None:
            metrics_server.shutdown()  # type: ignore[attr-defined]
            metrics_server.server_close()  # type: ignore[attr-defined]
        with contextlib.suppress(FileNotFoundError):  # grpc removes it on stop; this covers a failed start
            if stat.S_ISSOCK(os.lstat(config.socket_path).st_mode):
                os.unlink(config.socket_path)
        log.info("kvservice stopped")


async def serve(
    config: Config,
    clock: Clock | None = None,
    cache: BlockCache | None = None,
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Run until `stop` is set, or, when no `stop` is given, until SIGTERM or SIGINT."""
    loop = asyncio.get_running_loop()
    handled: list[signal.Signals] = []
    if stop is None:
        stop = asyncio.Event()

        def on_signal(sig: signal.Signals) -> None:
            if stop.is_set():
                log.warning("%s again during shutdown: exiting without draining", sig.name)
                os._exit(128 + sig)
            log.info("%s received", sig.name)
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
                loop.add_signal_handler(sig, on_signal, sig)
                handled.append(sig)
    try:
        async with running_server(config, clock, cache):
            if ready is not None:
                ready.set()
            await stop.wait()
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
