"""Store and Load on the frames channel (kvservice/api/lookup_channel.py, engine_client/lookup_channel.py)
against a real daemon subprocess: the engine's KVClient sends them there instead of gRPC; the answers,
refusals and access rule are gRPC's; a connection closed while its Store runs rolls the Store back (as a
cancelled gRPC call); more calls in flight than the channel's connections go over gRPC.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
from collections.abc import Iterator

import grpc
import pytest

from engine_client import AsyncKVClient, KVClient, KVClientError, Namespace, ShmKVPool
from engine_client.lookup_channel import MAX_ASYNC_CONNECTIONS
from harness.daemon import Daemon
from kvwire.lookup_frames import frame, le32, lookup_socket_path, read_frame
from kvwire.v1 import kvcache_pb2, kvcache_pb2_grpc
from tests.corekit import content, h
from tests.engine_kit import EngineProc
from tests.test_lookup_channel import STRANGER, as_stranger, daemon, needs_root  # noqa: F401  (daemon: a fixture)
from tests.test_store_cancellation import STORED, assert_nothing_left_and_others_store, slow_disk_daemon, wait_for

NS = Namespace("frames-channel", "float32", 16, "block-contiguous")
BLOCK = 4096


@pytest.fixture
def pool() -> Iterator[ShmKVPool]:
    with ShmKVPool(64, BLOCK) as p:
        for i in range(64):
            p.write_block(i, content(i))
        yield p


def refuse_grpc(client: KVClient) -> list[str]:
    """Make the client's gRPC Store and Load fail loudly; the names of those attempted are listed."""
    tried: list[str] = []
    stub = client._client._stub

    def refusing(name: str):
        def call(*args, **kwargs):
            tried.append(name)
            raise AssertionError(f"{name} went over gRPC")
        return call
    stub.Store, stub.Load = refusing("Store"), refusing("Load")
    return tried


def raw_call(sock: socket.socket, request: kvcache_pb2.ChannelRequest) -> kvcache_pb2.ChannelReply:
    sock.sendall(frame(request.SerializeToString()))
    return kvcache_pb2.ChannelReply.FromString(read_frame(sock, 64 << 20))


def connect(d: Daemon) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(lookup_socket_path(d.socket_path))
    return s


def grpc_status(d: Daemon, rpc: str, request) -> tuple[str, str]:
    with grpc.insecure_channel(d.target) as ch:
        try:
            getattr(kvcache_pb2_grpc.KVCacheStub(ch), rpc)(request, timeout=10)
        except grpc.RpcError as e:
            return e.code().name, e.details()
    return "OK", ""


def test_store_and_load_go_over_the_channel_and_answer_what_grpc_answers(daemon, pool):
    """Scenario: an engine's KVClient stores and loads (with and without retention, hits and new
    blocks, an id outside its pool) while its gRPC Store and Load would fail: every call went over
    the frames channel. A gRPC-only client of the same namespace sees the same blocks; the loads
    are byte-exact; the refusal is gRPC's status and message."""
    with KVClient(daemon.target, NS, pool, client_name="channel") as fast, \
            KVClient(daemon.target, NS, pool, client_name="grpc only", lookup_channel=False) as slow:
        tried = refuse_grpc(fast)
        chain = fast.hasher.hash_blocks(range(16 * 32))
        rs = fast.store(chain[:16], list(range(16)))
        assert [r.status for r in rs] == [STORED] * 16 and all(r.deadline == 0 for r in rs)
        rs = fast.store(chain[:24], list(range(24)), ttl_seconds=60)  # 16 hits retained, 8 new
        assert [r.status for r in rs] == [kvcache_pb2.ALREADY_STORED] * 16 + [STORED] * 8
        assert all(r.deadline > 0 for r in rs)
        assert [r.status for r in slow.store(chain[:24], list(range(24)))] == [kvcache_pb2.ALREADY_STORED] * 24
        for client in (fast, slow):
            pool.write_block(40, b"\0" * BLOCK)
            rs = client.load(chain[:24], list(range(32, 56)))
            assert [r.status for r in rs] == [kvcache_pb2.LOADED] * 24
            assert [r.tier for r in rs] == [kvcache_pb2.TIER_HOST] * 24
            assert all(pool.read_block(32 + i) == content(i) for i in range(24))
        rs = fast.load(chain[24:26], [0, 1])
        assert [r.status for r in rs] == [kvcache_pb2.MISSING] * 2
        with pytest.raises(KVClientError) as channel_err:
            fast.store(chain[30:32], [0, 64])
        with pytest.raises(KVClientError) as grpc_err:
            slow.store(chain[30:32], [0, 64])
        assert channel_err.value.code == grpc_err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert str(channel_err.value) == str(grpc_err.value)
        assert tried == [] and fast.attached


