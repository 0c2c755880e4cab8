"""The engine's side of the Lookup channel: Lookup, Store and Load as frames on a plain Unix socket, no
gRPC (blocking callers' on their own thread: KVClient; an asyncio engine's on its loop: AsyncKVClient).

    channel = LookupChannel(path, timeout)     # path: OpenSessionReply.lookup_socket
    reply = channel.call(framed)               # a framed LookupRequest -> ChannelReply; blocking
    reply = channel.call(parts, limit)         # a Store or Load (data_request_parts), the same way
    channel.pipeline().send(framed, on_answer)  # the same, not blocking: on_answer(reply, failure)
    channel.close()                            # on the pipeline's reader thread

    achannel = AsyncLookupChannel(path, timeout)   # AsyncKVClient's, in its event loop: any ChannelRequest
    reply = await achannel.call(request)           # (serialized); a connection per call in flight, up to 8
    achannel.close()

The daemon serves the same Lookup there as on gRPC (kvservice/api/lookup_channel.py, wire in
kvwire.lookup_frames), at a fraction of gRPC Python's round trip. Any thread may call: a call
takes an idle connection or opens one (one per thread calling at the same time, MAX_CONNECTIONS at
most: a caller beyond them is told ChannelDown and uses gRPC), so concurrent callers do not wait
for each other's round trips. Submitted Lookups share one
pipelined connection: the caller's thread writes the request (a few KiB into the socket buffer,
bounded by MAX_UNANSWERED_BYTES so it never waits for the daemon) and a reader thread, blocked
in recv like a blocking caller would be, answers each in order.

When the channel cannot answer - no such socket (an older daemon, one that stopped), the
connection broke before the answer (a restart) - `call` raises ChannelDown and the caller sends
the gRPC Lookup instead; after a fresh connection failed, the channel is not tried again for
DOWN_SECONDS. A reused connection that broke is retried once on a fresh one first (a restarted
daemon closes the old ones). No answer within `timeout` raises TimeoutError (the daemon hangs:
the caller treats it as gRPC's DEADLINE_EXCEEDED).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from kvwire.lookup_frames import (
    HEADER,
    MAX_REPLY_BYTES,
    RECV_BYTES,
    LookupFrameError,
    read_frame,
)
from kvwire.v1 import kvcache_pb2

DOWN_SECONDS = 1.0
MAX_CONNECTIONS = 4  # blocking callers' connections per channel (plus the pipeline's one)
MAX_ASYNC_CONNECTIONS = 8  # AsyncLookupChannel's: calls in flight at once on the channel (more go over gRPC)
# Bytes of submitted requests not answered yet, per pipeline: under any Unix socket's send buffer
# (>= 208 KiB on Linux), so a caller's write never blocks, even when the daemon has stalled.
MAX_UNANSWERED_BYTES = 96 << 10
POLL_SECONDS = 0.25  # the reader thread checks its oldest request's deadline this often
BROKEN, TIMED_OUT = "broken", "timed out"  # why a submitted request got no answer
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
        self._open = 0  # connections of blocking callers, idle or in use
        self._open_lock = threading.Lock()
        self._pipeline: LookupPipeline | None = None
        self._pipeline_lock = threading.Lock()

    @property
    def usable(self) -> bool:
        """Worth trying now: not closed, and no fresh connection failed in the last DOWN_SECONDS."""
        return not self._closed and time.monotonic() >= self._down_until

    def call(self, framed: bytes | Sequence[bytes | memoryview], limit: int = MAX_REPLY_BYTES
             ) -> kvcache_pb2.ChannelReply:
        """Send one LookupRequest, serialized and framed (kvwire.lookup_frames.request_frame, or
        frame(request.SerializeToString())), or any ChannelRequest as unframed parts (a Store or Load:
        kvwire.lookup_frames.data_request_parts); the daemon's ChannelReply (`limit`: the largest
        answer read)."""
        if self._closed:
            raise ChannelDown("the Lookup channel is closed")
        try:
            sock, reused = self._idle.pop(), True
        except IndexError:
            sock, reused = self._open_one(), False
        try:
            payload = self._round_trip(sock, framed, limit)
        except ChannelDown:
            if not reused:
                self._down_until = time.monotonic() + DOWN_SECONDS
                raise
            self._drop_idle()  # connections of the same daemon life: a restart broke them all
            sock = self._open_one()
            try:
                payload = self._round_trip(sock, framed, limit)
            except ChannelDown:
                self._down_until = time.monotonic() + DOWN_SECONDS
                raise
        try:
            reply = kvcache_pb2.ChannelReply.FromString(payload)
        except DecodeError:
            self._close_one(sock)
            raise ChannelDown("the Lookup channel answered something that is not a ChannelReply") from None
        if self._closed:
            self._close_one(sock)
        else:
            self._idle.append(sock)
        return reply

    def pipeline(self) -> LookupPipeline:
        """The live connection for submitted Lookups (made on first use); ChannelDown if none can be."""
        pipe = self._pipeline
        if pipe is not None and pipe.alive:
            return pipe
        with self._pipeline_lock:
            if self._closed:
                raise ChannelDown("the Lookup channel is closed")
            if self._pipeline is None or not self._pipeline.alive:
                self._pipeline = LookupPipeline(self._connect(), self._timeout)
            return self._pipeline

    def close(self) -> None:
        self._closed = True
        self._drop_idle()
        with self._pipeline_lock:
            pipe, self._pipeline = self._pipeline, None
        if pipe is not None:
            pipe.close()

    def _open_one(self) -> socket.socket:
        """A new connection for a blocking caller, counted; ChannelDown (not marking the channel
        down) when MAX_CONNECTIONS are open already."""
        with self._open_lock:
            if self._open >= MAX_CONNECTIONS:
                raise ChannelDown(f"{MAX_CONNECTIONS} Lookup channel connections are in use")
            self._open += 1
        try:
            return self._connect()
        except BaseException:
            self._forget_one()
            raise

    def _forget_one(self) -> None:
        with self._open_lock:
            self._open -= 1

    def _close_one(self, sock: socket.socket) -> None:
        sock.close()
        self._forget_one()

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

    def _round_trip(self, sock: socket.socket, framed: bytes | Sequence[bytes | memoryview], limit: int) -> bytes:
        """The answer's payload; the socket is closed on any failure."""
        try:
            if isinstance(framed, (bytes, bytearray, memoryview)):
                sock.sendall(framed, _SEND_FLAGS)
            else:  # parts: the frame's header, then each part as it is (no joined copy of a large request)
                parts = [HEADER.pack(sum(map(len, framed))), *framed]
                sent, total = sock.sendmsg(parts, (), _SEND_FLAGS), sum(map(len, parts))
                if sent < total:
                    sock.sendall(b"".join(parts)[sent:], _SEND_FLAGS)
            return read_frame(sock, limit)
        except TimeoutError:
            self._close_one(sock)
            raise
        except (OSError, EOFError, LookupFrameError) as e:
            self._close_one(sock)
            raise ChannelDown(f"the Lookup channel broke: {e}") from None

    def _drop_idle(self) -> None:
        while True:
            try:
                self._close_one(self._idle.pop())
            except IndexError:
                return


