"""Malformed requests against a real daemon, sent with the generated stubs (no engine_client checks).

DESIGN §5: bad input gets a gRPC status whose message says what was wrong, and the service keeps
serving. Every case below checks the status code and a distinctive part of the message, that the
bad request stored nothing and left no session behind, and that a good Store + Load on a valid
session right after still round-trips byte for byte.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
import torch

from engine_client import BlockHasher, Namespace, ShmKVPool
from engine_client.errors import KVClientError
from engine_client.registration import register
from kvwire.v1 import kvcache_pb2 as pb
from kvwire.v1 import kvcache_pb2_grpc
from tests.daemon_kit import Daemon

POOL_BLOCKS = 32
BLOCK = 4096
MAX_BATCH = 16
STORED, LOADED = 1, 1  # kvservice.v1.StoreStatus.STORED, LoadStatus.LOADED
NS = Namespace("bad-input-model", "float32", 16, "block-contiguous")
OTHER_NS = Namespace("bad-input-other", "float32", 16, "block-contiguous")

INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
NOT_FOUND = grpc.StatusCode.NOT_FOUND
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
DENIED = grpc.StatusCode.PERMISSION_DENIED


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    # a long lease: sessions opened by the stubs here send no heartbeats
    with Daemon(extra=["--max-batch-blocks", str(MAX_BATCH), "--lease-seconds", "60"]) as d:
        yield d


@pytest.fixture(scope="module")
def stub(daemon: Daemon) -> Iterator[kvcache_pb2_grpc.KVCacheStub]:
    with grpc.insecure_channel(daemon.target) as ch:
        yield kvcache_pb2_grpc.KVCacheStub(ch)


@pytest.fixture(scope="module")
def pool() -> Iterator[ShmKVPool]:
    with ShmKVPool(POOL_BLOCKS, BLOCK) as p:
        yield p


def open_request(pool: ShmKVPool, ns: Namespace = NS) -> pb.OpenSessionRequest:
    return pb.OpenSessionRequest(namespace=ns.to_proto(), pool=pool.description(),
                                 hash_canary=BlockHasher(ns).canary(), client_name="test_bad_input")


class Refused(grpc.RpcError):
    """A refused registration, shaped like a refused RPC (code(), details())."""

    def __init__(self, err: KVClientError) -> None:
        super().__init__(err.message)
        self._err = err

    def code(self) -> grpc.StatusCode:
        return self._err.code

    def details(self) -> str:
        return self._err.message


LEASES: list = []  # registration connections of the sessions these tests opened: closing one closes its session


def open_session(daemon: Daemon, request: pb.OpenSessionRequest, fds: list[int] | None = None,
                 pool: ShmKVPool | None = None) -> pb.OpenSessionReply:
    """Register on the daemon's registration socket, passing `fds` (default: the pool's descriptor)."""
    own = pool.registration_fds() if fds is None and pool is not None else []
    try:
        lease, reply = register(daemon.socket_path, request, fds if fds is not None else own, timeout=10)
    except KVClientError as e:
        raise Refused(e) from None
    finally:
        for fd in own:
            os.close(fd)
    LEASES.append(lease)
    return reply


@dataclass
class Ctx:
    daemon: Daemon
    stub: kvcache_pb2_grpc.KVCacheStub
    pool: ShmKVPool
    session_id: str
    namespace_id: str
    other_namespace_id: str


@pytest.fixture
def ctx(daemon, stub, pool) -> Iterator[Ctx]:
    mine = open_session(daemon, open_request(pool), pool=pool)
    other = open_session(daemon, open_request(pool, OTHER_NS), pool=pool)
    stub.CloseSession(pb.CloseSessionRequest(session_id=other.session_id), timeout=10)
    c = Ctx(daemon, stub, pool, mine.session_id, mine.namespace_id, other.namespace_id)
    # a stored block fixes the namespace's canary (opening a session does not)
    assert list(store(c, refs((os.urandom(32), 0))).statuses) == [STORED]
    yield c
    stub.CloseSession(pb.CloseSessionRequest(session_id=mine.session_id), timeout=10)


def h(k: int) -> bytes:
    return bytes([k % 256]) * 32


def refs(*pairs: tuple[bytes, int]) -> dict:
    """The packed fields of a Store/Load: hashes joined (n x 32 bytes), block ids parallel to them."""
    return dict(hashes=b"".join(hh for hh, _ in pairs), block_ids=[b for _, b in pairs])


def store(c: Ctx, blocks: dict, **kw):
    return c.stub.Store(pb.StoreRequest(session_id=kw.pop("session_id", c.session_id), **blocks, **kw), timeout=10)


def load(c: Ctx, blocks: dict, **kw):
    return c.stub.Load(pb.LoadRequest(session_id=kw.pop("session_id", c.session_id), **blocks, **kw), timeout=10)


def call(c: Ctx, method: str, **fields):
    """Any KVCache RPC by name; the session is the context's unless given."""
    fields.setdefault("session_id", c.session_id)
    return getattr(c.stub, method)(getattr(pb, f"{method}Request")(**fields), timeout=10)