def test_per_block_messages_are_the_same_on_both_routes():
    """Scenario: a namespace's retained-bytes cap (4 blocks) refuses the retention of the rest of a
    Store: STORED_NOT_RETAINED with the cap's message, block by block, and a deadline only for the
    retained ones. The channel's answer (codes as bytes) reads exactly as gRPC's for the same Store
    of other hashes, in another namespace under the same cap."""
    with Daemon(host_capacity="256KiB", disk_capacity="1MiB", extra=["--retained-cap", "16KiB"]) as d, \
            ShmKVPool(64, BLOCK) as pool:
        answers = []
        for route, model in (("channel", "m-channel"), ("grpc", "m-grpc")):
            with KVClient(d.target, Namespace(model, "float32", 16, "block-contiguous"), pool, client_name=route,
                          lookup_channel=route == "channel") as c:
                if route == "channel":
                    refuse_grpc(c)
                rs = c.store(c.hasher.hash_blocks(range(16 * 6)), list(range(6)), ttl_seconds=60)
                answers.append([(r.status, r.deadline > 0, r.message) for r in rs])
        assert answers[0] == answers[1]
        assert [a[0] for a in answers[0]] == [STORED] * 4 + [kvcache_pb2.STORED_NOT_RETAINED] * 2
        assert [a[1] for a in answers[0]] == [True] * 4 + [False] * 2
        assert "retained-bytes cap" in answers[0][5][2] and answers[0][0][2] == ""