OnAnswer = Callable[["kvcache_pb2.ChannelReply | None", str], None]


@dataclass(slots=True)
class _Pending:
    on_answer: OnAnswer
    deadline: float
    size: int


class LookupPipeline:
    """One connection, many requests in flight: send() writes from the caller's thread, the reader
    thread calls each request's on_answer(reply, "") in order, or on_answer(None, BROKEN | TIMED_OUT)
    for every request still waiting when the connection breaks, is closed, or its oldest request
    is older than the timeout (then the connection is given up: answers can no longer be matched)."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self._sock = sock
        self._timeout = timeout
        self._pending: deque[_Pending] = deque()
        self._unanswered = 0
        self._lock = threading.Lock()
        self.alive = True
        sock.settimeout(POLL_SECONDS)  # the reader's recv wakes up to check deadlines
        self._reader = threading.Thread(target=self._read_loop, name="kvclient-lookup-reader", daemon=True)
        self._reader.start()

    def send(self, data: bytes, on_answer: OnAnswer) -> bool:
        """Write one LookupRequest, framed; False (nothing sent, on_answer never called) when this
        pipeline is dead or has MAX_UNANSWERED_BYTES in flight: send it another way."""
        with self._lock:
            if not self.alive or self._unanswered + len(data) > MAX_UNANSWERED_BYTES:
                return False
            self._pending.append(_Pending(on_answer, time.monotonic() + self._timeout, len(data)))
            self._unanswered += len(data)
            try:
                self._sock.sendall(data, _SEND_FLAGS)
                return True
            except OSError:
                failed = self._give_up_locked()
        _tell(failed, BROKEN)
        return True

    def close(self) -> None:
        with self._lock:
            failed = self._give_up_locked()
        _tell(failed, BROKEN)

    def _give_up_locked(self) -> list[_Pending]:
        self.alive = False
        failed = list(self._pending)
        self._pending.clear()
        self._unanswered = 0
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the reader's recv
        except OSError:
            pass
        return failed

    def _read_loop(self) -> None:
        buf = bytearray()
        why = BROKEN
        try:
            while self.alive:
                try:
                    data = self._sock.recv(RECV_BYTES)
                except TimeoutError:
                    with self._lock:
                        late = bool(self._pending) and self._pending[0].deadline < time.monotonic()
                    if late:
                        why = TIMED_OUT
                        return
                    continue
                except OSError:
                    return
                if not data:
                    return
                buf += data
                while len(buf) >= HEADER.size:
                    (length,) = HEADER.unpack_from(buf)
                    if length > MAX_REPLY_BYTES or len(buf) < HEADER.size + length:
                        if length > MAX_REPLY_BYTES:
                            return
                        break
                    payload = bytes(buf[HEADER.size:HEADER.size + length])
                    del buf[:HEADER.size + length]
                    with self._lock:
                        if not self._pending:
                            return  # an answer nobody asked for: the stream cannot be trusted
                        p = self._pending.popleft()
                        self._unanswered -= p.size
                    try:
                        reply = kvcache_pb2.ChannelReply.FromString(payload)
                    except DecodeError:
                        _tell([p], BROKEN)
                        return
                    p.on_answer(reply, "")
        finally:
            with self._lock:
                failed = self._give_up_locked()
            self._sock.close()
            _tell(failed, why)


def _tell(failed: list[_Pending], why: str) -> None:
    for p in failed:
        p.on_answer(None, why)


class AsyncLookupChannel:
    """The channel for AsyncKVClient, in its event loop: Lookup, Store and Load as frames, one call in
    flight per connection (the daemon answers a connection's calls in turn), up to
    MAX_ASYNC_CONNECTIONS at once; a call beyond them is told ChannelDown (use gRPC) without marking
    the channel down. Same failure contract as LookupChannel.call: ChannelDown (use gRPC),
    TimeoutError (the daemon hangs). A call that times out or is cancelled mid-round-trip drops its
    connection: its answer would be read by the next call otherwise, and the daemon cancels a Store
    or Load whose connection closed, as it does a cancelled gRPC call."""

    def __init__(self, path: str, timeout: float) -> None:
        self.path = path
        self._timeout = timeout
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._open = 0  # connections, idle or carrying a call
        self._down_until = 0.0
        self._closed = False

    @property
    def usable(self) -> bool:
        return not self._closed and time.monotonic() >= self._down_until

    async def call(self, request: bytes | Sequence[bytes | memoryview], limit: int = MAX_REPLY_BYTES
                   ) -> kvcache_pb2.ChannelReply:
        """Send one ChannelRequest (serialized, not framed; or as parts whose concatenation is that:
        kvwire.lookup_frames.data_request_parts); its ChannelReply (`limit`: the largest answer
        accepted, in bytes)."""
        if self._closed:
            raise ChannelDown("the frames channel is closed")
        reused = bool(self._idle)
        try:
            payload = await self._round_trip(request, limit)
        except _Busy:
            raise
        except ChannelDown:
            if not reused:
                self._down_until = time.monotonic() + DOWN_SECONDS
                raise
            self._drop_idle()  # connections of the same daemon life: a restart broke them all
            try:  # one fresh try
                payload = await self._round_trip(request, limit)
            except _Busy:
                raise
            except ChannelDown:
                self._down_until = time.monotonic() + DOWN_SECONDS
                raise
        try:
            return kvcache_pb2.ChannelReply.FromString(payload)
        except DecodeError:
            raise ChannelDown("the frames channel answered something that is not a ChannelReply") from None

    def close(self) -> None:
        self._closed = True
        self._drop_idle()

    async def _round_trip(self, request: bytes | Sequence[bytes | memoryview], limit: int) -> bytes:
        """One request on an idle connection (or a new one); the connection goes back to the idle
        ones only after a whole answer."""
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        fired = [False]

        def expire() -> None:
            fired[0] = True
            task.cancel()
        conn = self._idle.pop() if self._idle else None
        if conn is None:
            if self._open >= MAX_ASYNC_CONNECTIONS:
                raise _Busy(f"{MAX_ASYNC_CONNECTIONS} frames channel connections carry calls")
            self._open += 1
        timer = loop.call_later(self._timeout, expire)  # asyncio.timeout() without needing 3.11
        try:
            if conn is None:
                try:
                    conn = await asyncio.open_unix_connection(self.path)
                except OSError as e:
                    raise ChannelDown(f"cannot connect to {self.path}: {e.strerror or e}") from None
            reader, writer = conn
            parts = (request,) if isinstance(request, (bytes, bytearray, memoryview)) else request
            writer.write(HEADER.pack(sum(map(len, parts))))  # no framed copy of a large request (page faults: ~1.5 ms a MiB)
            for part in parts:
                writer.write(part)
            head = await reader.readexactly(HEADER.size)
            (length,) = HEADER.unpack(head)
            if length > limit:
                raise ChannelDown(f"frame of {length} bytes is longer than {limit}")
            payload = await reader.readexactly(length) if length else b""
        except asyncio.CancelledError:
            self._drop(conn)
            if fired[0]:  # our timer's cancel (delivered at the await it fired during), not the caller's
                if hasattr(task, "uncancel"):
                    task.uncancel()
                raise TimeoutError(f"no answer on the frames channel within {self._timeout:g} s") from None
            raise
        except (OSError, asyncio.IncompleteReadError) as e:
            self._drop(conn)
            raise ChannelDown(f"the frames channel broke: {e!r}") from None
        except BaseException:
            self._drop(conn)
            raise
        finally:
            timer.cancel()
        if self._closed:
            self._drop(conn)
        else:
            self._idle.append(conn)
        return payload

    def _drop(self, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None) -> None:
        self._open -= 1
        if conn is not None:
            conn[1].close()

    def _drop_idle(self) -> None:
        while self._idle:
            self._drop(self._idle.pop())


class _Busy(ChannelDown):
    """Every connection the channel may open carries a call: this one goes over gRPC (the channel is
    not down)."""
