"""The registration socket: where an engine hands the daemon its pool and gets a session back.

Beside the gRPC socket (`<socket_path>.reg`, mode 0666: anyone may knock, the daemon decides) a
plain Unix stream socket takes one frame per connection (peer_socket): an OpenSessionRequest,
with the pool's shared-memory file descriptor attached as SCM_RIGHTS (CUDA pools send their IPC
handle in the request and no descriptor). The kernel names the peer (SO_PEERCRED); the daemon

  1. refuses a uid it does not serve (not its own, not root, not in allowed_uids),
  2. maps exactly the memory that came over this connection (never a name it would open),
  3. opens a session bound to that peer and its uid's data listener, and
  4. answers with a RegistrationReply carrying the session id: a secret only this peer learns.

The connection then stays open as the session's lease: when the engine closes it or dies, the
session is closed at once (heartbeats over gRPC still keep a live but quiet engine's lease).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from kvservice.api import convert
from kvservice.core.cache import BlockCache
from kvwire.peer_socket import (
    FrameError,
    PeerCred,
    peer_credentials,
    recv_frame,
    send_frame,
)
from kvservice.core.sessions_api import MAIN_LISTENER, Peer
from kvservice.core.types import CacheError, ErrorCode
from kvwire.v1 import kvcache_pb2

log = logging.getLogger(__name__)

HANDSHAKE_SECONDS = 10.0  # a peer that connects and sends nothing is dropped after this
FRAME_SECONDS = 2.0  # once the first bytes are there, the rest of the frame must follow within this
MAX_PENDING_PER_UID = 8  # handshakes in progress per uid: a flood of idle connects costs one uid only
HANDSHAKE_THREADS = 2  # frame reads and replies run here, never on the pool the cache's closes use


@dataclass(frozen=True, slots=True)
class UidPolicy:
    """Which uids may open sessions, and which data listener serves each."""

    daemon_uid: int
    allowed_uids: tuple[int, ...]

    def listener(self, uid: int) -> str | None:
        """The data listener for this uid; None when the uid may not open sessions."""
        if uid in (self.daemon_uid, 0):
            return MAIN_LISTENER
        if uid in self.allowed_uids:
            return uid_listener(uid)
        return None


def uid_listener(uid: int) -> str:
    return f"uid{uid}"


class RegistrationServer:
    def __init__(self, cache: BlockCache, path: str, policy: UidPolicy, data_socket: Callable[[str], str],
                 lookup_socket: str = "") -> None:
        """`data_socket(listener)` is the socket path a session of that listener sends its calls to;
        `lookup_socket` the Lookup channel's (lookup_channel.py), told to every session ("": none)."""
        self._cache = cache
        self.path = path
        self._policy = policy
        self._data_socket = data_socket
        self._lookup_socket = lookup_socket
        self._sock: socket.socket | None = None
        self._pending: Counter[int] = Counter()
        self._leases: dict[str, socket.socket] = {}  # session id -> its registration connection
        self._tasks: set[asyncio.Task] = set()
        self._io = ThreadPoolExecutor(HANDSHAKE_THREADS, thread_name_prefix="kv-registration")

    # --- lifecycle
    def bind(self) -> None:
        """Create the listening socket (the caller has prepared the directory and removed a stale file)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o111)
        try:
            sock.bind(self.path)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o666)  # reaching it proves nothing: the daemon decides by SO_PEERCRED
        sock.listen(64)
        sock.setblocking(False)
        self._sock = sock

    def start(self) -> None:
        assert self._sock is not None
        asyncio.get_running_loop().add_reader(self._sock.fileno(), self._accept)

    async def stop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._sock is not None:
            loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for conn in self._leases.values():
            self._drop(conn)
        self._leases.clear()
        self._io.shutdown(wait=False)

    def prune(self) -> int:
        """Close the registration connections of sessions that ended another way (CloseSession,
        lease reaped). Returns how many were closed."""
        gone = [sid for sid in self._leases if self._cache.session_peer(sid) is None]
        for sid in gone:
            self._drop(self._leases.pop(sid))
        return len(gone)

    # --- one connection
    def _accept(self) -> None:
        assert self._sock is not None
        while True:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.warning("registration socket: accept failed: %s", e)
                return
            task = asyncio.get_running_loop().create_task(self._handshake(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _handshake(self, conn: socket.socket) -> None:
        try:
            cred = peer_credentials(conn)
        except OSError as e:
            log.info("registration: no peer credentials (%s); dropping the connection", e)
            conn.close()
            return
        if self._pending[cred.uid] >= MAX_PENDING_PER_UID:
            log.warning("registration: uid %d has %d handshakes in progress; dropping a connection", cred.uid,
                        self._pending[cred.uid])
            conn.close()
            return
        self._pending[cred.uid] += 1
        keep = False
        try:
            loop = asyncio.get_running_loop()
            try:
                # an idle peer costs no thread: wait for its first bytes on the event loop
                await asyncio.wait_for(_readable(loop, conn), HANDSHAKE_SECONDS)
                conn.setblocking(True)
                conn.settimeout(FRAME_SECONDS)
                payload, fds = await loop.run_in_executor(self._io, recv_frame, conn)
            except (OSError, FrameError, asyncio.TimeoutError) as e:
                log.info("registration: uid %d pid %d sent no registration: %s", cred.uid, cred.pid,
                         e or type(e).__name__)
                return
            reply, sid = self._register(cred, payload, fds)
            try:
                await loop.run_in_executor(self._io, send_frame, conn, reply.SerializeToString())
            except OSError as e:
                log.info("registration: reply to uid %d pid %d failed: %s", cred.uid, cred.pid, e)
                if sid:
                    await self._close_session(sid)
                return
            if sid:
                keep = True
                self._hold(sid, conn)
        finally:
            self._pending[cred.uid] -= 1
            if not self._pending[cred.uid]:
                del self._pending[cred.uid]
            if not keep:
                conn.close()

    def _register(self, cred: PeerCred, payload: bytes, fds: list[int]) -> tuple[kvcache_pb2.RegistrationReply, str]:
        """Open the session; every descriptor in `fds` is consumed (mapped or closed)."""
        try:
            listener = self._policy.listener(cred.uid)
            if listener is None:
                raise CacheError(ErrorCode.PERMISSION_DENIED,
                                 f"uid {cred.uid} may not open sessions on this daemon (it serves its own uid, "
                                 "root and allowed_uids)")
            if len(fds) > 1:
                raise CacheError(ErrorCode.INVALID_ARGUMENT, f"a registration carries at most one descriptor, got {len(fds)}")
            request = kvcache_pb2.OpenSessionRequest()
            try:
                request.ParseFromString(payload)
            except DecodeError:
                raise CacheError(ErrorCode.INVALID_ARGUMENT, "the registration frame is not an OpenSessionRequest") from None
            shm_fd = fds.pop() if fds and request.pool.WhichOneof("handle") == "shm" else -1
            try:
                ns = convert.namespace_spec(request)
                pool = convert.pool_spec(request, shm_fd)
                name = convert.client_name(request)
            except BaseException:
                if shm_fd >= 0:
                    os.close(shm_fd)
                raise
            peer = Peer(cred.uid, cred.gid, cred.pid, listener)
            opened = self._cache.open_session(ns, pool, request.hash_canary, name, peer)  # consumes shm_fd
        except CacheError as e:
            log.info("registration of uid %d pid %d refused: %s: %s", cred.uid, cred.pid, e.code.value, e.message)
            return kvcache_pb2.RegistrationReply(code=e.code.value, message=e.message), ""
        except Exception as e:  # a core bug must not take the socket down, but must be visible
            log.exception("registration of uid %d pid %d failed", cred.uid, cred.pid)
            return kvcache_pb2.RegistrationReply(code="INTERNAL", message=f"internal error: {type(e).__name__}"), ""
        finally:
            for fd in fds:
                os.close(fd)
        session = convert.open_session_reply(opened)
        session.data_socket = self._data_socket(listener)
        session.lookup_socket = self._lookup_socket
        return kvcache_pb2.RegistrationReply(session=session), opened.session_id

    # --- the open connection is the session's lease
    def _hold(self, sid: str, conn: socket.socket) -> None:
        conn.setblocking(False)
        self._leases[sid] = conn
        asyncio.get_running_loop().add_reader(conn.fileno(), self._on_lease_readable, sid, conn)

    def _on_lease_readable(self, sid: str, conn: socket.socket) -> None:
        try:
            data = conn.recv(1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        # EOF (the engine closed it or died), or bytes a lease connection never carries: end the session
        if self._leases.get(sid) is conn:
            del self._leases[sid]
        self._drop(conn)
        if self._cache.session_peer(sid) is not None:
            log.info("registration connection of a session closed%s; closing the session",
                     "" if not data else " with unexpected bytes")
            task = asyncio.get_running_loop().create_task(self._close_session(sid))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _close_session(self, sid: str) -> None:
        with contextlib.suppress(CacheError):
            await self._cache.close_session(sid)  # type: ignore[arg-type]

    @staticmethod
    def _drop(conn: socket.socket) -> None:
        with contextlib.suppress(ValueError, OSError):
            asyncio.get_running_loop().remove_reader(conn.fileno())
        conn.close()


async def _readable(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
    fut = loop.create_future()
    fd = conn.fileno()
    loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
    try:
        await fut
    finally:
        loop.remove_reader(fd)
