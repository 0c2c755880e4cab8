"""The engine's side of the Lookup channel: Lookup as frames on a plain Unix socket, no gRPC.

    channel = LookupChannel(path, timeout)     # path: OpenSessionReply.lookup_socket
    reply = channel.call(request)              # a LookupRequest -> LookupChannelReply; blocking
    channel.close()

The daemon serves the same Lookup there as on gRPC (kvservice/api/lookup_channel.py, wire in
kvwire.lookup_frames), at a fraction of gRPC Python's round trip. Any thread may call: a call
takes an idle connection or opens one (a few at most: one per thread calling at the same time),
so concurrent callers do not wait for each other's round trips.

When the channel cannot answer - no such socket (an older daemon, one that stopped), the
connection broke before the answer (a restart) - `call` raises ChannelDown and the caller sends
the gRPC Lookup instead; after a fresh connection failed, the channel is not tried again for
DOWN_SECONDS. A reused connection that broke is retried once on a fresh one first (a restarted
daemon closes the old ones). No answer within `timeout` raises TimeoutError (the daemon hangs:
the caller treats it as gRPC's DEADLINE_EXCEEDED).
"""

from __future__ import annotations

import socket
import time

from google.protobuf.message import DecodeError

from kvwire.lookup_frames import LookupFrameError, frame, read_frame
from kvwire.v1 import kvcache_pb2

DOWN_SECONDS = 1.0
_SEND_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0)  # a closed peer is an error, never a SIGPIPE


class ChannelDown(Exception):
    """No answer came over the channel: use gRPC Lookup for this call."""


class LookupChannel:
    def __init__(self, path: str, timeout: float) -> None:
        self.path = path
        self._timeout = timeout
        self._idle: list[socket.socket] = []  # list.pop/append are atomic: no lock for the common case
        self._down_until = 0.0
        self._closed = False

    @property
    def usable(self) -> bool:
        """Worth trying now: not closed, and no fresh connection failed in the last DOWN_SECONDS."""
        return not self._closed and time.monotonic() >= self._down_until

    def call(self, request: bytes) -> kvcache_pb2.LookupChannelReply:
        """Send one serialized LookupRequest; the daemon's LookupChannelReply."""
        if self._closed:
            raise ChannelDown("the Lookup channel is closed")
        try:
            sock, reused = self._idle.pop(), True
        except IndexError:
            sock, reused = self._connect(), False
        try:
            payload = self._round_trip(sock, request)
        except ChannelDown:
            if not reused:
                self._down_until = time.monotonic() + DOWN_SECONDS
                raise
            self._drop_idle()  # connections of the same daemon life: a restart broke them all
            sock = self._connect()
            try:
                payload = self._round_trip(sock, request)
            except ChannelDown:
                self._down_until = time.monotonic() + DOWN_SECONDS
                raise
        try:
            reply = kvcache_pb2.LookupChannelReply.FromString(payload)
        except DecodeError:
            sock.close()
            raise ChannelDown("the Lookup channel answered something that is not a LookupChannelReply") from None
        if self._closed:
            sock.close()
        else:
            self._idle.append(sock)
        return reply

    def close(self) -> None:
        self._closed = True
        self._drop_idle()

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self._timeout)
        try:
            sock.connect(self.path)
        except TimeoutError:
            sock.close()
            raise
        except OSError as e:
            sock.close()
            self._down_until = time.monotonic() + DOWN_SECONDS
            raise ChannelDown(f"cannot connect to {self.path}: {e.strerror or e}") from None
        return sock

    def _round_trip(self, sock: socket.socket, request: bytes) -> bytes:
        """The answer's payload; the socket is closed on any failure."""
        try:
            sock.sendall(frame(request), _SEND_FLAGS)
            return read_frame(sock)
        except TimeoutError:
            sock.close()
            raise
        except (OSError, EOFError, LookupFrameError) as e:
            sock.close()
            raise ChannelDown(f"the Lookup channel broke: {e}") from None

    def _drop_idle(self) -> None:
        while True:
            try:
                self._idle.pop().close()
            except IndexError:
                return
