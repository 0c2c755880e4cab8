"""AsyncKVClient: an engine's session with the node-local kvservice daemon, over grpc.aio.

Primitives (batched; each answers per block, in the order asked):
  connect(required)                 open a session on the registration socket: namespace, pool
                                    (its memory as a file descriptor), hash canary
  lookup(hashes)                    -> (prefix_blocks, tier of each of those blocks)
  store(hashes, block_ids, ttl)     -> StoreResults (a StoreResult per block); returns once bytes left the pool
  load(hashes, block_ids)           -> LoadResults (a LoadResult per block); returns once bytes are in the pool
  prefetch(hashes)                  -> PrefetchStatus per hash (disk -> host, under a pin lease)
  retain(hashes, ttl)               -> new deadline per hash (0.0: not stored or refused)
  close()

Batches longer than the daemon's max_batch_blocks are split client-side, sent in order. On the wire
hashes travel packed (one bytes of n x 32) and block ids as packed integers (kvservice.v1).
Lookup goes over the daemon's Lookup channel (lookup_channel.py: the same call as plain frames on a
Unix socket, a fraction of gRPC's round trip) when the session names one, else over gRPC.

Resilience: the cache is an accelerator, never a dependency. While the daemon is down or
restarting (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED, or NOT_FOUND for a session a restarted
daemon does not know), data calls do not raise: they answer as an empty cache would (MISSING,
NOT_STORED, (0, []), NOT_FOUND, 0.0) and the client detaches. A background task heartbeats
while attached and, while detached, re-opens a session (re-registering the pool) with
exponential backoff. Any other status raises KVClientError, and so does a data call after the
re-attach was refused for good (e.g. a hash-canary mismatch).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import grpc

from engine_client.backoff import Backoff
from engine_client.errors import DETACHING_CODES, KVClientError, from_rpc_error
from engine_client.hashing import HASH_BYTES, BlockHasher
from engine_client.lookup_channel import AsyncLookupChannel, ChannelDown
from engine_client.namespace import Namespace
from engine_client.registration import register, unix_socket_path
from engine_client.results import LoadResults, PrefetchStatuses, StoreResults
from kvwire.ids import MAX_BLOCKS_PER_KEY
from kvwire.lookup_frames import MAX_REPLY_BYTES, data_request_parts
from kvwire.v1 import kvcache_pb2, kvcache_pb2_grpc

log = logging.getLogger(__name__)

UNREACHABLE = "daemon unreachable"
UNANSWERED: tuple[int, list[int]] = (0, [])  # a Lookup the client detached on (compared by identity)
UNANSWERED_REPLY = kvcache_pb2.ChannelReply()  # a frames-channel call the client detached on (by identity)
_CHANNEL_CALLS = frozenset(("Store", "Load"))  # what else goes on the frames channel
# A Store or Load answer on the frames channel: a status (and deadline or tier) a block, plus the messages
# of the exceptions; the largest valid batch's answer with a message for every block stays far under it.
MAX_DATA_REPLY_BYTES = 256 << 20

_CHANNEL_OPTIONS = (
    # gRPC's default reconnect backoff grows to 120 s; a restarted daemon must be found in seconds.
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 2000),
    # Channels to one target otherwise share gRPC's process-wide subchannel: a client created
    # right after a daemon restart would inherit another client's reconnect backoff and fail
    # with UNAVAILABLE although the daemon is SERVING.
    ("grpc.use_local_subchannel_pool", 1),
)

class PoolDescriber(Protocol):
    """An engine KV pool that can be registered (ShmKVPool, CudaKVPool): its description, and the
    descriptors that carry its memory to the daemon (new ones on each call; the client closes them)."""

    def description(self) -> kvcache_pb2.PoolDescription: ...

    def registration_fds(self) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class _Session:
    session_id: str  # a secret the daemon told this process only: never logged
    label: str  # the daemon's non-secret name for it (its log, ListSessions)
    namespace_id: str
    lease_seconds: float
    max_batch_blocks: int  # 0: no limit
    block_bytes: int
    lookup_socket: str = ""  # the daemon's Lookup channel (lookup_channel.py); "": an older daemon, gRPC only

    def batch_end(self, lo: int, n: int) -> int:
        """End of the batch that starts at item `lo` of `n`."""
        return min(n, lo + self.max_batch_blocks) if self.max_batch_blocks else n


def check_reply_arrays(rpc: str, n: int, got: tuple[Sequence[Any], ...]) -> None:
    """A batch reply's per-block arrays: the first has one entry per block asked, each other one as many
    or none (an array the daemon leaves empty when all its values are 0); INTERNAL otherwise."""
    if len(got[0]) != n or any(len(a) not in (0, n) for a in got[1:]):
        raise KVClientError(grpc.StatusCode.INTERNAL, f"{rpc} of {n} blocks answered {[len(a) for a in got]} results")


class AsyncKVClient:
    """One engine process's session with kvservice. Create, `await connect()`, use, `await close()`."""

    def __init__(
        self,
        target: str,
        namespace: Namespace,
        pool: PoolDescriber,
        client_name: str = "",
        heartbeat_interval: float | None = None,
        *,
        timeout: float = 30.0,
        heartbeat_timeout: float = 2.0,
        open_timeout: float = 10.0,
        lookup_channel: bool = True,
        blocks_per_key: int = 1,
    ) -> None:
        """`target`: the daemon's socket_path, as "unix:///path/to.sock" or a bare absolute path (the data
        plane is served on Unix sockets only; the pool registers on "<path>.reg").

        heartbeat_interval defaults to a third of the lease the daemon grants. `timeout` bounds
        each data RPC, `heartbeat_timeout` each Heartbeat/CloseSession, `open_timeout` OpenSession.
        lookup_channel=False sends every Lookup over gRPC (by default Lookup goes over the daemon's
        Lookup channel when the session names one: lookup_channel.py).

        blocks_per_key = k > 1: the daemon keeps k pool blocks as one block (a key: its per-block
        bookkeeping is paid once per k blocks, as vLLM's offloaded block size or LMCache's chunks);
        hash chains in keys (`namespace.tokens_per_block` = the tokens of k pool blocks) and name k
        pool block ids per hash, a key's in order: store(hashes, ids) with len(ids) = k x len(hashes).
        """
        if not 1 <= blocks_per_key <= MAX_BLOCKS_PER_KEY:
            raise ValueError(f"blocks_per_key must be 1..{MAX_BLOCKS_PER_KEY}, got {blocks_per_key}")
        self.blocks_per_key = blocks_per_key
        self.target = f"unix://{target}" if target.startswith("/") else target
        self.namespace = namespace
        self.hasher = BlockHasher(namespace)
        self.client_name = client_name
        self._pool = pool
        self._heartbeat_interval = heartbeat_interval
        self._timeout = timeout
        self._heartbeat_timeout = heartbeat_timeout
        self._open_timeout = open_timeout
        self._use_lookup_channel = lookup_channel
        self._lookup_channel: AsyncLookupChannel | None = None
        self._canary = self.hasher.canary()
        self._pool_desc: kvcache_pb2.PoolDescription | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: kvcache_pb2_grpc.KVCacheStub | None = None
        self._session: _Session | None = None
        self._stale_session_id = ""  # detached from, maybe still open on a slow daemon: closed best-effort
        self._lease: socket.socket | None = None  # the registration connection: closing it ends the session
        self._data_target = ""  # where the channel points: the data socket the daemon named
        self._wake: asyncio.Event | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._fatal: KVClientError | None = None
        self._closed = False
        self._reattachments = 0

    # --- state
    @property
    def connected(self) -> bool:
        """connect() succeeded (the client may be attached or re-attaching) and close() was not called."""
        return self._stub is not None and not self._closed

    @property
    def attached(self) -> bool:
        """True while a session is open (as far as this client knows)."""
        return self._session is not None

    @property
    def session_id(self) -> str:
        """The current session id; "" while detached."""
        return self._session.session_id if self._session else ""

    @property
    def session_label(self) -> str:
        """The daemon's non-secret name of the current session (ListSessions, its log); "" while detached."""
        return self._session.label if self._session else ""

    @property
    def namespace_id(self) -> str:
        """The daemon's id of this namespace; "" while detached."""
        return self._session.namespace_id if self._session else ""

    @property
    def reattachments(self) -> int:
        """How many times the background task turned a detached client into an attached one."""
        return self._reattachments

    @property
    def error(self) -> KVClientError | None:
        """The refusal that stopped re-attaching for good (e.g. a canary mismatch); data calls raise it."""
        return self._fatal

    @property
    def max_batch_blocks(self) -> int:
        """Blocks per RPC the daemon accepts (0 while detached or unlimited)."""
        return self._session.max_batch_blocks if self._session else 0

    # --- lifecycle
    async def connect(self, required: bool = True) -> None:
        """Open the session and start the heartbeat.

        If the daemon cannot be reached: required=True raises KVClientError(UNAVAILABLE);
        required=False starts detached and keeps re-attaching in the background. Other
        refusals (e.g. FAILED_PRECONDITION for a hash-canary mismatch) always raise.
        """
        if self._closed:
            raise KVClientError(grpc.StatusCode.FAILED_PRECONDITION, "AsyncKVClient is closed")
        if self._stub is not None:
            raise KVClientError(grpc.StatusCode.FAILED_PRECONDITION, "connect() was already called")
        self._pool_desc = self._pool.description()
        if self.blocks_per_key > 1:
            self._pool_desc.blocks_per_key = self.blocks_per_key
        self._wake = asyncio.Event()
        self._channel = grpc.aio.insecure_channel(self.target, options=_CHANNEL_OPTIONS)
        self._stub = kvcache_pb2_grpc.KVCacheStub(self._channel)
        self._data_target = self.target
        try:
            await self._open_session()
        except KVClientError as err:
            if err.code not in DETACHING_CODES or required:
                await self._drop_channel()
                if err.code in DETACHING_CODES:
                    raise KVClientError(grpc.StatusCode.UNAVAILABLE,
                                        f"kvservice unreachable at {self.target}: {err}") from None
                raise
            log.warning("kvservice unreachable at %s (%s); starting detached", self.target, err)
        self._supervisor = asyncio.create_task(self._supervise(), name=f"kvclient-supervisor {self.target}")

    async def close(self) -> None:
        """Stop the heartbeat, close the session (best effort) and the channel. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.gather(self._supervisor, return_exceptions=True)
        session, self._session = self._session, None
        if session is not None:
            await self._close_session_quietly(session.session_id)
        self._drop_lease()
        if self._lookup_channel is not None:
            self._lookup_channel.close()
        await self._drop_channel()

    async def __aenter__(self) -> AsyncKVClient:
        if self._stub is None:
            await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- data
    async def lookup(self, hashes: Sequence[bytes]) -> tuple[int, list[int]]:
        """How many leading hashes of the chain are stored, and the Tier value of each of them."""
        packed = _pack(hashes)
        prefix, tiers, pos = 0, [], 0
        n = len(hashes)
        while pos < n:
            session = self._current()
            if session is None:
                return 0, []
            end = session.batch_end(pos, n)
            request = kvcache_pb2.LookupRequest(session_id=session.session_id,
                                                hashes=packed[pos * HASH_BYTES:end * HASH_BYTES])
            answer = await self._channel_lookup(session, request, end - pos)
            if answer is None:  # no channel, or it cannot answer: the same Lookup over gRPC
                reply = await self._call("Lookup", request, session)
                if reply is None:
                    return 0, []
                answer = lookup_answer(reply, end - pos)
            elif answer is UNANSWERED:
                return 0, []
            got, more = answer
            prefix += got
            tiers.extend(more)
            if got < end - pos:
                break
            pos = end
        return prefix, tiers

    async def store(self, hashes: Sequence[bytes], block_ids: Sequence[int], ttl_seconds: float = 0.0) -> StoreResults:
        """Copy pool blocks `block_ids` into the daemon as `hashes` (a chain segment, head first).

        ttl_seconds > 0 retains them at least that long. Returns once the bytes have left the
        pool, so the blocks may be reused. Unreachable daemon: NOT_STORED for every block.
        The answer reads like a list of StoreResult (status, deadline, message) and keeps the
        daemon's arrays (statuses, deadlines, messages).
        """
        k = self.blocks_per_key
        packed, ids = _pack_refs(hashes, block_ids, k)
        out = StoreResults()
        await self._batched(
            "Store", len(hashes),
            # the frames channel's request; _call makes the gRPC one only if it must go there
            lambda sid, lo, hi: _DataRequest(kvcache_pb2.STORE, sid, packed[lo * HASH_BYTES:hi * HASH_BYTES],
                                             ids[lo * k:hi * k], ttl_seconds),
            lambda reply: (reply.statuses, reply.deadlines),
            lambda reply: out.extend(reply.statuses, reply.deadlines, reply.messages),
            lambda k: out.fill(k, kvcache_pb2.NOT_STORED, UNREACHABLE),
        )
        return out

    async def load(self, hashes: Sequence[bytes], block_ids: Sequence[int]) -> LoadResults:
        """Fill pool blocks `block_ids` with the blocks stored as `hashes`; returns once they landed.

        Recompute from the first result that is not LOADED. Unreachable daemon: MISSING with
        message "daemon unreachable" for every block. The answer reads like a list of
        LoadResult (status, tier, message) and keeps the arrays (statuses, tiers, messages).
        """
        k = self.blocks_per_key
        packed, ids = _pack_refs(hashes, block_ids, k)
        out = LoadResults()
        await self._batched(
            "Load", len(hashes),
            lambda sid, lo, hi: _DataRequest(kvcache_pb2.LOAD, sid, packed[lo * HASH_BYTES:hi * HASH_BYTES],
                                             ids[lo * k:hi * k]),  # as store(): the gRPC one only if needed
            lambda reply: (reply.statuses, reply.tiers),
            lambda reply: out.extend(reply.statuses, reply.tiers, reply.messages),
            lambda k: out.fill(k, kvcache_pb2.MISSING, UNREACHABLE),
        )
        return out

    async def prefetch(self, hashes: Sequence[bytes]) -> PrefetchStatuses:
        """Stage disk-resident blocks into the host tier; a PrefetchStatus value per hash (a list), with
        the daemon's reason for each refused block in `.messages` (index -> text)."""
        packed = _pack(hashes)
        out = PrefetchStatuses()
        await self._batched(
            "Prefetch", len(hashes),
            lambda sid, lo, hi: kvcache_pb2.PrefetchRequest(session_id=sid, hashes=packed[lo * HASH_BYTES:hi * HASH_BYTES]),
            lambda reply: (reply.results,),
            lambda reply: out.extend_reply(reply.results, reply.messages),
            lambda k: out.extend([kvcache_pb2.NOT_FOUND] * k),
        )
        return out

    async def retain(self, hashes: Sequence[bytes], ttl_seconds: float) -> list[float]:
        """Extend retention of stored blocks; the new deadline (unix s) per hash, 0.0 if not stored/refused."""
        packed = _pack(hashes)
        out: list[float] = []
        await self._batched(
            "Retain", len(hashes),
            lambda sid, lo, hi: kvcache_pb2.RetainRequest(
                session_id=sid, hashes=packed[lo * HASH_BYTES:hi * HASH_BYTES], ttl_seconds=ttl_seconds),
            lambda reply: (reply.deadlines,),
            lambda reply: out.extend(reply.deadlines),
            lambda k: out.extend([0.0] * k),
        )
        return out

    @property
    def data_target(self) -> str:
        """The data socket the daemon named for this process's uid ("unix://..."); the channel points there."""
        return self._data_target

    @property
    def timeout(self) -> float:
        return self._timeout

    # --- internals: calls
    def _current(self) -> _Session | None:
        """The session to use now (None: detached); raises if the client cannot be used at all."""
        if self._fatal is not None:
            raise self._fatal
        if self._closed:
            raise KVClientError(grpc.StatusCode.FAILED_PRECONDITION, "AsyncKVClient is closed")
        if self._stub is None:
            raise KVClientError(grpc.StatusCode.FAILED_PRECONDITION, "call connect() first")
        return self._session

    async def _batched(
        self,
        rpc: str,
        n: int,
        request: Callable[[str, int, int], Any],
        arrays: Callable[[Any], tuple[Sequence[Any], ...]],
        take: Callable[[Any], None],
        fallback: Callable[[int], None],
    ) -> None:
        """Send items [0, n) in batches of max_batch_blocks, in order. `arrays(reply)` are the
        reply's per-block arrays (each must have one entry per block asked, or none: an array the
        daemon leaves empty when all its values are 0); `take(reply)` keeps them; `fallback(k)`
        answers the last k items once the daemon is unreachable."""
        done = 0
        while done < n:
            session = self._current()
            hi = session.batch_end(done, n) if session is not None else n
            reply = await self._call(rpc, request(session.session_id, done, hi), session) if session is not None else None
            if reply is None:  # detached, before or during this batch: the rest is a miss
                fallback(n - done)
                return
            check_reply_arrays(rpc, hi - done, arrays(reply))
            take(reply)
            done = hi

    def _frames_channel(self, session: _Session) -> AsyncLookupChannel | None:
        """The daemon's frames channel for this session's calls, or None: use gRPC."""
        path = session.lookup_socket
        if not self._use_lookup_channel or not path:
            return None
        channel = self._lookup_channel
        if channel is None or channel.path != path:
            if channel is not None:
                channel.close()
            channel = self._lookup_channel = AsyncLookupChannel(path, self._timeout)
        return channel if channel.usable else None

    async def _channel_lookup(self, session: _Session, request: kvcache_pb2.LookupRequest, asked: int
                              ) -> tuple[int, list[int]] | None:
        """One Lookup on the daemon's frames channel; None: use gRPC; UNANSWERED: detached (an
        empty cache's answer), as gRPC's detaching codes."""
        got = await self._channel_call("Lookup", request.SerializeToString(), session)
        if got is None:
            return None
        if got is UNANSWERED_REPLY:
            return UNANSWERED
        return lookup_channel_answer(got, asked)

    async def _channel_call(self, rpc: str, request: bytes | list, session: _Session, limit: int = MAX_REPLY_BYTES
                            ) -> kvcache_pb2.ChannelReply | None:
        """One call on the frames channel: its answer; None: use gRPC (no channel, or it cannot answer);
        UNANSWERED_REPLY: detached, as on gRPC's detaching codes (a Load that timed out closes the
        session first, as _call does). A refusal that does not detach raises, as gRPC's would."""
        channel = self._frames_channel(session)
        if channel is None:
            return None
        try:
            got = await channel.call(request, limit)
        except ChannelDown:
            return None
        except TimeoutError:
            await self._detached_by(session, rpc, grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"no answer on the frames channel within {self._timeout:g} s")
            return UNANSWERED_REPLY
        if got.code:
            code = grpc.StatusCode.__members__.get(got.code, grpc.StatusCode.UNKNOWN)
            if code in DETACHING_CODES:
                await self._detached_by(session, rpc, code, got.message)
                return UNANSWERED_REPLY
            raise KVClientError(code, got.message or code.name)
        return got

    async def _call(self, rpc: str, request: Any, session: _Session) -> Any | None:
        """Send one data call (on the frames channel when the session has one: Store and Load; else
        gRPC); None when the daemon is unreachable (and the client detaches)."""
        assert self._stub is not None
        if rpc in _CHANNEL_CALLS and self._use_lookup_channel and session.lookup_socket:
            got = await self._channel_call(rpc, request.parts(), session, MAX_DATA_REPLY_BYTES)
            if got is UNANSWERED_REPLY:
                return None
            if got is not None:
                return got  # the fields of the StoreReply / LoadReply, codes as bytes (one per block)
        if isinstance(request, _DataRequest):
            request = request.grpc_request()
        try:
            return await getattr(self._stub, rpc)(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as err:
            if err.code() in DETACHING_CODES:
                await self._detached_by(session, rpc, err.code(), err.details())
                return None
            raise from_rpc_error(err) from None

    async def _detached_by(self, session: _Session, rpc: str, code: grpc.StatusCode, details: str | None) -> None:
        """A data call failed with a detaching code: detach. A Load that timed out or was cancelled
        may still have the daemon copying into its blocks: CloseSession returns only once no copy
        into this pool is in flight, so after it the engine may reuse them."""
        self._detach(session, rpc, code, details)
        if rpc == "Load" and code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
            await self._close_session_quietly(session.session_id)
            if self._stale_session_id == session.session_id:
                self._stale_session_id = ""

    # --- internals: session upkeep
    async def _wait_ready(self) -> None:
        """Wait (up to open_timeout) until the data channel is READY. Called right after the
        registration socket answered, so the daemon is there: a channel still backing off from
        the daemon's previous life (TRANSIENT_FAILURE) is waited for, not taken as an answer.
        The channel has a subchannel of its own (_CHANNEL_OPTIONS): no other client's backoff."""
        channel = self._channel
        assert channel is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._open_timeout
        state = channel.get_state(try_to_connect=True)
        while state != grpc.ChannelConnectivity.READY:
            if state == grpc.ChannelConnectivity.SHUTDOWN:
                raise KVClientError(grpc.StatusCode.UNAVAILABLE, "the data channel was closed")
            remaining = deadline - loop.time()
            try:
                if remaining <= 0:
                    raise asyncio.TimeoutError
                await asyncio.wait_for(channel.wait_for_state_change(state), remaining)
            except asyncio.TimeoutError:  # not the builtin TimeoutError before 3.11
                raise KVClientError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"channel not ready after {self._open_timeout:g} s") from None
            state = channel.get_state(try_to_connect=True)

    async def _open_session(self) -> None:
        """Register the pool on the daemon's registration socket (its memory goes as a descriptor),
        then make sure the channel points at the data socket the daemon named for this uid."""
        assert self._stub is not None
        socket_path = unix_socket_path(self.target)
        if socket_path is None:
            raise KVClientError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{self.target} is not a Unix socket: the data plane is served on the daemon's Unix "
                                "socket only (TCP serves operators)")
        request = kvcache_pb2.OpenSessionRequest(
            namespace=self.namespace.to_proto(), pool=self._pool_desc,
            hash_canary=self._canary, client_name=self.client_name)
        fds = self._pool.registration_fds()
        try:
            lease, reply = await asyncio.to_thread(register, socket_path, request, fds, self._open_timeout)
        finally:
            for fd in fds:
                os.close(fd)
        self._drop_lease()  # an older registration's session (if the daemon still has it) ends with it
        self._lease = lease
        try:
            data_target = f"unix://{reply.data_socket}" if reply.data_socket else self.target
            if data_target != self._data_target:
                old, self._channel = self._channel, grpc.aio.insecure_channel(data_target, options=_CHANNEL_OPTIONS)
                self._stub = kvcache_pb2_grpc.KVCacheStub(self._channel)
                self._data_target = data_target
                if old is not None:
                    await old.close()
            await self._wait_ready()
        except BaseException:
            self._drop_lease()
            raise
        self._session = _Session(
            session_id=reply.session_id,
            label=reply.label,
            namespace_id=reply.namespace_id,
            lease_seconds=reply.lease_seconds,
            max_batch_blocks=reply.max_batch_blocks,
            block_bytes=reply.block_bytes,
            lookup_socket=reply.lookup_socket,
        )
        log.info("kvservice session %s open at %s (namespace %s)", reply.label, data_target, reply.namespace_id)

    def _drop_lease(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.close()

    def _is_current(self, session: _Session) -> bool:
        # By id, not identity: a heartbeat replaces the session object when the lease changes.
        return self._session is not None and self._session.session_id == session.session_id

    def _detach(self, session: _Session, rpc: str, code: grpc.StatusCode, details: str | None) -> None:
        """`rpc` failed with a detaching `code`: answer as an empty cache and re-attach in the background."""
        if not self._is_current(session):
            return  # a concurrent call already detached, or a newer session replaced this one
        self._session = None
        if code != grpc.StatusCode.NOT_FOUND:
            self._stale_session_id = session.session_id
        log.warning("kvservice session %s detached (%s: %s %s); re-attaching in the background",
                    session.label, rpc, code.name, details)
        assert self._wake is not None
        self._wake.set()

    async def _supervise(self) -> None:
        """Heartbeat while attached; re-open a session with backoff while detached."""
        assert self._wake is not None
        backoff = Backoff()
        try:
            while not self._closed:
                session = self._session
                if session is None:
                    if await self._reattach_once():
                        backoff.reset()
                    else:
                        await asyncio.sleep(backoff.next())
                    continue
                self._wake.clear()
                if self._is_current(session):
                    try:
                        await asyncio.wait_for(self._wake.wait(), self._interval(session))
                    except asyncio.TimeoutError:  # not the builtin TimeoutError before 3.11
                        pass
                if self._is_current(session):
                    await self._heartbeat(session)
        except KVClientError as err:
            self._fatal = err
            log.error("kvservice at %s refused this client for good: %s", self.target, err)
        except Exception as err:  # noqa: BLE001  # a bug here must surface, not silently stop heartbeats
            self._fatal = KVClientError(grpc.StatusCode.INTERNAL, f"kvclient supervisor failed: {err!r}")
            log.exception("kvclient supervisor failed")

    async def _reattach_once(self) -> bool:
        """One attempt; False to back off and retry. Raises KVClientError when retrying is pointless."""
        if self._stale_session_id:
            stale, self._stale_session_id = self._stale_session_id, ""
            await self._close_session_quietly(stale)
        try:
            await self._open_session()
        except KVClientError as err:
            if err.code in DETACHING_CODES or err.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                return False  # down, restarting, or out of sessions: all may clear
            raise
        self._reattachments += 1
        return True

    async def _heartbeat(self, session: _Session) -> None:
        assert self._stub is not None
        try:
            reply = await self._stub.Heartbeat(
                kvcache_pb2.HeartbeatRequest(session_id=session.session_id), timeout=self._heartbeat_timeout)
        except grpc.aio.AioRpcError as err:
            # Any heartbeat failure may mean the lease is lost: re-open rather than risk a dead session.
            self._detach(session, "Heartbeat", err.code(), err.details())
            return
        current = self._session
        if (reply.lease_seconds > 0 and current is not None and current.session_id == session.session_id
                and reply.lease_seconds != current.lease_seconds):
            self._session = replace(current, lease_seconds=reply.lease_seconds)

    def _interval(self, session: _Session) -> float:
        if self._heartbeat_interval is not None:
            return self._heartbeat_interval
        return max(0.05, session.lease_seconds / 3) if session.lease_seconds > 0 else 1.0

    async def _close_session_quietly(self, session_id: str) -> None:
        if self._stub is None:
            return
        try:
            await self._stub.CloseSession(
                kvcache_pb2.CloseSessionRequest(session_id=session_id), timeout=self._heartbeat_timeout)
        except grpc.aio.AioRpcError as err:
            log.debug("CloseSession failed: %s", err.code().name)

    async def _drop_channel(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close()


def lookup_answer(reply: kvcache_pb2.LookupReply, asked: int) -> tuple[int, list[int]]:
    """(prefix blocks, their tiers) of one Lookup reply to `asked` hashes; INTERNAL if inconsistent."""
    got = reply.prefix_blocks
    if got > asked or len(reply.tiers) != got:
        raise KVClientError(grpc.StatusCode.INTERNAL,
                            f"Lookup of {asked} hashes answered prefix {got} with {len(reply.tiers)} tiers")
    return got, list(reply.tiers)


def lookup_channel_answer(reply: kvcache_pb2.ChannelReply, asked: int) -> tuple[int, list[int]]:
    """The same for an answer of the Lookup channel (its tiers one byte each)."""
    got = reply.prefix_blocks
    if got > asked or len(reply.tiers) != got:
        raise KVClientError(grpc.StatusCode.INTERNAL,
                            f"Lookup of {asked} hashes answered prefix {got} with {len(reply.tiers)} tiers")
    return got, list(reply.tiers)


def _pack(hashes: Sequence[bytes]) -> bytes:
    """The hashes as the wire carries them: one bytes of n x HASH_BYTES, head first."""
    try:
        packed = b"".join(hashes)
    except TypeError:
        packed = b""
    if len(packed) != HASH_BYTES * len(hashes):
        for i, h in enumerate(hashes):
            if not isinstance(h, (bytes, bytearray, memoryview)) or len(h) != HASH_BYTES:
                size = len(h) if isinstance(h, (bytes, bytearray, memoryview)) else type(h).__name__
                raise KVClientError(grpc.StatusCode.INVALID_ARGUMENT, f"hash {i} is {size} bytes, expected {HASH_BYTES}")
    return packed


def _pack_refs(hashes: Sequence[bytes], block_ids: Sequence[int], k: int = 1) -> tuple[bytes, list[int]]:
    if len(hashes) * k != len(block_ids):
        per = f" ({k} a hash: blocks_per_key)" if k > 1 else ""
        raise KVClientError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"{len(hashes)} hashes but {len(block_ids)} block ids{per}")
    return _pack(hashes), list(block_ids)


@dataclass(frozen=True)
class _DataRequest:
    """One Store or Load batch: sent on the frames channel as parts (data_request_parts: the packed
    hashes are not copied into a message and again into its serialization), or as the gRPC call's
    request when it must go there."""

    call: int  # kvcache_pb2.STORE / LOAD
    session_id: str
    hashes: bytes | memoryview  # n x HASH_BYTES, packed
    block_ids: Sequence[int]
    ttl_seconds: float = 0.0

    def parts(self) -> list[bytes | memoryview]:
        return data_request_parts(self.call, self.session_id, self.hashes, self.block_ids, self.ttl_seconds)

    def grpc_request(self) -> kvcache_pb2.StoreRequest | kvcache_pb2.LoadRequest:
        if self.call == kvcache_pb2.STORE:
            return kvcache_pb2.StoreRequest(session_id=self.session_id, hashes=bytes(self.hashes),
                                            block_ids=self.block_ids, ttl_seconds=self.ttl_seconds)
        return kvcache_pb2.LoadRequest(session_id=self.session_id, hashes=bytes(self.hashes),
                                       block_ids=self.block_ids)