def test_raw_frames_get_grpc_s_refusals(daemon, pool):
    """Scenario: a client sends Store and Load frames it should not: an unknown session, block ids
    that do not match the hashes, a call the channel does not know, a payload that is not a
    ChannelRequest. Each gets the status and message gRPC gives (or INVALID_ARGUMENT for what gRPC
    cannot be sent), on a connection that keeps serving."""
    with KVClient(daemon.target, NS, pool, client_name="raw") as client:
        chain = client.hasher.hash_blocks(range(16 * 4))
        sid = client.session_id
        cases = {
            "unknown session": ("Store", kvcache_pb2.StoreRequest(session_id="nope", hashes=chain[0], block_ids=[0])),
            "ids do not match": ("Store", kvcache_pb2.StoreRequest(session_id=sid, hashes=b"".join(chain), block_ids=[0])),
            "id outside the pool": ("Load", kvcache_pb2.LoadRequest(session_id=sid, hashes=chain[0], block_ids=[99])),
            "another namespace": ("Load", kvcache_pb2.LoadRequest(session_id=sid, hashes=chain[0], block_ids=[1],
                                                                  namespace_id="abc")),
        }
        with connect(daemon) as s:
            for name, (rpc, req) in cases.items():
                call = kvcache_pb2.STORE if rpc == "Store" else kvcache_pb2.LOAD
                fields = {f.name: getattr(req, f.name) for f in req.DESCRIPTOR.fields if f.name in
                          ("session_id", "hashes", "block_ids", "namespace_id", "ttl_seconds")}
                got = raw_call(s, kvcache_pb2.ChannelRequest(call=call, **fields))
                want = grpc_status(daemon, rpc, req)
                assert want[0] != "OK" and (got.code, got.message) == want, name
            got = raw_call(s, kvcache_pb2.ChannelRequest(session_id=sid, hashes=chain[0], block_ids=[0], call=7))
            assert got.code == "INVALID_ARGUMENT" and "is not LOOKUP, STORE or LOAD" in got.message
            s.sendall(frame(b"\xff\xff\xff"))
            got = kvcache_pb2.ChannelReply.FromString(read_frame(s))
            assert got.code == "INVALID_ARGUMENT" and "not a ChannelRequest" in got.message
            # the ids as little-endian uint32 (what KVClient sends): both forms at once, or a broken length
            got = raw_call(s, kvcache_pb2.ChannelRequest(call=kvcache_pb2.STORE, session_id=sid, hashes=chain[0],
                                                         block_ids=[3], block_ids_le32=le32([3])))
            assert got.code == "INVALID_ARGUMENT" and "both block_ids and block_ids_le32" in got.message
            got = raw_call(s, kvcache_pb2.ChannelRequest(call=kvcache_pb2.LOAD, session_id=sid, hashes=chain[0],
                                                         block_ids_le32=b"\x03\x00\x00"))
            assert got.code == "INVALID_ARGUMENT" and "not a multiple of 4" in got.message
            got = raw_call(s, kvcache_pb2.ChannelRequest(call=kvcache_pb2.STORE, session_id=sid,
                                                         hashes=b"".join(chain[:2]), block_ids_le32=le32([5])))
            assert got.code == "INVALID_ARGUMENT" and "1 block_ids for 2 hashes" in got.message, got.message
            got = raw_call(s, kvcache_pb2.ChannelRequest(call=kvcache_pb2.STORE, session_id=sid, hashes=chain[0],
                                                         block_ids=[3]))
            assert not got.code and list(got.statuses) == [STORED]  # the connection still serves (packed varints too)
            got = raw_call(s, kvcache_pb2.ChannelRequest(call=kvcache_pb2.LOAD, session_id=sid, hashes=chain[0],
                                                         block_ids_le32=le32([7])))
            assert not got.code and list(got.statuses) == [kvcache_pb2.LOADED]
        assert client.lookup(chain[:1]) == (1, [kvcache_pb2.TIER_HOST])


def test_a_store_whose_connection_closes_while_it_waits_for_the_disk_is_rolled_back():
    """Scenario: engine A fills the 16-block host tier with retained blocks 0-15, then sends the
    Store of 16-31 as a frame; it must spill 0-15 through a slow disk. While it waits for the write
    queue, A closes the connection. The daemon cancels that Store, as a cancelled gRPC call: the host
    tier's used bytes equal the bytes of its blocks, nothing is pinned, 16-31 are not stored, and
    engine B stores 32 new blocks and 16-31 themselves, loading them byte-exact."""
    d = slow_disk_daemon()
    try:
        d.start()
        with EngineProc(d.target) as b, ShmKVPool(32, BLOCK) as pool:
            for i in range(32):
                pool.write_block(i, content(i))
            with KVClient(d.target, Namespace("m", "float32", 16, "block-contiguous", 0, 1, ""), pool,
                          client_name="closes its connection") as a:
                rs = a.store([h(i) for i in range(16)], list(range(16)), 600)
                assert [r.status for r in rs] == [STORED] * 16
                s = connect(d)
                s.sendall(frame(kvcache_pb2.ChannelRequest(
                    call=kvcache_pb2.STORE, session_id=a.session_id, hashes=b"".join(h(i) for i in range(16, 32)),
                    block_ids=list(range(16, 32))).SerializeToString()))
                wait_for(lambda: (st := d.stats()).write_queue_depth + st.writes_in_progress >= 2,
                         "the framed Store to wait for the write queue")
                s.close()
                assert_nothing_left_and_others_store(d, b, 300)
        assert d.proc.poll() is None and "Traceback" not in d.log()
    finally:
        d.close()


