"""The frames channel: KVCache.Lookup, Store and Load served on a plain Unix socket, on the daemon's event loop.

Why: an engine asks Lookup for every request it schedules, and DESIGN §7 gives 1024 hashes
0.3 ms (p50); it Stores and Loads for every request too. gRPC Python's empty unary round trip alone
is 0.4-0.6 ms (on the GPU hosts measured, the part of a 2 GiB Store's time outside the daemon was
2.5-3.3 ms); a length-prefixed frame on a Unix socket is ~0.02 ms. So the same calls also travel as
frames (kvwire.lookup_frames) on `<socket_path>.lookup`: a ChannelRequest in (a LookupRequest's
bytes are one), a ChannelReply out, in order, answered by the same BlockCache calls the gRPC
servicer makes, in the event loop's thread: a Lookup reads the index between two core steps,
exactly as a gRPC Lookup does; a Store or Load runs as a task, and closing the connection while it
runs cancels it as a cancelled gRPC call would (the core rolls back what it reserved). gRPC stays;
the engine falls back to it when this socket is not there or cannot answer.

Who may use it (the same strength as the gRPC data sockets, decided by the kernel):
  - the socket is 0666 like the registration socket: reaching it proves nothing;
  - a connection is kept only if its peer's uid (SO_PEERCRED) may open sessions here at all
    (UidPolicy: the daemon's uid, root, allowed_uids); any other is told PERMISSION_DENIED and closed;
  - each request names a session id (a secret only the registering process learned) and is
    served only if that session was registered by a process of the connection's uid; otherwise
    PERMISSION_DENIED (another uid's session) or NOT_FOUND (no such session), as gRPC answers.
Bad input gets the status the gRPC call would give, as a reply frame: a payload that is not a
ChannelRequest (or names no known call) is INVALID_ARGUMENT, a frame longer than the largest valid
request is RESOURCE_EXHAUSTED and ends the connection (its bytes are not read, so frames cannot
resume). Stopping, the channel lets running Stores and Loads answer for the gRPC server's grace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections import Counter
from collections.abc import Callable

from google.protobuf.message import DecodeError

from kvservice.api import convert
from kvservice.api.registration import UidPolicy
from kvservice.core import pipeline
from kvservice.core.cache import BlockCache
from kvservice.core.types import CacheError, ErrorCode, SessionId
from kvservice.ops.trace import TRACE
from kvwire.lookup_frames import HEADER, frame
from kvwire.peer_socket import peer_credentials
from kvwire.v1 import kvcache_pb2

log = logging.getLogger(__name__)

# A KVClient keeps at most 5 (engine_client.lookup_channel); more is a leak or a flood. Past this a
# uid's new connections are closed without an answer: its clients take gRPC Lookup instead.
MAX_CONNECTIONS_PER_UID = 256
WRITE_HIGH_WATER = 1 << 20  # a peer that does not read its answers stops being read


class LookupChannel:
    """The listening socket and its connections. bind() before the cache starts, start() once
    it is serving, stop() before it drains."""

    def __init__(self, cache: BlockCache, path: str, policy: UidPolicy, max_batch_blocks: int) -> None:
        self._cache = cache
        self.path = path
        self._policy = policy
        self._max_frame = convert.max_request_bytes(max_batch_blocks)
        self._sock: socket.socket | None = None
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[_Connection] = set()
        self._bound = False  # the socket file is ours to remove (never another daemon's)
        self._stopping = False
        self.per_uid: Counter[int] = Counter()
        self.calls: Counter[str] = Counter({name: 0 for name in CALL_NAMES.values()})  # served here, by call (metrics)

    def metrics(self) -> tuple[int, dict[str, int]]:
        """(open connections, calls served so far by call name): what /metrics exports."""
        return len(self._connections), dict(self.calls)

    def bind(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o111)
        try:
            sock.bind(self.path)
        except BaseException:
            sock.close()
            raise
        finally:
            os.umask(old)
        self._bound = True
        os.chmod(self.path, 0o666)  # reaching it proves nothing: SO_PEERCRED and the session decide
        sock.setblocking(False)
        self._sock = sock

    async def start(self) -> None:
        assert self._sock is not None
        self._server = await asyncio.get_running_loop().create_unix_server(
            lambda: _Connection(self), sock=self._sock, backlog=128)

    async def stop(self, grace: float = 0.0) -> None:
        """Stop listening; let the Stores and Loads running on connections answer (up to `grace`
        seconds; then they are cancelled, as a gRPC server's stop cancels its calls); close them all."""
        if self._server is not None:
            self._server.close()
        elif self._sock is not None:
            self._sock.close()
        self._sock = None
        self._stopping = True  # new frames are refused from here on, as a stopping gRPC server refuses calls
        running = [c.running for c in self._connections if c.running is not None]
        if running and grace > 0:
            await asyncio.wait(running, timeout=grace)
        for conn in list(self._connections):
            conn.close()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        if self._bound:
            self._bound = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    # --- one request: the servicer's call of the same name, as frames
    def parse(self, payload: bytes) -> kvcache_pb2.ChannelRequest | kvcache_pb2.ChannelReply:
        """The request a frame carries, or the refusal to send for it."""
        try:
            request = kvcache_pb2.ChannelRequest.FromString(payload)
        except DecodeError:
            return _refusal(ErrorCode.INVALID_ARGUMENT.value, "the frame is not a ChannelRequest (kvservice.v1)")
        if request.call not in _CALLS:
            return _refusal(ErrorCode.INVALID_ARGUMENT.value,
                            f"ChannelRequest.call {request.call} is not LOOKUP, STORE or LOAD")
        return request

    def _check_peer(self, uid: int, session_id: str) -> None:
        peer = self._cache.session_peer(session_id)
        if peer is not None and peer.uid != uid:
            raise CacheError(ErrorCode.PERMISSION_DENIED,
                             "this session was registered by another uid: a session is served only to "
                             "processes of the uid that registered it")

    def answer(self, uid: int, payload: bytes) -> kvcache_pb2.ChannelReply:
        """A Lookup frame's answer (the call runs here, in the loop's thread, between two core steps)."""
        request = self.parse(payload)
        if isinstance(request, kvcache_pb2.ChannelReply):
            return request
        return self.answer_lookup(uid, request)

    def answer_lookup(self, uid: int, request: kvcache_pb2.ChannelRequest) -> kvcache_pb2.ChannelReply:
        try:
            self._check_peer(uid, request.session_id)
            tiers = self._cache.lookup(SessionId(request.session_id), request.hashes, request.namespace_id)
        except CacheError as e:
            return _refusal(e.code.value, e.message)
        except Exception as e:  # a core bug must not take the channel down, but must be visible
            log.exception("Lookup (frames channel) failed")
            return _refusal("INTERNAL", f"internal error in Lookup: {type(e).__name__}: {e}")
        return convert.lookup_channel_reply(tiers)

    async def answer_data(self, uid: int, request: kvcache_pb2.ChannelRequest,
                          send: Callable[[kvcache_pb2.ChannelReply], None] | None = None
                          ) -> kvcache_pb2.ChannelReply | None:
        """A Store or Load frame's answer: BlockCache.store / load as the servicer calls them. Cancelled
        (the connection closed) at any await, the core rolls back what it reserved, as for gRPC.
        send(reply): the answer, handed over from inside the core call as soon as every block's
        status is final (pipeline.Answer: before the commit of a Store, the unpins of a Load); then
        this returns None. Without send, or when the core found no such point, the answer is returned."""
        sid = SessionId(request.session_id)
        name = kvcache_pb2.ChannelCall.Name(request.call).capitalize()
        store = request.call == kvcache_pb2.STORE
        reply = convert.store_channel_reply if store else convert.load_channel_reply
        early = pipeline.Answer(lambda results: send(reply(results))) if send is not None else None
        try:
            self._check_peer(uid, request.session_id)
            ids = convert.channel_block_ids(request)
            if store:
                results = await self._cache.store(sid, request.hashes, ids, request.ttl_seconds, request.namespace_id,
                                                  answer=early)
            else:
                results = await self._cache.load(sid, request.hashes, ids, request.namespace_id, answer=early)
            return None if early is not None and early.sent else reply(results)
        except CacheError as e:
            if early is not None and early.sent:  # cannot happen: a refusal comes before any block is answered
                log.error("%s (frames channel) refused after it was answered: %s", name, e.message)
                return None
            return _refusal(e.code.value, e.message)
        except Exception as e:
            log.exception("%s (frames channel) failed%s", name,
                          " after its answer was sent (a core bug: the bookkeeping after the copies)"
                          if early is not None and early.sent else "")
            if early is not None and early.sent:
                return None
            return _refusal("INTERNAL", f"internal error in {name}: {type(e).__name__}: {e}")


_CALLS = frozenset((kvcache_pb2.LOOKUP, kvcache_pb2.STORE, kvcache_pb2.LOAD))
CALL_NAMES = {kvcache_pb2.LOOKUP: "lookup", kvcache_pb2.STORE: "store", kvcache_pb2.LOAD: "load"}


def _refusal(code: str, message: str) -> kvcache_pb2.ChannelReply:
    return kvcache_pb2.ChannelReply(code=code, message=message)


class _Connection(asyncio.Protocol):
    """One engine connection: frames in, one answer per frame, in order. A Lookup is answered in the
    callback that read it; a Store or Load runs as a task, and the frames behind it (its client sends
    one call at a time, so usually none) are kept and served once it answered. The connection is read
    on while the task runs, so a client that hangs up is seen at once and its call cancelled; only a
    client that sends more than a frame's limit without waiting for its answer stops being read."""

    def __init__(self, channel: LookupChannel) -> None:
        self._channel = channel
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._uid = -1
        self._task: asyncio.Task | None = None  # the Store or Load this connection runs
        self._writes_paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        ch = self._channel
        try:
            cred = peer_credentials(transport.get_extra_info("socket"))
        except OSError as e:
            log.info("frames channel: no peer credentials (%s); dropping the connection", e)
            transport.abort()
            return
        if ch._policy.listener(cred.uid) is None:
            self._refuse(ErrorCode.PERMISSION_DENIED.value,
                         f"uid {cred.uid} may not use this daemon (it serves its own uid, root and allowed_uids)")
            return
        if ch.per_uid[cred.uid] >= MAX_CONNECTIONS_PER_UID:
            log.warning("frames channel: uid %d already has %d connections; closing another (its client "
                        "falls back to gRPC)", cred.uid, ch.per_uid[cred.uid])
            transport.close()
            return
        self._uid = cred.uid
        ch.per_uid[cred.uid] += 1
        ch._connections.add(self)
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)

    def _refuse(self, code: str, message: str) -> None:
        assert self._transport is not None
        self._transport.write(frame(_refusal(code, message).SerializeToString()))
        self._transport.close()

    def data_received(self, data: bytes) -> None:
        if self._uid < 0:
            return  # refused; the transport is closing
        buf = self._buf
        if buf or self._task is not None:
            buf += data
            if self._task is not None:  # served once the running call answered
                if len(buf) > self._channel._max_frame and self._transport is not None:
                    self._transport.pause_reading()  # a client that does not wait for its answers
                return
            if len(buf) >= HEADER.size:
                (length,) = HEADER.unpack_from(buf)
                if length <= self._channel._max_frame and len(buf) - HEADER.size < length:
                    return  # a large frame still arriving: no copy of it per read (one, once it is whole)
            data = bytes(buf)
            buf.clear()
        self._serve(data)

    def _serve(self, data: bytes) -> None:
        """Answer the whole frames in data, in order, until one starts a Store or Load; keep the rest."""
        size = HEADER.size
        pos, end = 0, len(data)
        out: list[bytes] = []
        ch = self._channel
        while end - pos >= size:
            (length,) = HEADER.unpack_from(data, pos)
            if length > ch._max_frame:
                out.append(frame(_refusal(
                    ErrorCode.RESOURCE_EXHAUSTED.value,
                    f"frame of {length} bytes is longer than the largest valid request ({ch._max_frame} "
                    "bytes: max_batch_blocks blocks); closing the connection").SerializeToString()))
                self._write(out)
                self.close()
                return
            if end - pos - size < length:
                break
            payload = data[pos + size:pos + size + length]
            pos += size + length
            request = ch.parse(payload) if not ch._stopping else _refusal(
                ErrorCode.UNAVAILABLE.value, "the daemon is shutting down")
            if isinstance(request, kvcache_pb2.ChannelReply):
                out.append(frame(request.SerializeToString()))
                continue
            ch.calls[CALL_NAMES[request.call]] += 1
            if request.call == kvcache_pb2.LOOKUP:
                out.append(frame(ch.answer_lookup(self._uid, request).SerializeToString()))
            else:
                # read on while it runs: a client that hangs up is seen at once (and its call cancelled)
                TRACE.mark(0, "channel.received")
                self._task = asyncio.get_running_loop().create_task(ch.answer_data(self._uid, request, self._send))
                self._task.add_done_callback(self._answered)
                break
        if pos < end:
            self._buf += data[pos:]
        if out:
            self._write(out)

    def _send(self, reply: kvcache_pb2.ChannelReply) -> None:
        """The running call's answer, sent from inside it (answer_data's send): the frames behind it
        are still served only once the call is over (_answered)."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return  # the connection closed: nobody to answer (the call is being cancelled)
        self._write([frame(reply.SerializeToString())])
        TRACE.mark(0, "channel.sent")

    def _answered(self, task: asyncio.Task) -> None:
        self._task = None
        transport = self._transport
        if task.cancelled() or transport is None or transport.is_closing():
            return  # the connection closed: nobody to answer
        reply = task.result()
        if reply is not None:  # None: sent from inside the call already (_send)
            self._write([frame(reply.SerializeToString())])
            TRACE.mark(0, "channel.sent")
        if not self._writes_paused:
            transport.resume_reading()
        if self._buf:
            data = bytes(self._buf)
            self._buf.clear()
            self._serve(data)

    @property
    def running(self) -> asyncio.Task | None:
        return self._task

    def _write(self, out: list[bytes]) -> None:
        assert self._transport is not None
        if len(out) == 1:
            self._transport.write(out[0])
        else:
            self._transport.writelines(out)

    def pause_writing(self) -> None:
        self._writes_paused = True
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._writes_paused = False
        if self._transport is not None and not self._transport.is_closing() and self._task is None:
            self._transport.resume_reading()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        ch = self._channel
        if self in ch._connections:
            ch._connections.discard(self)
            ch.per_uid[self._uid] -= 1
            if ch.per_uid[self._uid] <= 0:
                del ch.per_uid[self._uid]
        self._buf.clear()
        if self._task is not None:  # as a cancelled gRPC call: the core rolls back what it reserved
            self._task.cancel()