def closed_session(c: Ctx) -> str:
    sid = open_session(c.daemon, open_request(c.pool), pool=c.pool).session_id
    c.stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)
    return sid


def open_with(c: Ctx, edit: Callable[[pb.OpenSessionRequest], None], fds: list[int] | None = None):
    req = open_request(c.pool)
    edit(req)
    return open_session(c.daemon, req, fds, pool=c.pool)


def with_fd(opener: Callable[[Ctx], int]) -> Callable[[Ctx], object]:
    """Register the context's pool description with the descriptor `opener` makes instead of the pool's."""
    def bad(c: Ctx) -> object:
        fd = opener(c)
        try:
            return open_with(c, lambda r: None, fds=[fd])
        finally:
            os.close(fd)
    return bad


def read_only_segment(c: Ctx) -> int:
    return os.open(os.path.join("/dev/shm", c.pool.name), os.O_RDONLY)


def a_pipe(c: Ctx) -> int:
    r, w = os.pipe()
    os.close(w)
    return r


def many(n: int) -> dict:
    return refs(*((h(k), k) for k in range(n)))


# (id, bad call, status code, distinctive part of the message)
BAD_REQUESTS: list[tuple[str, Callable[[Ctx], object], grpc.StatusCode, str]] = [
    ("store block id past the pool", lambda c: store(c, refs((h(1), POOL_BLOCKS))),
     INVALID, f"block_id {POOL_BLOCKS} (#0) is outside the pool's {POOL_BLOCKS} blocks"),
    ("load block id far past the pool", lambda c: load(c, refs((h(1), 0), (h(2), 4_000_000_000))),
     INVALID, "block_id 4000000000 (#1) is outside the pool's"),
    ("store short hash", lambda c: store(c, refs((b"\x01" * 31, 0))), INVALID,
     "hashes has 31 bytes, not a multiple of 32"),
    ("load a hash short", lambda c: load(c, refs((h(1), 0), (b"\x02" * 31, 1))), INVALID,
     "hashes has 63 bytes, not a multiple of 32"),
    ("lookup long hash", lambda c: call(c, "Lookup", hashes=b"x" * 33),
     INVALID, "hashes has 33 bytes, not a multiple of 32"),
    ("prefetch hashes not a multiple of 32", lambda c: call(c, "Prefetch", hashes=b"x" * 65),
     INVALID, "hashes has 65 bytes"),
    ("retain hashes not a multiple of 32", lambda c: call(c, "Retain", hashes=b"x" * 16, ttl_seconds=5),
     INVALID, "hashes has 16 bytes"),
    ("store fewer block ids than hashes", lambda c: store(c, dict(hashes=h(1) + h(2), block_ids=[0])),
     INVALID, "1 block_ids for 2 hashes"),
    ("load more block ids than hashes", lambda c: load(c, dict(hashes=h(1), block_ids=[0, 1])),
     INVALID, "2 block_ids for 1 hashes"),
    ("store hashes without block ids", lambda c: store(c, dict(hashes=h(1) + h(2))),
     INVALID, "0 block_ids for 2 hashes"),
    ("store oversize batch", lambda c: store(c, many(MAX_BATCH + 1)),
     EXHAUSTED, f"batch of {MAX_BATCH + 1} blocks exceeds max_batch_blocks = {MAX_BATCH}"),
    ("load oversize batch", lambda c: load(c, many(MAX_BATCH + 1)), EXHAUSTED, "exceeds max_batch_blocks"),
    ("lookup oversize batch",
     lambda c: call(c, "Lookup", hashes=b"".join(h(k) for k in range(100))),
     EXHAUSTED, "batch of 100 blocks exceeds max_batch_blocks"),
    ("prefetch oversize batch",
     lambda c: call(c, "Prefetch", hashes=b"".join(h(k) for k in range(17))),
     EXHAUSTED, "exceeds max_batch_blocks"),
    # the receive limit follows max_batch_blocks: gRPC refuses this before anything parses it
    ("store message larger than any valid one", lambda c: store(c, many(100_000)), EXHAUSTED, "larger than max"),
    ("store unknown session", lambda c: store(c, refs((h(1), 0)), session_id="0" * 32),
     NOT_FOUND, "unknown or closed session"),
    ("load empty session id", lambda c: load(c, refs((h(1), 0)), session_id=""),
     NOT_FOUND, "unknown or closed session"),
    ("store closed session", lambda c: store(c, refs((h(1), 0)), session_id=closed_session(c)),
     NOT_FOUND, "unknown or closed session"),
    ("heartbeat closed session",
     lambda c: call(c, "Heartbeat", session_id=closed_session(c)), NOT_FOUND, "open a new one"),
    ("store into another namespace", lambda c: store(c, refs((h(1), 0)), namespace_id=c.other_namespace_id),
     DENIED, "opened namespace"),
    ("load from another namespace", lambda c: load(c, refs((h(1), 0)), namespace_id=c.other_namespace_id),
     DENIED, "opened namespace"),
    ("lookup in another namespace",
     lambda c: call(c, "Lookup", hashes=h(1), namespace_id="f" * 32),
     DENIED, "opened namespace"),
    ("store negative ttl", lambda c: store(c, refs((h(1), 0)), ttl_seconds=-1.0),
     INVALID, "ttl_seconds must be a finite number >= 0, got -1.0"),
    ("store NaN ttl", lambda c: store(c, refs((h(1), 0)), ttl_seconds=math.nan), INVALID, "got nan"),
    ("store infinite ttl", lambda c: store(c, refs((h(1), 0)), ttl_seconds=math.inf), INVALID, "got inf"),
    ("retain negative ttl",
     lambda c: call(c, "Retain", hashes=h(1), ttl_seconds=-5),
     INVALID, "ttl_seconds must be a finite number >= 0"),
    ("store duplicate block ids", lambda c: store(c, refs((h(1), 3), (h(2), 3))), INVALID, "a block_id appears twice"),
    ("load duplicate block ids", lambda c: load(c, refs((h(1), 5), (h(2), 6), (h(3), 5))), INVALID, "appears twice"),
    ("shm pool without its descriptor", lambda c: open_with(c, lambda r: None, fds=[]),
     INVALID, "the daemon never opens a segment by name"),
    ("shm pool with a read-only descriptor", with_fd(read_only_segment), INVALID, "must be open read-write"),
    ("shm pool with a pipe for memory", with_fd(a_pipe), INVALID, "is not a shared-memory segment or memfd"),
    ("regions past the pool size", lambda c: open_with(c, lambda r: setattr(r.pool, "num_blocks", POOL_BLOCKS + 1)),
     INVALID, f"past pool.shm.size {POOL_BLOCKS * BLOCK}"),
    ("region offset past the pool", lambda c: open_with(c, lambda r: setattr(r.pool.regions[0], "offset", 1 << 40)),
     INVALID, "pool.regions[0] ends at byte"),
    ("pool size larger than the segment", lambda c: open_with(c, lambda r: setattr(r.pool.shm, "size", 1 << 30)),
     INVALID, f"the pool's segment has {POOL_BLOCKS * BLOCK} bytes, pool.shm.size says {1 << 30}"),
    ("no pool", lambda c: open_with(c, lambda r: r.ClearField("pool")), INVALID, "pool is required"),
    ("tp_rank equal to tp_size",
     lambda c: open_with(c, lambda r: (setattr(r.namespace, "tp_rank", 2), setattr(r.namespace, "tp_size", 2))),
     INVALID, "namespace.tp_rank 2 must be < namespace.tp_size 2"),
    ("tp_size zero", lambda c: open_with(c, lambda r: setattr(r.namespace, "tp_size", 0)),
     INVALID, "tp_size must be >= 1"),
    ("empty model id", lambda c: open_with(c, lambda r: setattr(r.namespace, "model_id", "")),
     INVALID, "namespace.model_id is required"),
    ("model id too long", lambda c: open_with(c, lambda r: setattr(r.namespace, "model_id", "m" * 300)),
     INVALID, "namespace.model_id is longer than 256 characters"),
    ("client name too long", lambda c: open_with(c, lambda r: setattr(r, "client_name", "c" * 300)),
     INVALID, "client_name is longer than 256 characters"),
    ("canary of the wrong length", lambda c: open_with(c, lambda r: setattr(r, "hash_canary", b"\x00" * 16)),
     INVALID, "hash_canary must be 32 bytes, got 16"),
    ("canary of another hash function", lambda c: open_with(c, lambda r: setattr(r, "hash_canary", b"\x00" * 32)),
     PRECONDITION, "the hash functions differ"),
    ("cuda pool on a CPU daemon",
     lambda c: open_with(c, lambda r: r.pool.cuda.CopyFrom(pb.CudaIpcHandle(handle=b"\x00" * 64, size=1 << 20))),
     PRECONDITION, "no CUDA data path"),
]
# where the daemon sees a GPU, a CUDA pool is no longer refused for being one
CPU_ONLY = {"cuda pool on a CPU daemon"}


