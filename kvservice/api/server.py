"""The daemon process: BlockCache behind listeners with one job each.

  socket_path (Unix, 0600)         KVCache for sessions of the daemon's uid and root; Admin; health
  socket_path.reg (Unix, 0666)     registration: pool fd / IPC handle in, session secret out (registration.py)
  socket_path.lookup (Unix, 0666)  the Lookup channel: Lookup as plain frames, for sessions of the
                                   connecting uid only (SO_PEERCRED; lookup_channel.py)
  socket_path.uid<N> (Unix, 0600,  KVCache for sessions of allowed uid N only (allowed_uids)
                     owned by N)
  tcp_address (loopback)           health, reflection, read-only Admin (mutations: tcp_admin_mutations + token)
  metrics_address (loopback)       Prometheus /metrics

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
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import SERVICE_NAME as HEALTH_SERVICE_NAME
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from kvservice.api import convert
from kvservice.api.lookup_channel import LookupChannel
from kvservice.api.registration import RegistrationServer, UidPolicy, uid_listener
from kvservice.api.servicer_admin import AdminServicer
from kvservice.api.servicer_kvcache import KVCacheServicer
from kvservice.api.session_guard import SessionGuard
from kvservice.core.cache import BlockCache
from kvservice.core.clock import Clock, SystemClock
from kvservice.core.sessions_api import MAIN_LISTENER
from kvservice.ops.config import UNIX_PATH_MAX, Config, format_bytes, parse_uids
from kvservice.ops.metrics import make_registry, start_metrics_server
from kvwire.lookup_frames import lookup_socket_path
from kvwire.peer_socket import registration_path
from kvwire.v1 import admin_pb2, admin_pb2_grpc, kvcache_pb2, kvcache_pb2_grpc

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
    server: grpc.aio.Server  # the main Unix socket: data plane of the daemon's uid, Admin, health
    health: health_aio.HealthServicer
    address: str  # "unix:/path/to.sock", usable as a grpc target
    tcp_address: str | None  # "host:port" actually bound (port 0 in the config picks one)
    registry: CollectorRegistry
    metrics_address: str | None  # "host:port" of /metrics actually bound, None when off
    registration_path: str = ""  # the registration socket beside socket_path
    lookup_path: str = ""  # the Lookup channel's socket beside socket_path
    data_sockets: dict[int, str] = field(default_factory=dict)  # another allowed uid -> its data socket


def _prepare_socket_path(path: str, dir_mode: int = 0o700) -> None:
    """Create the directory and remove a stale socket, but never one a live daemon listens on."""
    directory = os.path.dirname(path) or "."
    try:
        os.makedirs(directory, mode=dir_mode, exist_ok=True)
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


def _let_others_reach(directory: str) -> None:
    """Other allowed uids must traverse the socket directory (not list it) to reach their sockets."""
    st = os.stat(directory)
    if st.st_mode & stat.S_IXOTH:
        return
    if st.st_uid != os.getuid():
        raise StartupError(f"allowed_uids: other uids cannot reach sockets in {directory} (mode "
                           f"{stat.S_IMODE(st.st_mode):o}, not searchable by others) and the daemon does not own it")
    os.chmod(directory, stat.S_IMODE(st.st_mode) | 0o011)
    log.info("socket directory %s made searchable (not listable) by other uids, for allowed_uids", directory)


def _bind_unix(server: grpc.aio.Server, path: str, owner: int | None = None) -> str:
    if len(os.fsencode(path)) > UNIX_PATH_MAX:
        raise StartupError(f"socket_path: {path} is longer than {UNIX_PATH_MAX} bytes (a Unix socket limit)")
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
    if owner is not None:
        try:
            os.chown(path, owner, -1)
        except OSError as e:
            raise StartupError(f"allowed_uids: cannot give uid {owner} its data socket {path} ({e.strerror}); "
                               "a daemon that serves other uids must run as root") from None
    return address


def _bind_tcp(server: grpc.aio.Server, address: str) -> str:
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as e:
        raise StartupError(f"tcp_address: cannot listen on {address}: {e}") from None
    return f"{address.rpartition(':')[0]}:{port}"


def data_socket_path(socket_path: str, uid: int) -> str:
    """The data socket of another allowed uid: beside socket_path, owned by that uid, mode 0600."""
    return f"{socket_path}.uid{uid}"


def _grpc_server(config: Config, interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()) -> grpc.aio.Server:
    # a request larger than the largest valid one is refused by gRPC before it is parsed
    receive = convert.max_request_bytes(config.max_batch_blocks)
    return grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", receive),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),  # a second daemon on the same TCP port must fail, not share it
        ],
    )


def _add_health(server: grpc.aio.Server, services: tuple[str, ...]) -> health_aio.HealthServicer:
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection((*services, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME), server)
    return health


def _log_startup(config: Config, cache: BlockCache, srv_address: str, tcp: str | None, recovered: int | None,
                 registration: str, data_sockets: dict[int, str]) -> None:
    log.info("kvservice listening on %s%s", srv_address, f" and tcp {tcp} (health, reflection, "
             f"{'Admin' if config.tcp_admin_mutations else 'read-only Admin'})" if tcp else "")
    log.info("registration socket %s; sessions for uid %d and root%s", registration, os.getuid(),
             "".join(f", uid {u} (data socket {p})" for u, p in data_sockets.items()))
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


async def _reap_forever(cache: BlockCache, registrar: RegistrationServer) -> None:
    while True:
        await asyncio.sleep(REAP_INTERVAL_S)
        try:
            reaped = cache.reap_sessions()
            registrar.prune()
        except Exception:
            log.exception("reap_sessions failed")
            continue
        if reaped:
            log.debug("%d sessions reaped: lease expired", len(reaped))


@contextlib.asynccontextmanager
async def running_server(
    config: Config, clock: Clock | None = None, cache: BlockCache | None = None
) -> AsyncIterator[RunningServer]:
    """Start cache, listeners (main Unix socket, registration socket, other uids' data sockets,
    TCP), health, reflection, reaper and metrics; on exit shut down in order.

    The config is used as given (load_config validates; tests build Config directly).
    """
    clock = clock or SystemClock()
    if cache is None:
        cache = BlockCache(config, clock)
    policy = UidPolicy(os.getuid(), tuple(u for u in parse_uids(config.allowed_uids) if u not in (os.getuid(), 0)))
    data_sockets = {uid: data_socket_path(config.socket_path, uid) for uid in policy.allowed_uids}

    # main Unix socket: the data plane of the daemon's own uid (and root), all of Admin, health
    main = _grpc_server(config, (SessionGuard(cache, MAIN_LISTENER),))
    kvcache_pb2_grpc.add_KVCacheServicer_to_server(KVCacheServicer(cache), main)
    admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(cache, config, clock, mutations=True), main)
    health = _add_health(main, (KVCACHE_SERVICE, ADMIN_SERVICE))
    servers: list[tuple[grpc.aio.Server, health_aio.HealthServicer, tuple[str, ...]]] = [
        (main, health, ("", KVCACHE_SERVICE, ADMIN_SERVICE))]
    # one data socket per other allowed uid: only that uid can open it, so calls there are its own
    uid_servers = []
    for uid in policy.allowed_uids:
        srv = _grpc_server(config, (SessionGuard(cache, uid_listener(uid)),))
        kvcache_pb2_grpc.add_KVCacheServicer_to_server(KVCacheServicer(cache), srv)
        servers.append((srv, _add_health(srv, (KVCACHE_SERVICE,)), ("", KVCACHE_SERVICE)))
        uid_servers.append((uid, srv))
    # TCP: operators only (health, reflection, Admin; mutating calls only with tcp_admin_mutations + token)
    tcp_server = None
    if config.tcp_address:
        tcp_server = _grpc_server(config)
        admin_pb2_grpc.add_AdminServicer_to_server(
            AdminServicer(cache, config, clock, mutations=config.tcp_admin_mutations, listener="TCP"), tcp_server)
        servers.append((tcp_server, _add_health(tcp_server, (ADMIN_SERVICE,)), ("", ADMIN_SERVICE)))

    def data_socket(listener: str) -> str:
        for uid, path in data_sockets.items():
            if listener == uid_listener(uid):
                return path
        return config.socket_path

    lookups = LookupChannel(cache, lookup_socket_path(config.socket_path), policy, config.max_batch_blocks)
    registrar = RegistrationServer(cache, registration_path(config.socket_path), policy, data_socket, lookups.path)
    # Bind before starting the cache: a daemon that finds its socket taken must not touch the disk tier.
    address = _bind_unix(main, config.socket_path)
    bound = [config.socket_path]
    metrics_server = None
    reaper: asyncio.Task[None] | None = None
    cache_started = False
    registrar_started = False
    try:
        _prepare_socket_path(registrar.path)
        registrar.bind()
        _prepare_socket_path(lookups.path)
        lookups.bind()
        if policy.allowed_uids:
            _let_others_reach(os.path.dirname(config.socket_path) or ".")
        for uid, srv in uid_servers:
            _bind_unix(srv, data_sockets[uid], owner=uid)
            bound.append(data_sockets[uid])
        tcp = _bind_tcp(tcp_server, config.tcp_address) if tcp_server is not None else None
        recovered = await cache.start()
        cache_started = True
        for srv, srv_health, names in servers:
            await srv.start()
            for name in names:
                await srv_health.set(name, health_pb2.HealthCheckResponse.SERVING)
        await lookups.start()  # before registration: every session it opens may use it at once
        registrar.start()
        registrar_started = True
        reaper = asyncio.create_task(_reap_forever(cache, registrar), name="kvservice-reaper")
        registry = make_registry(cache, asyncio.get_running_loop(), lookups.metrics)
        metrics = None
        if config.metrics_address:
            try:
                metrics_server, _thread = start_metrics_server(config.metrics_address, registry)
            except OSError as e:
                raise StartupError(f"metrics_address: cannot listen on {config.metrics_address}: {e}") from None
            metrics = f"{config.metrics_address.rpartition(':')[0]}:{metrics_server.server_port}"
        _log_startup(config, cache, address, tcp, recovered, registrar.path, data_sockets)
        yield RunningServer(config, cache, main, health, address, tcp, registry, metrics, registrar.path, lookups.path,
                            data_sockets)
        log.info("shutting down: NOT_SERVING, finishing in-flight requests")
        for _srv, srv_health, _names in servers:
            await srv_health.enter_graceful_shutdown()
    finally:
        if registrar_started or registrar._sock is not None:
            await registrar.stop()
        # the frames channel's running Stores and Loads answer within the same grace as gRPC calls
        await asyncio.gather(lookups.stop(grace=STOP_GRACE_S), *(srv.stop(grace=STOP_GRACE_S) for srv, _, _ in servers))
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
        for path in bound:
            with contextlib.suppress(FileNotFoundError):  # grpc removes it on stop; this covers a failed start
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    os.unlink(path)
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