def test_a_store_running_when_the_daemon_stops_answers_and_later_frames_are_refused():
    """Scenario: a framed Store waits for spills (a throttled disk) when the daemon is told to stop
    (SIGTERM). The Store still answers, every block STORED, within the shutdown grace; a frame sent
    after it is refused UNAVAILABLE (a stopping gRPC server's answer) or finds the connection
    closed; the daemon exits cleanly (status 0), its spills drained."""
    d = Daemon(host_capacity="64KiB", disk_capacity="1MiB",
               extra=["--write-queue-depth", "1", "--writer-threads", "1", "--admission-gate", "retained-only",
                      "--disk-write-bytes-per-second", "80000"])
    try:
        d.start()
        with ShmKVPool(32, BLOCK) as pool:
            for i in range(32):
                pool.write_block(i, content(i))
            with KVClient(d.target, Namespace("m", "float32", 16, "block-contiguous", 0, 1, ""), pool,
                          client_name="stops") as a:
                assert [r.status for r in a.store([h(i) for i in range(16)], list(range(16)), 600)] == [STORED] * 16
                s = connect(d)
                request = kvcache_pb2.ChannelRequest(
                    call=kvcache_pb2.STORE, session_id=a.session_id, hashes=b"".join(h(i) for i in range(16, 32)),
                    block_ids=list(range(16, 32)), ttl_seconds=600)
                s.sendall(frame(request.SerializeToString()))
                wait_for(lambda: (st := d.stats()).write_queue_depth + st.writes_in_progress >= 1,
                         "the framed Store to wait for the write queue")
                d.proc.send_signal(signal.SIGTERM)
                got = kvcache_pb2.ChannelReply.FromString(read_frame(s, 64 << 20))
                assert not got.code and list(got.statuses) == [STORED] * 16, got
                try:
                    s.sendall(frame(request.SerializeToString()))
                    after = kvcache_pb2.ChannelReply.FromString(read_frame(s, 64 << 20))
                    assert after.code == "UNAVAILABLE", after
                except (OSError, EOFError):
                    pass  # the channel closed first: the client goes to gRPC, which is stopping too
                s.close()
                assert d.proc.wait(30) == 0
        assert "Traceback" not in d.log()
    finally:
        d.close()


def test_more_calls_in_flight_than_connections_go_over_grpc(daemon, pool):
    """Scenario: an AsyncKVClient has more Stores and Loads in flight at once than the channel opens
    connections: every one is answered (the extra ones over gRPC), byte-exact, and the channel is
    still used afterwards."""
    n = MAX_ASYNC_CONNECTIONS + 4

    async def run() -> None:
        async with AsyncKVClient(daemon.target, NS, pool, client_name="busy") as client:
            chains = [client.hasher.hash_blocks(range(16 * 2 * k, 16 * (2 * k + 2))) for k in range(n)]
            stored = await asyncio.gather(*(client.store(c, [2 * k, 2 * k + 1]) for k, c in enumerate(chains)))
            assert all([r.status for r in rs] == [STORED] * 2 for rs in stored)
            loaded = await asyncio.gather(*(client.load(c, [32 + 2 * (k % 16), 33 + 2 * (k % 16)])
                                            for k, c in enumerate(chains[:16])))
            assert all([r.status for r in rs] == [kvcache_pb2.LOADED] * 2 for rs in loaded)
            channel = client._lookup_channel
            assert channel is not None and channel.usable and 0 < len(channel._idle) <= MAX_ASYNC_CONNECTIONS
    asyncio.run(run())
    # every block stored is whole (the loads above went to blocks the next one may overwrite: read now)
    with KVClient(daemon.target, NS, pool, client_name="check") as c:
        for k in range(4):
            chain = c.hasher.hash_blocks(range(16 * 2 * k, 16 * (2 * k + 2)))
            assert [r.status for r in c.load(chain, [60, 61])] == [kvcache_pb2.LOADED] * 2
            assert pool.read_block(60) == content(2 * k) and pool.read_block(61) == content(2 * k + 1)