def _good_round_trip(c: Ctx) -> None:
    """Store two fresh random blocks and load them into other slots: bytes must match."""
    blocks = [os.urandom(BLOCK) for _ in range(2)]
    hashes = [os.urandom(32) for _ in range(2)]
    for slot, data in enumerate(blocks):
        c.pool.write_block(slot, data)
    stored = store(c, refs((hashes[0], 0), (hashes[1], 1)))
    assert list(stored.statuses) == [STORED, STORED]
    for slot in (10, 11):
        c.pool.write_block(slot, bytes(BLOCK))
    loaded = load(c, refs((hashes[0], 10), (hashes[1], 11)))
    assert list(loaded.statuses) == [LOADED, LOADED]
    assert [c.pool.read_block(10), c.pool.read_block(11)] == blocks


@pytest.mark.parametrize("bad, code, says", [
    pytest.param(*case[1:], id=case[0].replace(" ", "-"),
                 marks=[pytest.mark.skipif(case[0] in CPU_ONLY and torch.cuda.is_available(), reason="CUDA host")])
    for case in BAD_REQUESTS])
def test_bad_request_is_refused_with_a_reason_and_the_daemon_keeps_serving(daemon, ctx, bad, code, says):
    """Scenario: a client sends one malformed request. It gets the right status and a message
    naming the problem; nothing is stored, no session is left open, and a well-formed Store and
    Load on a valid session right after round-trip exactly."""
    before = daemon.stats()
    with pytest.raises(grpc.RpcError) as err:
        bad(ctx)
    assert err.value.code() == code, err.value.details()
    assert says in err.value.details()
    after = daemon.stats()
    assert after.counters.stores == before.counters.stores
    assert after.counters.store_hits == before.counters.store_hits
    assert after.sessions == before.sessions
    assert [t.blocks for t in after.tiers] == [t.blocks for t in before.tiers]

    _good_round_trip(ctx)
    assert daemon.stats().counters.stores == before.counters.stores + 2


