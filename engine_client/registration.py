"""Opening a session: the engine's side of the daemon's registration socket.

    lease, reply = register(socket_path, request, fds, timeout)

connects to `<socket_path>.reg`, sends the OpenSessionRequest with the pool's file descriptors
attached (SCM_RIGHTS; a CUDA pool sends none, its IPC handle is in the request), and reads the
RegistrationReply. The kernel tells the daemon who connected (SO_PEERCRED), so the session is
bound to this process's uid; the session id in the reply is a secret only this connection
carried. Keep `lease` open while the session is in use: closing it (or exiting) closes the
session at once.
"""

from __future__ import annotations

import socket

import grpc

from engine_client.errors import KVClientError
from kvwire.peer_socket import FrameError, recv_frame, registration_path, send_frame
from kvwire.v1 import kvcache_pb2


def unix_socket_path(target: str) -> str | None:
    """The filesystem path of a "unix:" target (or a bare absolute path); None for host:port."""
    if target.startswith("unix://"):
        return target[len("unix://"):]
    if target.startswith("unix:"):
        return target[len("unix:"):]
    if target.startswith("/"):
        return target
    return None


def register(socket_path: str, request: kvcache_pb2.OpenSessionRequest, fds: list[int],
             timeout: float) -> tuple[socket.socket, kvcache_pb2.OpenSessionReply]:
    """Open a session; raises KVClientError (UNAVAILABLE when no daemon answers, else the
    daemon's refusal). The descriptors in `fds` stay the caller's."""
    path = registration_path(socket_path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except PermissionError as e:
            raise KVClientError(grpc.StatusCode.PERMISSION_DENIED,
                                f"cannot reach the registration socket {path}: {e.strerror}") from None
        except OSError as e:
            raise KVClientError(grpc.StatusCode.UNAVAILABLE, f"no daemon at {path}: {e.strerror or e}") from None
        try:
            send_frame(sock, request.SerializeToString(), fds)
            payload, extra = recv_frame(sock)
        except TimeoutError:
            raise KVClientError(grpc.StatusCode.DEADLINE_EXCEEDED, f"registration at {path} timed out") from None
        except (OSError, FrameError) as e:
            raise KVClientError(grpc.StatusCode.UNAVAILABLE, f"registration at {path} failed: {e}") from None
        for fd in extra:  # the daemon sends none; never keep what we did not ask for
            socket.close(fd)
        if not payload:
            raise KVClientError(grpc.StatusCode.UNAVAILABLE, f"the daemon closed {path} without answering")
        reply = kvcache_pb2.RegistrationReply.FromString(payload)
        if not reply.HasField("session"):
            code = grpc.StatusCode.__members__.get(reply.code, grpc.StatusCode.UNKNOWN)
            raise KVClientError(code, reply.message or "registration refused")
        sock.settimeout(None)
        return sock, reply.session
    except BaseException:
        sock.close()
        raise