def test_a_blocking_engine_stores_and_loads_from_its_own_thread_and_a_stalled_daemon_detaches_it(daemon, pool):
    """Scenario: a blocking engine (KVClient) stores and loads while its client's loop thread is held
    busy: the calls answer anyway, byte-exact (they go out on the caller's thread, not through the
    loop), and never over gRPC. Then the daemon stalls (SIGSTOP): a Load past the 1 s timeout
    answers MISSING "daemon unreachable" for every block and the client is detached when it
    returns (its session closed: no copy into those blocks can come later), a Store answers
    NOT_STORED; once the daemon resumes the client re-attaches and the blocks load exactly."""
    with KVClient(daemon.target, NS, pool, client_name="caller thread", timeout=1.0) as client:
        tried = refuse_grpc(client)
        chain = client.hasher.hash_blocks(range(16 * 8))
        gate, held, released = threading.Event(), threading.Event(), threading.Event()
        waited_out: list[bool] = []

        def hold() -> None:  # on the client's loop thread: nothing else runs there until the gate opens
            held.set()
            waited_out.append(not gate.wait(20))  # True: nobody opened it (a call waited for the loop)
            released.set()
        client._loop.call_soon_threadsafe(hold)
        assert held.wait(10)
        try:
            assert [r.status for r in client.store(chain, list(range(8)))] == [STORED] * 8
            for b in range(8, 16):
                pool.write_block(b, b"\0" * BLOCK)
            rs = client.load(chain, list(range(8, 16)))
            assert [r.status for r in rs] == [kvcache_pb2.LOADED] * 8
        finally:
            gate.set()
        assert released.wait(30) and waited_out == [False]  # both answered while the loop was held
        assert all(pool.read_block(8 + i) == content(i) for i in range(8))

        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            rs = client.load(chain, list(range(16, 24)))
            assert [(r.status, r.message) for r in rs] == [(kvcache_pb2.MISSING, "daemon unreachable")] * 8
            assert not client.attached
            rs = client.store(client.hasher.hash_blocks(range(1000, 1000 + 16 * 2)), [0, 1])
            assert [r.status for r in rs] == [kvcache_pb2.NOT_STORED] * 2
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        wait_for(lambda: client.attached, "the client re-attached", 30)
        for b in range(16, 24):
            pool.write_block(b, b"\0" * BLOCK)
        assert [r.status for r in client.load(chain, list(range(16, 24)))] == [kvcache_pb2.LOADED] * 8
        assert all(pool.read_block(16 + i) == content(i) for i in range(8))
        assert tried == []


@needs_root
def test_another_uid_cannot_store_or_load_with_a_session_it_learned():
    """Scenario: a process of uid 65534, which the daemon serves (allowed_uids, so its connection is
    kept), learns an engine's session id and sends Store and Load frames naming it: both are refused
    with PERMISSION_DENIED, nothing is stored, and the engine's own calls go on."""
    with Daemon(host_capacity="256KiB", disk_capacity="", extra=["--allowed-uids", str(STRANGER)]) as d, \
            ShmKVPool(8, BLOCK) as pool, KVClient(d.target, NS, pool, client_name="victim") as victim:
        os.chmod(d.dir, 0o711)  # the stranger may traverse (not list) the socket directory
        chain = victim.hasher.hash_blocks(range(16 * 4))
        victim.store(chain[:2], [0, 1])
        steps = [{"op": "lookup", "session": victim.session_id, "hashes": b"".join(chain[2:4]).hex(),
                  "call": call, "block_ids": [2, 3]} for call in (kvcache_pb2.STORE, kvcache_pb2.LOAD)]
        for r in as_stranger(d, *steps):
            assert r["code"] == "PERMISSION_DENIED" and "registered by another uid" in r["message"], r
        assert victim.lookup(chain[:4]) == (2, [kvcache_pb2.TIER_HOST] * 2)
        assert [r.status for r in victim.store(chain[2:4], [2, 3])] == [STORED] * 2
