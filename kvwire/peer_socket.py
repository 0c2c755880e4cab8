"""Frames and kernel facts on a Unix stream socket: what the registration channel is made of.

Primitives (blocking socket calls; the daemon runs them when the socket is readable):
  send_frame(sock, payload, fds)    one length-prefixed frame; `fds` travel as SCM_RIGHTS with it
  recv_frame(sock) -> (payload, fds) one frame and the descriptors the kernel delivered with it
  peer_credentials(sock) -> PeerCred  uid, gid, pid of the process at the other end (SO_PEERCRED)
  registration_path(socket_path)    where the registration socket of a daemon lives

A frame is a 4-byte little-endian length and that many bytes (a protobuf message). The
descriptors are attached to the frame's first byte, so a reader that gets the header gets them.
Every descriptor the kernel hands over is owned by the caller of recv_frame, also on error paths:
recv_frame closes them itself when it raises.
"""

from __future__ import annotations

import array
import os
import socket
import struct
from dataclasses import dataclass

MAX_FRAME_BYTES = 1 << 20  # an OpenSessionRequest is a few hundred bytes; more is not a registration
MAX_FDS = 4
_HEADER = struct.Struct("<I")
REGISTRATION_SUFFIX = ".reg"


class FrameError(Exception):
    """The peer sent something that is not a frame (too long, cut short, too many descriptors)."""


@dataclass(frozen=True, slots=True)
class PeerCred:
    """Who is at the other end of a Unix socket, as the kernel recorded it at connect()."""

    uid: int
    gid: int
    pid: int


def registration_path(socket_path: str) -> str:
    """The registration socket beside a daemon's gRPC socket."""
    return socket_path + REGISTRATION_SUFFIX


def peer_credentials(sock: socket.socket) -> PeerCred:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCred(uid=uid, gid=gid, pid=pid)


def send_frame(sock: socket.socket, payload: bytes, fds: list[int] | tuple[int, ...] = ()) -> None:
    data = _HEADER.pack(len(payload)) + payload
    if fds:
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        sent = sock.sendmsg([data[:1]], ancillary)
        if sent != 1:
            raise FrameError("the first byte of the frame did not go out with its descriptors")
        data = data[1:]
    sock.sendall(data)


def recv_frame(sock: socket.socket) -> tuple[bytes, list[int]]:
    """One frame; (b"", []) when the peer closed before sending anything."""
    fds: list[int] = []
    try:
        head = _recv_exact(sock, _HEADER.size, fds)
        if not head:
            return b"", fds
        (length,) = _HEADER.unpack(head)
        if length > MAX_FRAME_BYTES:
            raise FrameError(f"frame of {length} bytes is longer than {MAX_FRAME_BYTES}")
        payload = _recv_exact(sock, length, fds) if length else b""
        if len(payload) != length:
            raise FrameError(f"connection closed after {len(payload)} of {length} frame bytes")
        return payload, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _recv_exact(sock: socket.socket, n: int, fds: list[int]) -> bytes:
    """Up to n bytes (fewer only at EOF), collecting any descriptors that arrive with them."""
    chunks: list[bytes] = []
    got = 0
    cmsg_space = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
    while got < n:
        data, ancillary, flags, _addr = sock.recvmsg(n - got, cmsg_space)
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                arr = array.array("i")
                arr.frombytes(payload[: len(payload) - len(payload) % arr.itemsize])
                fds.extend(arr)
        if flags & socket.MSG_CTRUNC:
            raise FrameError(f"more than {MAX_FDS} file descriptors with one frame")
        if not data:
            break
        chunks.append(data)
        got += len(data)
    if got and got < n and not chunks:
        raise FrameError("connection closed inside a frame")
    return b"".join(chunks)
