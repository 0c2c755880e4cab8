"""The Lookup channel (kvservice/api/lookup_channel.py, engine_client/lookup_channel.py) against a
real daemon subprocess: the same answers as gRPC Lookup, the same refusals, the same access rule
(a session is looked up only by processes of the uid that registered it), and gRPC when the
channel is not there.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from engine_client import KVClient, Namespace, ShmKVPool
from harness.daemon import ROOT, Daemon, child_env
from kvwire.lookup_frames import HEADER, frame, lookup_socket_path, read_frame
from kvwire.v1 import kvcache_pb2, kvcache_pb2_grpc

NS = Namespace("lookup-channel", "float32", 16, "block-contiguous")
BLOCK = 4096
HOST, DISK = kvcache_pb2.TIER_HOST, kvcache_pb2.TIER_DISK
STRANGER = 65534  # nobody
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start a process of another uid")


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.01)


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    with Daemon(host_capacity="256KiB", disk_capacity="1MiB", lease_seconds=5) as d:
        yield d


@pytest.fixture
def pool() -> Iterator[ShmKVPool]:
    with ShmKVPool(64, BLOCK) as p:
        yield p


def grpc_lookup(d: Daemon, request: kvcache_pb2.LookupRequest) -> tuple[str, str, tuple[int, list[int]]]:
    """(status name, details, answer) of KVCache.Lookup over gRPC, for the same request."""
    with grpc.insecure_channel(d.target) as ch:
        try:
            r = kvcache_pb2_grpc.KVCacheStub(ch).Lookup(request, timeout=10)
        except grpc.RpcError as e:
            return e.code().name, e.details(), (0, [])
    return "OK", "", (r.prefix_blocks, list(r.tiers))


def channel_lookup(sock: socket.socket, payload: bytes) -> tuple[str, str, tuple[int, list[int]]]:
    """The same over a raw connection to the Lookup channel."""
    sock.sendall(frame(payload))
    r = kvcache_pb2.ChannelReply.FromString(read_frame(sock))
    return r.code or "OK", r.message, (r.prefix_blocks, list(r.tiers))


def connect(d: Daemon) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(lookup_socket_path(d.socket_path))
    return s


def test_lookup_channel_answers_what_grpc_lookup_answers_on_random_stored_and_evicted_sets(daemon, pool):
    """Scenario: random chains are stored into a 64-block host tier over a 256-block disk tier,
    more than both hold, so some blocks sit in host memory, some on disk, some are gone (heads
    evicted before tails, holes in chains). For random queries (whole chains, slices, shuffles,
    strangers' hashes spliced in) the engine's KVClient.lookup on the channel, a KVClient on gRPC
    only, and a raw gRPC Lookup answer exactly the same."""
    rng = random.Random(10)
    with KVClient(daemon.target, NS, pool, client_name="channel") as fast, \
            KVClient(daemon.target, NS, pool, client_name="grpc only", lookup_channel=False) as slow:
        assert fast.lookup_route == "lookup channel" and slow.lookup_route != "lookup channel"
        chains = [fast.hasher.hash_blocks(rng.sample(range(1 << 20), 16 * rng.randint(8, 60))) for _ in range(14)]
        for chain in rng.sample(chains, len(chains)):
            keep = chain[: rng.randint(len(chain) // 2, len(chain))]
            for lo in range(0, len(keep), 64):
                part = keep[lo:lo + 64]
                fast.store(part, list(range(len(part))))
            if rng.random() < 0.5:  # re-read a random prefix: LRU order differs from store order
                n, _ = fast.lookup(keep)
                fast.load(keep[: min(n, 64)], list(range(min(n, 64))))
        daemon.settle()
        strangers = slow.hasher.hash_blocks(rng.sample(range(1 << 20), 16 * 8))
        queries = []
        for chain in chains:
            lo = rng.randrange(len(chain))
            queries += [chain, chain[lo:], rng.sample(chain, len(chain)),
                        chain[:lo] + [strangers[lo % 8]] + chain[lo:], []]
        seen = set()
        for q in queries:
            via_channel = fast.lookup(q)
            assert via_channel == slow.lookup(q), q[:1]
            assert grpc_lookup(daemon, kvcache_pb2.LookupRequest(session_id=fast.session_id,
                                                                 hashes=b"".join(q)))[2] == via_channel
            n, tiers = via_channel
            seen |= set(tiers) | ({"short"} if n < len(q) else set()) | ({"whole"} if q and n == len(q) else set())
        assert seen >= {HOST, DISK, "short", "whole"}, seen  # every kind of answer was compared
        assert fast.lookup_route == "lookup channel"
        assert fast.submit_lookup(chains[0]).result(10) == slow.submit_lookup(chains[0]).result(10)


def test_bad_input_gets_the_status_grpc_lookup_gives(daemon, pool):
    """Scenario: a client sends the channel what it should not. Each malformed request is answered
    with the status and message gRPC Lookup gives the same request, on a connection that keeps
    serving; a frame longer than the largest valid request is refused and ends that connection;
    the daemon keeps serving everyone."""
    with KVClient(daemon.target, NS, pool, client_name="victim") as client:
        hashes = client.hasher.hash_blocks(range(16 * 4))
        client.store(hashes, [0, 1, 2, 3])
        sid = client.session_id
        max_blocks = client._client.max_batch_blocks
        cases = {
            "odd length": kvcache_pb2.LookupRequest(session_id=sid, hashes=b"".join(hashes) + b"x"),
            "unknown session": kvcache_pb2.LookupRequest(session_id="no-such-session", hashes=hashes[0]),
            "no session": kvcache_pb2.LookupRequest(hashes=hashes[0]),
            "another namespace": kvcache_pb2.LookupRequest(session_id=sid, hashes=hashes[0], namespace_id="abc"),
            "too many": kvcache_pb2.LookupRequest(session_id=sid, hashes=bytes(32) * (max_blocks + 1)),
        }
        with connect(daemon) as s:
            for name, req in cases.items():
                got = channel_lookup(s, req.SerializeToString())
                assert got == grpc_lookup(daemon, req), name
                assert got[0] != "OK" and got[1], name
            assert channel_lookup(s, b"\xff\xff\xff") == ("INVALID_ARGUMENT",
                                                          "the frame is not a ChannelRequest (kvservice.v1)", (0, []))
            ok = kvcache_pb2.LookupRequest(session_id=sid, hashes=b"".join(hashes)).SerializeToString()
            assert channel_lookup(s, ok) == ("OK", "", (4, [HOST] * 4))  # the same connection still serves
        with connect(daemon) as s:
            s.sendall(HEADER.pack(1 << 30))  # announces 1 GiB: refused before it is read
            r = kvcache_pb2.ChannelReply.FromString(read_frame(s))
            assert r.code == "RESOURCE_EXHAUSTED" and "longer than the largest valid request" in r.message
            assert s.recv(1) == b""  # and the connection is closed
        with connect(daemon) as s:
            s.sendall(HEADER.pack(100) + b"cut short")  # a client that dies inside a frame
        assert client.lookup(hashes) == (4, [HOST] * 4)
        assert client.lookup_route == "lookup channel"
        with pytest.raises(Exception) as info:
            client.lookup([b"short"])
        assert "INVALID_ARGUMENT" in str(info.value)


def test_lookup_falls_back_to_grpc_when_the_channel_is_gone(daemon, pool):
    """Scenario: the channel's socket is not there (an operator removed it). The engine's Lookups
    still answer, the same, over gRPC, blocking and as futures."""
    with KVClient(daemon.target, NS, pool, client_name="fallback") as client:
        hashes = client.hasher.hash_blocks(range(16 * 6))
        client.store(hashes, list(range(6)))
        assert client.lookup(hashes) == (6, [HOST] * 6) and client.lookup_route == "lookup channel"
        os.unlink(lookup_socket_path(daemon.socket_path))
        client._channel._drop_idle()  # what a new engine process would find: no connection yet
        assert client.lookup(hashes) == (6, [HOST] * 6)
        # the failed connect keeps the channel off for a second: gRPC, from this thread once its
        # synchronous channel is READY (its connect may still run: the Store went on the channel)
        assert client.lookup_route in ("grpc", "loop")
        assert client.submit_lookup(hashes).result(10) == (6, [HOST] * 6)


def test_a_restarted_daemon_is_asked_on_a_fresh_connection(daemon, pool):
    """Scenario: the daemon restarts under an engine that has a channel connection open. The old
    connection is broken; the client replaces it (it does not give the channel up) and answers
    from the new daemon."""
    with KVClient(daemon.target, NS, pool, client_name="restart") as client:
        hashes = client.hasher.hash_blocks(range(16 * 6))
        client.store(hashes, list(range(6)))
        assert client.lookup(hashes) == (6, [HOST] * 6)
        assert len(client._channel._idle) == 1  # the connection stays open for the next Lookup
        daemon.stop()
        daemon.start()  # host-only blocks do not survive a restart
        wait_for(lambda: client.attached and client.reattachments == 1, 30)
        assert client.lookup(hashes) == (0, [])
        assert client.lookup_route == "lookup channel"
        client.store(hashes, list(range(6)))
        assert client.lookup(hashes) == (6, [HOST] * 6)
        assert client.lookup_route == "lookup channel"  # the broken connection was replaced, not given up


def test_concurrent_callers_get_their_own_answers(daemon, pool):
    """Scenario: eight engine threads ask Lookups of different chains at once, blocking and as
    futures. Each gets its own chain's answer; the client opens at most MAX_CONNECTIONS blocking
    connections (callers beyond them take gRPC for that call)."""
    from engine_client.lookup_channel import MAX_CONNECTIONS

    with KVClient(daemon.target, NS, pool, client_name="threads") as client:
        chains = [client.hasher.hash_blocks(range(1000 * t, 1000 * t + 16 * 8)) for t in range(8)]
        for t, chain in enumerate(chains):
            client.store(chain[: t + 1], list(range(t + 1)))
        wrong: list[tuple[int, object]] = []

        def ask(t: int) -> None:
            want = (t + 1, [HOST] * (t + 1))
            for i in range(150):
                got = client.lookup(chains[t]) if i % 2 else client.submit_lookup(chains[t]).result(10)
                if got != want:
                    wrong.append((t, got))

        threads = [threading.Thread(target=ask, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not wrong, wrong[:3]
        assert client._channel._open <= MAX_CONNECTIONS
        assert client.lookup_route == "lookup channel"


async def test_async_client_asks_the_channel_too(daemon, pool):
    """Scenario: an asyncio engine (AsyncKVClient) asks the same Lookups: on the channel they
    answer what gRPC answers; a Lookup its caller cancels while the daemon stalls leaves no
    half-read answer behind (the next one answers its own question); a daemon that stays stalled
    past the timeout answers as an empty cache (detached, then re-attached); with the socket gone
    the Lookups go over gRPC."""
    from engine_client import AsyncKVClient

    async with AsyncKVClient(daemon.target, NS, pool, client_name="async", timeout=1.0) as client, \
            AsyncKVClient(daemon.target, NS, pool, client_name="async grpc", lookup_channel=False) as slow:
        chain = client.hasher.hash_blocks(range(16 * 40))
        await client.store(chain[:30], list(range(30)))
        other = client.hasher.hash_blocks(range(5000, 5000 + 16 * 4))
        for q in (chain, chain[:10], chain[29:], other, []):
            assert await client.lookup(q) == await slow.lookup(q)
        assert client._lookup_channel is not None and len(client._lookup_channel._idle) == 1
        assert slow._lookup_channel is None  # never used

        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            task = asyncio.ensure_future(client.lookup(chain))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert not client._lookup_channel._idle and client._lookup_channel._open == 0  # dropped: its late answer is nobody's
            t0 = time.monotonic()
            assert await client.lookup(chain) == (0, [])  # past the timeout: an empty cache's answer
            assert 0.9 < time.monotonic() - t0 < 30 and not client.attached  # after the 1 s timeout; not hung
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        for _ in range(3000):
            if client.attached:
                break
            await asyncio.sleep(0.01)
        assert client.attached
        assert await client.lookup(other) == (0, [])
        assert await client.lookup(chain) == (30, [HOST] * 30)

        os.unlink(lookup_socket_path(daemon.socket_path))
        client._lookup_channel._drop_idle()
        assert await client.lookup(chain) == (30, [HOST] * 30)  # over gRPC
        assert not client._lookup_channel.usable


def test_old_daemon_without_a_channel_is_asked_over_grpc():
    """Scenario: a daemon that predates the channel (its OpenSessionReply names no lookup_socket):
    every Lookup goes over gRPC, blocking and as a future."""
    from tests.test_engine_client_unit import StandInDaemon, serve

    with tempfile.TemporaryDirectory(prefix="kvc-") as d, ShmKVPool(16, 64) as pool:
        stand_in = StandInDaemon()
        server = serve(stand_in, f"{d}/kv.sock")
        try:
            with KVClient(f"{d}/kv.sock", NS, pool) as client:
                hashes = client.hasher.hash_blocks(range(16 * 3))
                client.store(hashes, [0, 1, 2])
                wait_for(lambda: client.lookup_route == "grpc")
                assert client.lookup(hashes) == (3, [HOST] * 3)
                assert client.submit_lookup(hashes).result(10) == (3, [HOST] * 3)
                assert [c for c in stand_in.calls if c[0] == "Lookup"]  # the stand-in answered them
        finally:
            server.stop(0).wait()
            stand_in.shutdown()


def test_a_cancelled_submit_lookup_on_the_channel_stays_quiet(daemon, pool, caplog):
    """Scenario: the daemon stalls (SIGSTOP) while an engine's scheduler sends Lookups. Each
    submit returns at once (the first on the pipelined connection, the rest, once that has
    enough in flight, on the client's Lookup thread); the engine gives up and cancels them; when
    the daemon resumes, the late answers are dropped without a trace, nothing detaches, and the
    next Lookup answers."""
    with KVClient(daemon.target, NS, pool, client_name="cancel") as client:
        hashes = client.hasher.hash_blocks(range(16 * 1024))
        client.store(hashes[:3], [0, 1, 2])
        assert client.submit_lookup(hashes).result(10) == (3, [HOST] * 3)
        session = client.session_id
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            with caplog.at_level(logging.DEBUG):
                t0 = time.monotonic()
                late = [client.submit_lookup(hashes) for _ in range(6)]  # 6 x 32 KiB: more than the pipeline takes
                # at once, not after the client's 30 s timeout (the bound leaves room for a loaded CI box)
                assert time.monotonic() - t0 < 5 and not any(f.done() for f in late)
                assert all(f.cancel() for f in late)
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        assert client._worker is not None  # some went the other way
        wait_for(lambda: not client._channel._pipeline._pending and client._worker._work_queue.empty())
        time.sleep(0.3)  # the Lookup thread has its answer by now
        assert not [r for r in caplog.records if r.exc_info or "InvalidStateError" in r.getMessage()]
        assert client.attached and client.session_id == session
        assert client.submit_lookup(hashes).result(10) == (3, [HOST] * 3)
        assert client.lookup(hashes) == (3, [HOST] * 3)


def test_a_stalled_daemon_answers_as_an_empty_cache_after_the_timeout(daemon, pool):
    """Scenario: the daemon hangs (SIGSTOP) past the client's timeout. A blocking Lookup and a
    submitted one answer as an empty cache would, like gRPC's DEADLINE_EXCEEDED; the client
    detaches and, once the daemon runs again, re-attaches and answers from the channel."""
    with KVClient(daemon.target, NS, pool, client_name="stall", timeout=1.0) as client:
        hashes = client.hasher.hash_blocks(range(16 * 3))
        client.store(hashes, [0, 1, 2])
        assert client.submit_lookup(hashes).result(10) == (3, [HOST] * 3)
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            submitted = client.submit_lookup(hashes)
            t0 = time.monotonic()
            assert client.lookup(hashes) == (0, [])
            # not before the 1 s timeout; the upper bound only says "does not hang" (a loaded CI box is slow)
            assert 0.9 < time.monotonic() - t0 < 30
            assert submitted.result(30) == (0, [])
            assert not client.attached
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        wait_for(lambda: client.attached, 30)
        assert client.lookup(hashes) == (3, [HOST] * 3) and client.lookup_route == "lookup channel"
        assert client.submit_lookup(hashes).result(10) == (3, [HOST] * 3)


PROBE = r"""
import json, os, socket, sys
sys.path.insert(0, os.getcwd())
from tests.uid_probe import drop_privileges
from engine_client import KVClient, Namespace, ShmKVPool
from kvwire.lookup_frames import frame, lookup_socket_path, read_frame
from kvwire.v1 import kvcache_pb2

uid, socket_path, steps = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
drop_privileges(uid)
out = [{"uid": os.getuid()}]
for step in steps:
    if step["op"] == "lookup":  # one raw request on a fresh connection to the channel (a Lookup, or "call")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        try:
            s.connect(lookup_socket_path(socket_path))
        except OSError as e:
            out.append({"code": "CONNECT", "message": str(e)})
            continue
        req = kvcache_pb2.ChannelRequest(session_id=step["session"], hashes=bytes.fromhex(step["hashes"]),
                                         namespace_id=step.get("namespace_id", ""), call=step.get("call", 0),
                                         block_ids=step.get("block_ids", []))
        try:
            s.sendall(frame(req.SerializeToString()))
        except OSError:
            pass  # refused at connect: the daemon's answer is already waiting to be read
        r = kvcache_pb2.ChannelReply.FromString(read_frame(s))
        out.append({"code": r.code or "OK", "message": r.message, "prefix": r.prefix_blocks})
        s.close()
    elif step["op"] == "client":  # an engine of this uid: its own session, the same namespace tuple
        ns = Namespace(*step["namespace"])
        with ShmKVPool(8, 4096) as pool, KVClient(socket_path, ns, pool, client_name="stranger") as c:
            hashes = c.hasher.hash_blocks(range(16 * 4))
            theirs = [bytes.fromhex(h) for h in step["theirs"]]
            before = c.lookup(theirs)
            c.store(hashes[:2], [0, 1])
            out.append({"route": c.lookup_route, "theirs": before[0], "own": c.lookup(hashes)[0]})
print(json.dumps(out))
"""


def as_stranger(d: Daemon, *steps: dict) -> list[dict]:
    r = subprocess.run([sys.executable, "-c", PROBE, str(STRANGER), d.socket_path, json.dumps(list(steps))],
                       cwd=str(ROOT), env=child_env(), capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    who, *results = json.loads(r.stdout.strip().splitlines()[-1])
    assert who == {"uid": STRANGER}
    return results


@needs_root
def test_another_uid_cannot_look_up_a_session_or_its_namespace():
    """Scenario: the victim engine (this uid) stores 4 blocks. uid 65534 reaches the channel's
    socket (0666, like the registration socket) and knows the victim's session id. On a daemon
    that does not serve it, its connection is refused (PERMISSION_DENIED naming its uid). On a
    daemon that serves it (allowed_uids), the victim's session is refused to it (PERMISSION_DENIED),
    and its own session of the very same namespace tuple does not see the victim's blocks; its
    own Lookups go over the channel. The victim keeps its answers."""
    for allowed in (False, True):
        extra = ["--allowed-uids", str(STRANGER)] if allowed else []
        with Daemon(host_capacity="256KiB", disk_capacity="", extra=extra) as d, ShmKVPool(8, BLOCK) as pool, \
                KVClient(d.target, NS, pool, client_name="victim") as victim:
            os.chmod(d.dir, 0o711)  # the stranger may traverse (not list) the socket directory
            hashes = victim.hasher.hash_blocks(range(16 * 4))
            victim.store(hashes, [0, 1, 2, 3])
            packed = b"".join(hashes).hex()
            steps = [{"op": "lookup", "session": victim.session_id, "hashes": packed},
                     {"op": "lookup", "session": victim.session_id, "hashes": packed,
                      "namespace_id": victim.namespace_id}]
            if allowed:
                steps.append({"op": "client", "namespace": [NS.model_id, NS.kv_dtype, NS.tokens_per_block, NS.layout],
                              "theirs": [x.hex() for x in hashes]})
            got = as_stranger(d, *steps)
            for r in got[:2]:
                assert r["code"] == "PERMISSION_DENIED" and r["prefix"] == 0, r
                if allowed:
                    assert "registered by another uid" in r["message"], r
                else:
                    assert f"uid {STRANGER} may not use this daemon" in r["message"], r
            if allowed:
                own = got[2]
                assert own["route"] == "lookup channel" and own["theirs"] == 0 and own["own"] == 2, own
            assert victim.lookup(hashes) == (4, [HOST] * 4) and victim.lookup_route == "lookup channel"