def test_namespace_mismatch_message_names_both_namespaces(daemon, ctx):
    """Scenario: a session sends a Store tagged with another namespace's id; the refusal names
    the session's namespace and the one it asked for, so the operator sees the mix-up."""
    with pytest.raises(grpc.RpcError) as err:
        store(ctx, refs((h(1), 0)), namespace_id=ctx.other_namespace_id)
    assert err.value.code() == DENIED
    assert ctx.namespace_id in err.value.details() and ctx.other_namespace_id in err.value.details()
    # its own namespace id, given explicitly, is fine
    ok = store(ctx, refs((os.urandom(32), 0)), namespace_id=ctx.namespace_id)
    assert list(ok.statuses) == [STORED]


def test_refused_open_session_does_not_claim_the_namespace(daemon, stub, pool):
    """Scenario: the first client ever to name a namespace is refused because its pool cannot be
    mapped (no descriptor came with it), and it also sent a bogus canary. The refusal must leave
    no trace: a proper engine of that namespace, with the real canary, then gets in, and no
    namespace appears for the refused request."""
    fresh = Namespace("never-opened-before", "float32", 16, "block-contiguous")
    req = open_request(pool, fresh)
    req.hash_canary = b"\x07" * 32
    with pytest.raises(grpc.RpcError) as err:
        open_session(daemon, req, fds=[])
    assert err.value.code() == INVALID
    assert "never opens a segment by name" in err.value.details()
    phantom = "never-opened-before" in {n.model_id for n in daemon.admin("ListNamespaces").namespaces}

    opened = open_session(daemon, open_request(pool, fresh), pool=pool)
    stub.CloseSession(pb.CloseSessionRequest(session_id=opened.session_id), timeout=10)
    assert not phantom, "the refused OpenSession registered its namespace"
