"""KVClient: AsyncKVClient for synchronous engines.

The client owns an asyncio event loop running in a daemon thread; every method submits the
async call to it (asyncio.run_coroutine_threadsafe) and waits. Any thread may call; calls from
several threads run concurrently on the loop. `submit_load` / `submit_store` /
`submit_prefetch` / `submit_lookup` return a concurrent.futures.Future instead of waiting, so a scheduler can
issue loads and keep scheduling other requests while they land.

Lookup is the latency-bound call (DESIGN §7: p50 <= 0.3 ms for 1024 hashes), and gRPC Python's
own empty round trip (0.4-0.6 ms) is already above that, as is the hop to the loop thread and
back. So `lookup` goes out from the caller's thread on the daemon's Lookup channel
(lookup_channel.py: the same Lookup as plain frames on a Unix socket, authenticated by the kernel)
when the session names one, and `submit_lookup` hands that round trip to the client's Lookup
thread (the caller never blocks). Without a Lookup channel (an older daemon) or while it cannot
answer, Lookup goes out on a synchronous gRPC channel to the same data socket, with the async
client's session, whenever that channel is READY (after a daemon restart it backs off like any
channel: until it reconnects, Lookup takes the async client's path, which waits for its own
channel). A detaching failure hands the detach to the loop (the supervisor re-attaches as for
any other call).

`store` and `load` go out from the caller's thread on the same channel too, when they fit one batch
(the daemon's max_batch_blocks): the hop to the loop thread and back cost a 16k-token call ~0.5 ms
of the ~0.7 ms it spent outside the daemon (CPU box, bench/call_overhead.py). Anything else (more
than one batch, no channel, the channel cannot answer) takes the async client's path, which sends
the same call again there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import grpc

from engine_client.client import (
    _CHANNEL_OPTIONS,
    MAX_DATA_REPLY_BYTES,
    UNREACHABLE,
    AsyncKVClient,
    PoolDescriber,
    _DataRequest,
    _pack,
    _pack_refs,
    _Session,
    check_reply_arrays,
    lookup_answer,
    lookup_channel_answer,
)
from engine_client.errors import DETACHING_CODES, KVClientError
from engine_client.hashing import BlockHasher
from engine_client.lookup_channel import TIMED_OUT, ChannelDown, LookupChannel
from engine_client.namespace import Namespace
from engine_client.results import LoadResults, PrefetchStatuses, StoreResults
from kvwire.lookup_frames import HEADER, request_frame
from kvwire.v1 import kvcache_pb2, kvcache_pb2_grpc

T = TypeVar("T")


class KVClient:
    """Same contract as AsyncKVClient (see client.py), with blocking methods. Context manager."""

    def __init__(
        self,
        target: str,
        namespace: Namespace,
        pool: PoolDescriber,
        client_name: str = "",
        heartbeat_interval: float | None = None,
        *,
        lookup_channel: bool = True,
        **options: float,
    ) -> None:
        """Arguments as AsyncKVClient; `options` are its keyword-only timeouts. lookup_channel=False
        sends every Lookup over gRPC (the daemon's Lookup channel is used by default when it has one)."""
        self._client = AsyncKVClient(target, namespace, pool, client_name, heartbeat_interval,
                                     lookup_channel=lookup_channel, **options)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvclient-loop", daemon=True)
        self._thread.start()
        self._stopped = False
        self._caller_lock = threading.Lock()
        self._caller: _CallerChannel | None = None
        self._use_lookup_channel = lookup_channel
        self._channel: LookupChannel | None = None  # the daemon's Lookup channel, once a session named it
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None  # submit_lookup's round trips

    # --- state (plain attribute reads of the async client: safe from any thread)
    @property
    def attached(self) -> bool:
        return self._client.attached

    @property
    def session_id(self) -> str:
        return self._client.session_id

    @property
    def session_label(self) -> str:
        return self._client.session_label

    @property
    def namespace_id(self) -> str:
        return self._client.namespace_id

    @property
    def reattachments(self) -> int:
        return self._client.reattachments

    @property
    def error(self) -> KVClientError | None:
        return self._client.error

    @property
    def hasher(self) -> BlockHasher:
        return self._client.hasher

    @property
    def lookup_channel_ready(self) -> bool:
        """Whether Lookup goes out on the caller's thread now (its synchronous channel is READY)."""
        ch = self._caller
        return ch is not None and ch.ready and ch.target == self._client.data_target

    # --- blocking calls
    def connect(self, required: bool = True) -> None:
        self._run(self._client.connect(required))
        if self._client.data_target:
            self._caller_channel(self._client.data_target)  # connects now: the first Lookup finds it READY

    def lookup(self, hashes: Sequence[bytes]) -> tuple[int, list[int]]:
        session, framed = self._lookup_request(hashes)
        if session is None:  # detached: an empty cache's answer
            return 0, []
        if framed is None:  # more hashes than one batch: the async client splits them
            return self._run(self._client.lookup(hashes))
        return self._lookup_now(session, framed, hashes)

    def store(self, hashes: Sequence[bytes], block_ids: Sequence[int], ttl_seconds: float = 0.0
              ) -> StoreResults:
        out = StoreResults()
        if self._data_now(kvcache_pb2.STORE, "Store", hashes, block_ids, ttl_seconds,
                          lambda reply: (reply.statuses, reply.deadlines),
                          lambda reply: out.extend(reply.statuses, reply.deadlines, reply.messages),
                          lambda k: out.fill(k, kvcache_pb2.NOT_STORED, UNREACHABLE)):
            return out
        return self._run(self._client.store(hashes, block_ids, ttl_seconds))

    def load(self, hashes: Sequence[bytes], block_ids: Sequence[int]) -> LoadResults:
        out = LoadResults()
        if self._data_now(kvcache_pb2.LOAD, "Load", hashes, block_ids, 0.0,
                          lambda reply: (reply.statuses, reply.tiers),
                          lambda reply: out.extend(reply.statuses, reply.tiers, reply.messages),
                          lambda k: out.fill(k, kvcache_pb2.MISSING, UNREACHABLE)):
            return out
        return self._run(self._client.load(hashes, block_ids))

    def prefetch(self, hashes: Sequence[bytes]) -> PrefetchStatuses:
        return self._run(self._client.prefetch(hashes))

    def retain(self, hashes: Sequence[bytes], ttl_seconds: float) -> list[float]:
        return self._run(self._client.retain(hashes, ttl_seconds))

    # --- non-blocking calls
    def submit_store(self, hashes: Sequence[bytes], block_ids: Sequence[int], ttl_seconds: float = 0.0
                     ) -> concurrent.futures.Future[StoreResults]:
        return self._submit(self._client.store(hashes, block_ids, ttl_seconds))

    def submit_load(self, hashes: Sequence[bytes], block_ids: Sequence[int]
                    ) -> concurrent.futures.Future[LoadResults]:
        return self._submit(self._client.load(hashes, block_ids))

    def submit_prefetch(self, hashes: Sequence[bytes]) -> concurrent.futures.Future[PrefetchStatuses]:
        return self._submit(self._client.prefetch(hashes))

    def submit_lookup(self, hashes: Sequence[bytes]) -> concurrent.futures.Future[tuple[int, list[int]]]:
        session, framed = self._lookup_request(hashes)
        if session is None:  # detached: an empty cache's answer
            out: concurrent.futures.Future[tuple[int, list[int]]] = concurrent.futures.Future()
            out.set_result((0, []))
            return out
        if framed is None:
            return self._submit(self._client.lookup(hashes))
        channel = self._lookup_channel(session)
        if channel is not None:
            out = self._submit_on_pipeline(channel, session, framed, hashes)
            return out if out is not None else self._submit_on_worker(session, framed, hashes)
        ch = self._caller_channel(self._client.data_target)
        if not ch.ready:
            return self._submit(self._client.lookup(hashes))
        return self._submit_grpc(session, _grpc_request(framed), ch, len(hashes))

    @property
    def lookup_route(self) -> str:
        """Where a Lookup goes out now: "lookup channel" (the daemon's plain Unix socket, from the
        caller's thread), "grpc" (a synchronous gRPC channel from the caller's thread) or "loop"
        (the async client's gRPC channel, until the synchronous one is READY)."""
        session = self._client._session
        if session is not None and self._lookup_channel(session) is not None:
            return "lookup channel"
        return "grpc" if self.lookup_channel_ready else "loop"

    # --- internals: Lookup
    def _lookup_request(self, hashes: Sequence[bytes]) -> tuple[_Session | None, bytes | None]:
        """(session, the Lookup channel's framed LookupRequest) for one Lookup sent from this
        thread; (None, None) while detached; (session, None) when the async path must split it
        (more hashes than one batch). The gRPC fallback parses its message out of the frame
        (_grpc_request): the usual Lookup builds no protobuf message at all."""
        if self._stopped:
            raise KVClientError(grpc.StatusCode.FAILED_PRECONDITION, "KVClient is closed")
        session = self._client._current()  # raises once the client cannot be used at all (closed, refused)
        if session is None:
            return None, None
        if session.max_batch_blocks and len(hashes) > session.max_batch_blocks:
            return session, None
        framed = request_frame(session.session_id, hashes)
        if framed is None:
            _pack(hashes)  # raises INVALID_ARGUMENT, naming the hash that is not HASH_BYTES bytes
            raise KVClientError(grpc.StatusCode.INVALID_ARGUMENT, "hashes must be bytes of 32 bytes each")
        return session, framed

    def _lookup_now(self, session: _Session, framed: bytes, hashes: Sequence[bytes]) -> tuple[int, list[int]]:
        """One Lookup, blocking this thread: on the Lookup channel when the daemon has one and it
        answers; else gRPC (this thread's synchronous channel when READY, else the async client's)."""
        n = len(hashes)
        channel = self._lookup_channel(session)
        if channel is not None:
            try:
                got = channel.call(framed)
            except ChannelDown:
                pass  # an older daemon, or the channel broke: the same Lookup over gRPC below
            except TimeoutError:
                return self._lookup_failed(session, grpc.StatusCode.DEADLINE_EXCEEDED,
                                           f"no answer on the Lookup channel within {self._client.timeout:g} s")
            else:
                if got.code:
                    code = grpc.StatusCode.__members__.get(got.code, grpc.StatusCode.UNKNOWN)
                    return self._lookup_failed(session, code, got.message)
                return lookup_channel_answer(got, n)
        ch = self._caller_channel(self._client.data_target)
        if not ch.ready:
            return self._run(self._client.lookup(hashes))
        try:
            reply = ch.stub.Lookup(_grpc_request(framed), timeout=self._client.timeout)
        except grpc.RpcError as err:
            return self._lookup_failed(session, err.code(), err.details())
        return lookup_answer(reply, n)

    # --- internals: Store and Load from the caller's thread
    def _data_now(self, call: int, rpc: str, hashes: Sequence[bytes], block_ids: Sequence[int], ttl_seconds: float,
                  arrays: Callable[[Any], tuple[Sequence[Any], ...]], take: Callable[[Any], None],
                  fallback: Callable[[int], None]) -> bool:
        """One Store or Load sent from this thread on the daemon's frames channel, as the async client's
        one batch of it (AsyncKVClient._batched and _channel_call's rules) without the hops to the
        client's loop thread and back (~0.1-0.3 ms each way on a busy host: what a 16k-token call
        saw outside the daemon). True once take() (or fallback(), detached) has the answer; False:
        the call goes the async client's way (detached already, more than one batch, no channel, or
        the channel could not answer: the same call goes out again there, as the async client
        itself does after ChannelDown)."""
        if self._stopped or threading.current_thread() is self._thread:
            return False
        session = self._client._current()  # raises once the client cannot be used at all (closed, refused)
        n = len(hashes)
        if session is None or not n or session.batch_end(0, n) < n:
            return False
        channel = self._lookup_channel(session)
        if channel is None:
            return False
        k = self._client.blocks_per_key
        packed, ids = _pack_refs(hashes, block_ids, k)
        request = _DataRequest(call, session.session_id, packed, ids, ttl_seconds)
        try:
            got = channel.call(request.parts(), MAX_DATA_REPLY_BYTES)
        except ChannelDown:
            return False
        except TimeoutError:
            got = kvcache_pb2.ChannelReply(code=grpc.StatusCode.DEADLINE_EXCEEDED.name,
                                           message=f"no answer on the frames channel within {self._client.timeout:g} s")
        if got.code:
            code = grpc.StatusCode.__members__.get(got.code, grpc.StatusCode.UNKNOWN)
            if code not in DETACHING_CODES:
                raise KVClientError(code, got.message or code.name)
            # detach on the loop (a Load that timed out closes the session first: its copies are over then)
            self._run(self._client._detached_by(session, rpc, code, got.message))
            fallback(n)
            return True
        check_reply_arrays(rpc, n, arrays(got))
        take(got)
        return True

    def _submit_on_pipeline(self, channel: LookupChannel, session: _Session, framed: bytes, hashes: Sequence[bytes]
                            ) -> concurrent.futures.Future[tuple[int, list[int]]] | None:
        """Write the request on the channel's pipelined connection now; its reader thread settles
        the future. None when the pipeline cannot take it (no connection, too much in flight).
        If the connection breaks before the answer, the Lookup is sent again another way."""
        try:
            pipe = channel.pipeline()
        except (ChannelDown, TimeoutError):
            return None
        out: concurrent.futures.Future[tuple[int, list[int]]] = concurrent.futures.Future()
        n = len(hashes)

        def on_answer(reply: kvcache_pb2.ChannelReply | None, failure: str) -> None:  # the reader thread
            if out.cancelled():  # the engine gave up on it: the answer is dropped, nothing detaches
                return
            try:
                if reply is not None:
                    if reply.code:
                        code = grpc.StatusCode.__members__.get(reply.code, grpc.StatusCode.UNKNOWN)
                        answer = self._lookup_failed(session, code, reply.message)
                    else:
                        answer = lookup_channel_answer(reply, n)
                elif failure == TIMED_OUT:
                    answer = self._lookup_failed(session, grpc.StatusCode.DEADLINE_EXCEEDED,
                                                 f"no answer on the Lookup channel within {self._client.timeout:g} s")
                else:  # the connection broke: ask again (a fresh connection, or gRPC)
                    again = self._submit_on_worker(session, framed, hashes)
                    again.add_done_callback(lambda f: _settle(out, error=f.exception()) if f.exception()
                                            else _settle(out, f.result()))
                    return
            except BaseException as e:  # noqa: BLE001 - a refusal, or the client closed meanwhile
                _settle(out, error=e)
                return
            _settle(out, answer)

        if not pipe.send(framed, on_answer):
            return None
        return out

    def _submit_on_worker(self, session: _Session, framed: bytes, hashes: Sequence[bytes]
                          ) -> concurrent.futures.Future[tuple[int, list[int]]]:
        """The Lookup channel's round trip is blocking: the client's Lookup thread makes it, so the
        caller (an engine's scheduler loop) never waits. A future the caller cancels is answered
        by no one: the round trip completes and its answer is dropped."""
        out: concurrent.futures.Future[tuple[int, list[int]]] = concurrent.futures.Future()

        def run() -> None:
            if out.cancelled():
                return
            try:
                answer = self._lookup_now(session, framed, hashes)
            except BaseException as e:  # noqa: BLE001 - a refusal, or the client closed meanwhile
                _settle(out, error=e)
                return
            _settle(out, answer)

        def never_ran(job: concurrent.futures.Future) -> None:
            if job.cancelled():  # close() dropped it from the queue
                _settle(out, error=KVClientError(grpc.StatusCode.FAILED_PRECONDITION, "KVClient is closed"))

        with self._caller_lock:
            if self._worker is None:
                self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvclient-lookup")
            worker = self._worker
        try:
            job = worker.submit(run)
        except RuntimeError:  # shut down by close() meanwhile
            raise KVClientError(grpc.StatusCode.FAILED_PRECONDITION, "KVClient is closed") from None
        job.add_done_callback(never_ran)
        return out

    def _submit_grpc(self, session: _Session, request: kvcache_pb2.LookupRequest, ch: _CallerChannel, n: int
                     ) -> concurrent.futures.Future[tuple[int, list[int]]]:
        out: concurrent.futures.Future[tuple[int, list[int]]] = concurrent.futures.Future()

        def done(call: grpc.Future) -> None:  # on gRPC's thread (or this one, if already done)
            if out.cancelled():  # the engine gave up on it: no answer, and no detach for our own cancel
                return
            try:
                try:
                    answer = lookup_answer(call.result(), n)
                except grpc.RpcError as err:
                    answer = self._lookup_failed(session, err.code(), err.details())
            except BaseException as e:  # noqa: BLE001 - a refusal
                _settle(out, error=e)
                return
            _settle(out, answer)
        call = ch.stub.Lookup.future(request, timeout=self._client.timeout)
        out.add_done_callback(lambda f: call.cancel() if f.cancelled() else None)
        call.add_done_callback(done)
        return out

    def _lookup_channel(self, session: _Session) -> LookupChannel | None:
        """The daemon's Lookup channel for this session, when it has one and it is worth trying now."""
        path = session.lookup_socket
        if not self._use_lookup_channel or not path:
            return None
        ch = self._channel
        if ch is None or ch.path != path:
            with self._caller_lock:  # first call, or the daemon named another socket on re-attach
                if self._stopped:
                    return None
                if self._channel is None or self._channel.path != path:
                    old, self._channel = self._channel, LookupChannel(path, self._client.timeout)
                    if old is not None:
                        old.close()
                ch = self._channel
        return ch if ch.usable else None

    def _caller_channel(self, target: str) -> _CallerChannel:
        ch = self._caller
        if ch is not None and ch.target == target:
            return ch
        with self._caller_lock:  # first call, or the daemon named another data socket on re-attach
            if self._stopped:  # a late Lookup thread job after close(): no new channel
                raise KVClientError(grpc.StatusCode.FAILED_PRECONDITION, "KVClient is closed")
            if self._caller is None or self._caller.target != target:
                old, self._caller = self._caller, _CallerChannel(target)
                if old is not None:
                    old.close()
            return self._caller

    def _lookup_failed(self, session: _Session, code: grpc.StatusCode, details: str | None) -> tuple[int, list[int]]:
        """As AsyncKVClient._call: a detaching code answers as an empty cache would, and the loop
        detaches. The answer waits (bounded) until the loop has done so: a caller that sees the
        empty answer sees `attached` False too (it read True for a moment on a busy host)."""
        if code not in DETACHING_CODES:
            raise KVClientError(code, details or code.name)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()

        def detach() -> None:
            try:
                self._client._detach(session, "Lookup", code, details)
            finally:
                done.set_result(None)
        try:
            self._loop.call_soon_threadsafe(detach)
        except RuntimeError:  # the loop is closed (the client is closing): nothing left to detach
            return 0, []
        if threading.current_thread() is not self._thread:
            # a loop that does not run it in time (or a client closing meanwhile, whose loop stops
            # before it runs it): the answer does not wait longer
            deadline = time.monotonic() + max(1.0, self._client.timeout)
            while not self._stopped and time.monotonic() < deadline:
                try:
                    done.result(timeout=0.05)
                    break
                except concurrent.futures.TimeoutError:
                    continue
        return 0, []

    # --- lifetime
    def close(self) -> None:
        """Close the session and stop the loop thread. Idempotent."""
        if self._stopped:
            return
        try:
            self._run(self._client.close())
        finally:
            self._stopped = True
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
            with self._caller_lock:
                ch, self._caller = self._caller, None
                channel, self._channel = self._channel, None
                worker, self._worker = self._worker, None
            if ch is not None:
                ch.close()
            if channel is not None:
                channel.close()
            if worker is not None:
                worker.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> KVClient:
        if not self._client.connected:
            self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if self._stopped:
            coro.close()
            raise KVClientError(grpc.StatusCode.FAILED_PRECONDITION, "KVClient is closed")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("KVClient methods must not be called from its own event-loop thread")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._submit(coro).result()


def _grpc_request(framed: bytes) -> kvcache_pb2.LookupRequest:
    """The Lookup channel's framed request as the gRPC Lookup message: the same request, as it was
    when the caller asked (a retry never re-reads the caller's list)."""
    return kvcache_pb2.LookupRequest.FromString(framed[HEADER.size:])


def _settle(out: concurrent.futures.Future, result: object = None, error: BaseException | None = None) -> None:
    """Answer a future the caller may have cancelled meanwhile (then the answer is dropped)."""
    try:
        if error is not None:
            out.set_exception(error)
        else:
            out.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


class _CallerChannel:
    """A synchronous channel to the data socket for calls sent from the caller's thread; `ready`
    follows its connectivity (gRPC calls back on its own thread on every change)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.channel = grpc.insecure_channel(target, options=_CHANNEL_OPTIONS)
        self.stub = kvcache_pb2_grpc.KVCacheStub(self.channel)
        self.ready = False
        self.channel.subscribe(self._changed, try_to_connect=True)

    def _changed(self, state: grpc.ChannelConnectivity) -> None:
        self.ready = state == grpc.ChannelConnectivity.READY

    def close(self) -> None:
        self.channel.unsubscribe(self._changed)
        self.channel.close()
