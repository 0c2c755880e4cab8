"""engine_client without the real daemon: hashing, the shared-memory pool, and the client's
wire behaviour against a small in-test KVCache server (a stand-in that speaks the proto over a
real Unix socket and copies real bytes out of and into the registered pool)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import mmap
import os
import socket
import re
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent import futures
from dataclasses import replace
from multiprocessing import shared_memory
from pathlib import Path

import grpc
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_client import AsyncKVClient, BlockHasher, KVClient, KVClientError, Namespace, ShmKVPool
from engine_client.backoff import Backoff
from engine_client.hashing import CANARY_TOKENS, HASH_BYTES
from kvwire.peer_socket import recv_frame, registration_path, send_frame
from kvwire.v1 import kvcache_pb2, kvcache_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
NS = Namespace("tiny-llama", "float32", tokens_per_block=4, layout="block-contiguous")


def run_python(code: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60, check=False)


# ---------------------------------------------------------------- namespace and hashing

def test_canary_is_pinned_for_a_fixed_namespace():
    """Scenario: a refactor changes the hash function or the namespace encoding. The pinned
    value catches it before two deployed versions silently stop sharing blocks."""
    assert BlockHasher(NS).canary().hex() == "5fe0b0c6cc76ebfaae51a6d8fb5a34b5ea3fb0000e5c1e6423f5151804877863"
    assert len(CANARY_TOKENS) == 256 and all(0 <= t < 32000 for t in CANARY_TOKENS)


def test_hasher_matches_the_chain_formula_written_out_with_struct():
    """The documented wire formula, re-implemented independently: root from the namespace's
    length-prefixed canonical bytes, then blake2b-256(prev || little-endian int64 tokens)."""
    def s(text: str) -> bytes:
        return struct.pack("<I", len(text.encode())) + text.encode()

    canonical = (struct.pack("<H", 1) + s("tiny-llama") + s("float32") + struct.pack("<I", 4)
                 + s("block-contiguous") + struct.pack("<II", 0, 1) + s(""))
    assert NS.canonical_bytes() == canonical
    prev = hashlib.blake2b(b"kvservice.v1/root" + canonical, digest_size=32).digest()
    tokens = [5, -1, 2**40, 7, 1, 2, 3, 4]
    expected = []
    for i in range(0, 8, 4):
        prev = hashlib.blake2b(prev + struct.pack("<4q", *tokens[i : i + 4]), digest_size=32).digest()
        expected.append(prev)
    assert BlockHasher(NS).hash_blocks(tokens) == expected


def test_hashes_identical_across_processes_with_different_hash_seeds():
    """Scenario: two engine processes with different PYTHONHASHSEED hash the same prompt."""
    tokens = list(range(1000, 1037))
    code = (
        "from engine_client import BlockHasher, Namespace\n"
        f"h = BlockHasher({NS!r})\n"
        f"print(','.join(x.hex() for x in h.hash_blocks({tokens!r})))\n"
        "print(h.canary().hex())\n"
    )
    outs = []
    for seed in ("1", "4242"):
        proc = run_python(code, {"PYTHONHASHSEED": seed})
        assert proc.returncode == 0, proc.stderr
        outs.append(proc.stdout.split())
    local = BlockHasher(NS)
    expected = [",".join(x.hex() for x in local.hash_blocks(tokens)), local.canary().hex()]
    assert outs[0] == outs[1] == expected


@pytest.mark.parametrize("change", [
    {"model_id": "other-model"}, {"kv_dtype": "bfloat16"}, {"tokens_per_block": 2},
    {"layout": "layer-first"}, {"tp_rank": 1, "tp_size": 2}, {"tp_size": 2}, {"cache_salt": "lora-7"},
])
def test_every_namespace_field_changes_hashes_and_canary(change):
    """Scenario: a different model, rank, dtype or LoRA scope must never see this namespace's blocks."""
    other = replace(NS, **change)
    tokens = list(range(64))
    assert BlockHasher(other).hash_blocks(tokens)[0] != BlockHasher(NS).hash_blocks(tokens)[0]
    assert BlockHasher(other).canary() != BlockHasher(NS).canary()
    assert other.canonical_bytes() != NS.canonical_bytes()


def test_canonical_bytes_are_unambiguous_and_round_trip_through_proto():
    a = Namespace("ab", "c", 4, "x")
    b = Namespace("a", "bc", 4, "x")
    assert a.canonical_bytes() != b.canonical_bytes()
    assert Namespace.from_proto(NS.to_proto()) == NS
    assert NS.to_proto().tokens_per_block == 4


@pytest.mark.parametrize("bad", [{"tp_rank": 2, "tp_size": 2}, {"tokens_per_block": 0}, {"model_id": ""}, {"tp_size": 0}])
def test_invalid_namespace_is_rejected(bad):
    with pytest.raises(ValueError):
        replace(NS, **bad)


def test_chain_shares_prefix_and_diverges_after_first_difference():
    """Scenario: two prompts share 3 blocks, differ in block 3, then share tokens again.
    Every hash from block 3 on differs: a hash names the whole prefix, not one block."""
    h = BlockHasher(NS)
    a = list(range(24))
    b = a.copy()
    b[13] = 999  # inside block 3 (tokens 12..15)
    ha, hb = h.hash_blocks(a), h.hash_blocks(b)
    assert len(ha) == len(hb) == 6
    assert ha[:3] == hb[:3]
    assert all(x != y for x, y in zip(ha[3:], hb[3:]))
    assert len(set(ha)) == 6 and all(len(x) == HASH_BYTES for x in ha)


def test_trailing_partial_block_is_not_hashed():
    h = BlockHasher(NS)
    tokens = list(range(11))  # two full blocks of 4, then 3 tokens
    assert h.hash_blocks(tokens) == h.hash_blocks(tokens[:8])
    assert len(h.hash_blocks(tokens)) == 2
    assert h.hash_blocks(tokens[:3]) == []


@settings(max_examples=50, deadline=None)
@given(tokens=st.lists(st.integers(min_value=0, max_value=2**40), max_size=60), split_blocks=st.integers(0, 15))
def test_parent_continues_the_chain(tokens, split_blocks):
    """hash_blocks(a + b) == hash_blocks(a) + hash_blocks(b, parent=last hash of a), for whole blocks a."""
    h = BlockHasher(NS)
    cut = min(split_blocks, len(tokens) // 4) * 4
    head = h.hash_blocks(tokens[:cut])
    tail = h.hash_blocks(tokens[cut:], parent=head[-1] if head else None)
    assert h.hash_blocks(tokens) == head + tail


def test_tensor_input_hashes_like_a_list_and_bad_parent_is_refused():
    h = BlockHasher(NS)
    tokens = list(range(40))
    assert h.hash_blocks(torch.tensor(tokens)) == h.hash_blocks(tokens) == h.hash_blocks(tuple(tokens))
    with pytest.raises(ValueError, match="parent hash"):
        h.hash_blocks(tokens, parent=b"short")


def test_canary_covers_blocks_larger_than_the_canary():
    """tokens_per_block=1000 > 256 canary tokens: the canary is cycled to fill one block."""
    big = BlockHasher(replace(NS, tokens_per_block=1000))
    expected = big.hash_blocks((CANARY_TOKENS * 4)[:1000])[0]
    assert big.canary() == expected


# ---------------------------------------------------------------- shared-memory pool

def pattern(block_bytes: int, seed: int) -> bytes:
    return bytes((seed * 31 + i * 7) % 251 for i in range(block_bytes))


@pytest.mark.parametrize("layout,num_layers", [("block-contiguous", 1), ("layer-first", 3)])
def test_pool_round_trip_and_rows_land_where_description_says(layout, num_layers):
    """Scenario: the daemon copies block b using only description(): row b of every region,
    concatenated in region order, must be exactly the block's bytes."""
    with ShmKVPool(num_blocks=5, block_bytes=96, layout=layout, num_layers=num_layers) as pool:
        for b in range(5):
            pool.write_block(b, pattern(96, b))
        desc = pool.description()
        assert desc.num_blocks == 5 and desc.shm.size >= 5 * 96
        assert "name" not in kvcache_pb2.ShmHandle.DESCRIPTOR.fields_by_name  # the daemon gets a descriptor, never a name
        fd, = pool.registration_fds()
        try:
            assert os.fstat(fd).st_size == desc.shm.size and os.fstat(fd).st_ino == os.stat(f"/dev/shm/{pool.name}").st_ino
        finally:
            os.close(fd)
        assert len(desc.regions) == (1 if layout == "block-contiguous" else 2 * num_layers)
        assert sum(r.block_bytes for r in desc.regions) == 96
        whole = bytes(pool.buffer.tolist())
        for b in range(5):
            assert pool.read_block(b) == pattern(96, b)
            rows = b"".join(whole[r.offset + b * r.block_stride : r.offset + b * r.block_stride + r.block_bytes]
                            for r in desc.regions)
            assert rows == pattern(96, b)


def test_pool_rejects_bad_block_ids_and_sizes():
    with ShmKVPool(num_blocks=4, block_bytes=16) as pool:
        for bad in (-1, 4, 100):
            with pytest.raises(IndexError, match="out of range"):
                pool.read_block(bad)
            with pytest.raises(IndexError):
                pool.write_block(bad, bytes(16))
        with pytest.raises(TypeError):
            pool.read_block(1.5)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="16"):
            pool.write_block(0, bytes(15))
    with pytest.raises(ValueError, match="divisible"):
        ShmKVPool(num_blocks=2, block_bytes=30, layout="layer-first", num_layers=4)


def test_second_process_attaches_by_name_and_exits_without_unlinking():
    """Scenario: the daemon (another process) maps the pool by name, reads one block and writes
    another; when it exits, the owner's segment must still exist (resource_tracker pitfall)."""
    with ShmKVPool(num_blocks=3, block_bytes=32, layout="layer-first", num_layers=2) as pool:
        assert re.fullmatch(r"[A-Za-z0-9_.-]+", pool.name)
        pool.write_block(1, pattern(32, 1))
        proc = run_python(
            "from engine_client import ShmKVPool\n"
            f"p = ShmKVPool.attach({pool.name!r}, 3, 32, 'layer-first', 2)\n"
            "print(p.read_block(1).hex())\n"
            f"p.write_block(2, {pattern(32, 9)!r})\n"
            "p.close()\n"
        )
        assert proc.returncode == 0, proc.stderr
        assert "leaked" not in proc.stderr
        assert proc.stdout.strip() == pattern(32, 1).hex()
        assert pool.read_block(2) == pattern(32, 9)
        again = ShmKVPool.attach(pool.name, 3, 32, "layer-first", 2)  # still there after the child exited
        assert again.read_block(2) == pattern(32, 9)
        again.close()


def test_owner_exit_unlinks_the_segment():
    """Scenario: an engine creates its pool, maps it a second time in-process, and exits normally
    without calling unlink(). The segment is gone and the resource_tracker has nothing to say."""
    proc = run_python(
        "from engine_client import ShmKVPool\n"
        "p = ShmKVPool(2, 64)\n"
        "ShmKVPool.attach(p.name, 2, 64).close()\n"
        "print(p.name)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=proc.stdout.strip())


def test_buffer_views_outlive_close_and_pool_refuses_use_after_close():
    """A tensor taken from .buffer keeps the mapping alive; it never dangles after close()."""
    pool = ShmKVPool(num_blocks=2, block_bytes=8)
    pool.write_block(1, b"ABCDEFGH")
    view = pool.buffer[8:16]
    pool.close()
    pool.unlink()
    assert bytes(view.tolist()) == b"ABCDEFGH"
    with pytest.raises(ValueError, match="closed"):
        pool.read_block(1)
    with pytest.raises(ValueError, match="closed"):
        _ = pool.buffer
    pool.unlink()  # idempotent


# ---------------------------------------------------------------- client, no daemon at all

def unreachable_target() -> str:
    return f"unix://{tempfile.gettempdir()}/no-kvservice-{uuid.uuid4().hex[:8]}.sock"


def split(packed: bytes) -> list[bytes]:
    """The wire's packed hashes (n x 32 bytes) as a list."""
    assert len(packed) % 32 == 0, len(packed)
    return [packed[i:i + 32] for i in range(0, len(packed), 32)]


def assert_answers_like_an_empty_cache(results: dict) -> None:
    assert [r.status for r in results["load"]] == [kvcache_pb2.MISSING] * 3
    assert all(r.message == "daemon unreachable" for r in results["load"])
    assert [r.status for r in results["store"]] == [kvcache_pb2.NOT_STORED] * 3
    assert results["lookup"] == (0, [])
    assert results["prefetch"] == [kvcache_pb2.NOT_FOUND] * 3
    assert results["retain"] == [0.0] * 3


async def test_async_client_without_daemon_answers_misses_when_not_required():
    """Scenario: the engine starts before the daemon. Nothing raises; everything misses."""
    with ShmKVPool(num_blocks=4, block_bytes=16) as pool:
        client = AsyncKVClient(unreachable_target(), NS, pool, client_name="unit")
        await client.connect(required=False)
        hashes = client.hasher.hash_blocks(range(12))
        results = {
            "load": await client.load(hashes, [0, 1, 2]),
            "store": await client.store(hashes, [0, 1, 2], ttl_seconds=60),
            "lookup": await client.lookup(hashes),
            "prefetch": await client.prefetch(hashes),
            "retain": await client.retain(hashes, 60),
        }
        assert_answers_like_an_empty_cache(results)
        assert not client.attached and client.session_id == "" and client.reattachments == 0
        await client.close()
        with pytest.raises(KVClientError):
            await client.lookup(hashes)


async def test_async_client_without_daemon_raises_unavailable_when_required():
    with ShmKVPool(num_blocks=4, block_bytes=16) as pool:
        client = AsyncKVClient(unreachable_target(), NS, pool)
        with pytest.raises(KVClientError) as info:
            await client.connect()
        assert info.value.code == grpc.StatusCode.UNAVAILABLE


async def test_client_checks_arguments_before_sending():
    with ShmKVPool(num_blocks=4, block_bytes=16) as pool:
        client = AsyncKVClient(unreachable_target(), NS, pool)
        await client.connect(required=False)
        with pytest.raises(KVClientError, match="2 hashes but 1 block ids") as info:
            await client.load([b"a" * 32, b"b" * 32], [0])
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(KVClientError, match="hash 1 is 5 bytes"):
            await client.lookup([b"a" * 32, b"short"])
        await client.close()


def test_sync_client_required_connect_raises_and_optional_connect_misses():
    with ShmKVPool(num_blocks=4, block_bytes=16) as pool:
        client = KVClient(unreachable_target(), NS, pool)
        with pytest.raises(KVClientError) as info:
            client.connect()
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        client.close()

        client = KVClient(unreachable_target(), NS, pool)
        client.connect(required=False)
        hashes = client.hasher.hash_blocks(range(12))
        results = {
            "load": client.load(hashes, [0, 1, 2]),
            "store": client.store(hashes, [0, 1, 2]),
            "lookup": client.lookup(hashes),
            "prefetch": client.prefetch(hashes),
            "retain": client.retain(hashes, 5.0),
        }
        assert_answers_like_an_empty_cache(results)
        assert [r.status for r in client.submit_load(hashes, [0, 1, 2]).result(5)] == [kvcache_pb2.MISSING] * 3
        assert not client.attached
        client.close()
        client.close()  # idempotent


def test_backoff_doubles_to_cap_with_jitter():
    import random
    b = Backoff(0.05, 2.0, rng=random.Random(7))
    delays = [b.next() for _ in range(10)]
    bounds = [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0, 2.0]
    assert all(d / 2 <= x <= d for x, d in zip(delays, bounds))
    assert len(set(delays)) == 10  # jittered
    b.reset()
    assert 0.025 <= b.next() <= 0.05


# ---------------------------------------------------------------- client against a stand-in server

class StandInDaemon(kvcache_pb2_grpc.KVCacheServicer):
    """The smallest KVCache server that honours the proto: a registration socket that maps the
    descriptor the client passes, one host-tier dict, real copies out of and into that pool,
    canary check, sessions. Records what it was sent. As the real daemon, CloseSession returns
    once no Store or Load of the session is copying (a late Load of a closed client's session
    would otherwise write into an unmapped pool, and log that into whichever test runs next)."""

    def __init__(self, max_batch_blocks: int = 4, lease_seconds: float = 5.0) -> None:
        self.max_batch_blocks = max_batch_blocks
        self.lease_seconds = lease_seconds
        self.load_delay = 0.0
        self.lookup_delay = 0.0
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.copying: collections.Counter[str] = collections.Counter()  # session id -> Stores / Loads running
        self.sessions: dict[str, tuple[shared_memory.SharedMemory, list, int]] = {}
        self.blocks: dict[bytes, bytes] = {}
        self.canaries: dict[bytes, bytes] = {}
        self.calls: list[tuple[str, int]] = []
        self.heartbeats = 0
        self.closed: list[str] = []

    def OpenSession(self, request, fds):
        """What the registration socket does with one frame: a RegistrationReply."""
        key = request.namespace.SerializeToString(deterministic=True)
        with self.lock:
            if self.canaries.setdefault(key, request.hash_canary) != request.hash_canary:
                return kvcache_pb2.RegistrationReply(code="FAILED_PRECONDITION",
                                                     message="hash canary differs from this namespace's")
            sid = uuid.uuid4().hex
            self.sessions[sid] = (_Mapping(fds[0], request.pool.shm.size), list(request.pool.regions),
                                  request.pool.num_blocks)
        return kvcache_pb2.RegistrationReply(session=kvcache_pb2.OpenSessionReply(
            session_id=sid, namespace_id=hashlib.sha256(key).hexdigest()[:16], lease_seconds=self.lease_seconds,
            max_batch_blocks=self.max_batch_blocks, block_bytes=sum(r.block_bytes for r in request.pool.regions),
            label=f"s{len(self.closed) + len(self.sessions)}"))

    def serve_registration(self, path: str) -> None:
        """Accept registrations on `path` in a thread until shutdown(); leases stay open meanwhile."""
        self._reg = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._reg_path = path
        self._reg.bind(path)
        self._reg.listen(8)
        self._leases: list[socket.socket] = []

        def loop() -> None:
            while True:
                try:
                    conn, _ = self._reg.accept()
                except OSError:
                    return
                payload, fds = recv_frame(conn)
                reply = self.OpenSession(kvcache_pb2.OpenSessionRequest.FromString(payload), fds)
                for fd in fds:
                    os.close(fd)
                send_frame(conn, reply.SerializeToString())
                self._leases.append(conn)

        threading.Thread(target=loop, daemon=True).start()

    def Heartbeat(self, request, context):
        self._session(request.session_id, context)
        self.heartbeats += 1
        return kvcache_pb2.HeartbeatReply(lease_seconds=self.lease_seconds)

    def CloseSession(self, request, context):
        shm, _, _ = self._session(request.session_id, context)
        with self.lock:
            self.idle.wait_for(lambda: not self.copying[request.session_id], timeout=30)
            del self.sessions[request.session_id]
            self.closed.append(request.session_id)
        shm.close()
        return kvcache_pb2.CloseSessionReply()

    def Lookup(self, request, context):
        hashes = split(request.hashes)
        self._begin("Lookup", request, len(hashes), context)
        time.sleep(self.lookup_delay)
        n = 0
        while n < len(hashes) and hashes[n] in self.blocks:
            n += 1
        return kvcache_pb2.LookupReply(prefix_blocks=n, tiers=[kvcache_pb2.TIER_HOST] * n)

    def Store(self, request, context):
        with self._copying(request.session_id):
            return self._store(request, context)

    def _store(self, request, context):
        hashes = split(request.hashes)
        shm, regions, _ = self._begin("Store", request, len(hashes), context)
        assert len(request.block_ids) == len(hashes)
        for hh, block_id in zip(hashes, request.block_ids):
            self.blocks[hh] = b"".join(
                bytes(shm.buf[r.offset + block_id * r.block_stride:][: r.block_bytes]) for r in regions)
        deadline = time.time() + request.ttl_seconds if request.ttl_seconds > 0 else 0.0
        return kvcache_pb2.StoreReply(statuses=[kvcache_pb2.STORED] * len(hashes),
                                      deadlines=[deadline] * len(hashes) if deadline else [])

    @contextlib.contextmanager
    def _copying(self, session_id: str):
        with self.lock:
            self.copying[session_id] += 1
        try:
            yield
        finally:
            with self.lock:
                self.copying[session_id] -= 1
                self.idle.notify_all()

    def Load(self, request, context):
        with self._copying(request.session_id):
            return self._load(request, context)

    def _load(self, request, context):
        hashes = split(request.hashes)
        shm, regions, _ = self._begin("Load", request, len(hashes), context)
        assert len(request.block_ids) == len(hashes)
        time.sleep(self.load_delay)
        statuses, tiers = [], []
        for hh, block_id in zip(hashes, request.block_ids):
            data = self.blocks.get(hh)
            if data is None:
                statuses.append(kvcache_pb2.MISSING)
                tiers.append(kvcache_pb2.TIER_UNSPECIFIED)
                continue
            pos = 0
            for r in regions:
                start = r.offset + block_id * r.block_stride
                shm.buf[start : start + r.block_bytes] = data[pos : pos + r.block_bytes]
                pos += r.block_bytes
            statuses.append(kvcache_pb2.LOADED)
            tiers.append(kvcache_pb2.TIER_HOST)
        return kvcache_pb2.LoadReply(statuses=statuses, tiers=tiers)

    def Prefetch(self, request, context):
        hashes = split(request.hashes)
        self._begin("Prefetch", request, len(hashes), context)
        return kvcache_pb2.PrefetchReply(results=[
            kvcache_pb2.ALREADY_IN_HOST if h in self.blocks else kvcache_pb2.NOT_FOUND for h in hashes])

    def Retain(self, request, context):
        hashes = split(request.hashes)
        self._begin("Retain", request, len(hashes), context)
        return kvcache_pb2.RetainReply(deadlines=[
            time.time() + request.ttl_seconds if h in self.blocks else 0.0 for h in hashes])

    def _session(self, session_id, context):
        with self.lock:
            found = self.sessions.get(session_id)
        if found is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown session {session_id!r}")
        return found

    def _begin(self, rpc, request, count, context):
        session = self._session(request.session_id, context)
        self.calls.append((rpc, count))
        if count > self.max_batch_blocks:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{count} blocks > max_batch_blocks")
        for block_id in getattr(request, "block_ids", ()):
            if block_id >= session[2]:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"block id {block_id} >= pool size {session[2]}")
        return session

    def shutdown(self) -> None:
        with contextlib.suppress(OSError):
            self._reg.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        self._reg.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._reg_path)
        for conn in self._leases:
            conn.close()
        with self.lock:
            for shm, _, _ in self.sessions.values():
                shm.close()
            self.sessions.clear()


class _Mapping:
    """The stand-in's map of a pool descriptor (what the real daemon does in engine_memory)."""

    def __init__(self, fd: int, size: int) -> None:
        self._mm = mmap.mmap(fd, size)
        self.buf = memoryview(self._mm)

    def close(self) -> None:
        self.buf.release()
        self._mm.close()


def serve(daemon: StandInDaemon, socket_path: str) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    kvcache_pb2_grpc.add_KVCacheServicer_to_server(daemon, server)
    server.add_insecure_port(f"unix://{socket_path}")
    server.start()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(registration_path(socket_path))
    daemon.serve_registration(registration_path(socket_path))
    return server


@pytest.fixture
def socket_path():
    with tempfile.TemporaryDirectory(prefix="kvc-") as d:  # short: Unix socket paths max out at 107 bytes
        yield f"{d}/kv.sock"


@pytest.fixture
def daemon(socket_path):
    d = StandInDaemon()
    server = serve(d, socket_path)
    yield d
    server.stop(0).wait()
    d.shutdown()


@pytest.fixture
def pool():
    with ShmKVPool(num_blocks=16, block_bytes=64, layout="layer-first", num_layers=2) as p:
        yield p


async def eventually(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_store_then_load_moves_real_bytes_in_batches_of_max_batch_blocks(daemon, socket_path, pool):
    """Scenario: store 6 blocks, let the engine reuse them, load the chain back into other blocks.
    The daemon accepts 4 blocks per call, so every 6-block call goes out as 4 + 2."""
    async with AsyncKVClient(socket_path, NS, pool, client_name="unit") as client:
        assert client.attached and client.session_id in daemon.sessions and client.namespace_id
        hashes = client.hasher.hash_blocks(range(24))
        for b in range(6):
            pool.write_block(b, pattern(64, b))
        stored = await client.store(hashes, list(range(6)), ttl_seconds=60)
        assert [r.status for r in stored] == [kvcache_pb2.STORED] * 6 and all(r.deadline > 0 for r in stored)
        for b in range(16):
            pool.write_block(b, bytes(64))
        assert await client.lookup(hashes) == (6, [kvcache_pb2.TIER_HOST] * 6)
        loaded = await client.load(hashes, list(range(10, 16)))
        assert [r.status for r in loaded] == [kvcache_pb2.LOADED] * 6
        assert [pool.read_block(10 + i) for i in range(6)] == [pattern(64, i) for i in range(6)]
        assert await client.prefetch(hashes[:5]) == [kvcache_pb2.ALREADY_IN_HOST] * 5
        assert all(d > time.time() for d in await client.retain(hashes, 120))
        assert daemon.calls[:4] == [("Store", 4), ("Store", 2), ("Lookup", 4), ("Lookup", 2)]
        assert ("Load", 4) in daemon.calls and ("Load", 2) in daemon.calls
        session_id = client.session_id
    assert daemon.closed == [session_id]


async def test_lookup_stops_at_the_first_chunk_that_is_not_fully_stored(daemon, socket_path, pool):
    async with AsyncKVClient(socket_path, NS, pool) as client:
        hashes = client.hasher.hash_blocks(range(40))
        await client.store(hashes[:5], list(range(5)))
        daemon.calls.clear()
        assert await client.lookup(hashes) == (5, [kvcache_pb2.TIER_HOST] * 5)
        assert daemon.calls == [("Lookup", 4), ("Lookup", 4)]


async def test_wrong_hash_canary_is_refused_loudly(daemon, socket_path, pool):
    """Scenario: an engine build that hashes differently joins a namespace: it must fail at
    connect, even with required=False, instead of silently getting 0% hits."""
    daemon.canaries[NS.to_proto().SerializeToString(deterministic=True)] = b"\x00" * 32
    for required in (True, False):
        client = AsyncKVClient(socket_path, NS, pool)
        with pytest.raises(KVClientError) as info:
            await client.connect(required=required)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "canary" in info.value.message
    assert daemon.sessions == {}


async def test_bad_request_raises_and_the_session_survives(daemon, socket_path, pool):
    async with AsyncKVClient(socket_path, NS, pool) as client:
        hashes = client.hasher.hash_blocks(range(4))
        with pytest.raises(KVClientError) as info:
            await client.load(hashes, [99])
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "99" in info.value.message
        assert client.attached
        assert (await client.store(hashes, [0]))[0].status == kvcache_pb2.STORED


async def test_daemon_restart_gives_misses_then_reattaches_with_the_pool(socket_path, pool):
    """Scenario: the daemon restarts under a running engine. Calls during the outage miss without
    raising; the client re-opens a session (re-registering its pool) once the daemon is back."""
    first = StandInDaemon()
    server = serve(first, socket_path)
    async with AsyncKVClient(socket_path, NS, pool, heartbeat_interval=0.05) as client:
        hashes = client.hasher.hash_blocks(range(8))
        old_session = client.session_id
        server.stop(0).wait()
        first.shutdown()
        loaded = await client.load(hashes, [0, 1])
        assert [(r.status, r.message) for r in loaded] == [(kvcache_pb2.MISSING, "daemon unreachable")] * 2
        assert not client.attached
        assert (await client.store(hashes, [0, 1]))[0].status == kvcache_pb2.NOT_STORED

        second = StandInDaemon()
        server = serve(second, socket_path)
        try:
            await eventually(lambda: client.attached)
            assert client.reattachments == 1
            assert client.session_id != old_session and client.session_id in second.sessions
            pool.write_block(0, pattern(64, 3))
            assert (await client.store(hashes[:1], [0]))[0].status == kvcache_pb2.STORED
            assert (await client.load(hashes[:1], [5]))[0].status == kvcache_pb2.LOADED
            assert pool.read_block(5) == pattern(64, 3)
        finally:
            await client.close()
            server.stop(0).wait()
            second.shutdown()


async def test_reaped_session_is_reopened_by_the_heartbeat(daemon, socket_path, pool):
    """Scenario: the daemon forgot the session (lease reaped). The next heartbeat gets NOT_FOUND
    and the client re-opens a session without any data call noticing first."""
    async with AsyncKVClient(socket_path, NS, pool) as client:
        daemon.lease_seconds = 0.15  # the next heartbeat reply shortens the interval to 0.05 s
        old = client.session_id
        daemon.sessions.pop(old)[0].close()
        await eventually(lambda: client.reattachments == 1 and client.attached)
        assert client.session_id != old
        beats = daemon.heartbeats
        await eventually(lambda: daemon.heartbeats >= beats + 3)
        assert old not in daemon.closed  # NOT_FOUND: nothing left to close


async def test_slow_daemon_times_out_into_misses_and_stale_session_is_closed(daemon, socket_path, pool):
    """Scenario: a Load outlives the per-call timeout. The engine gets misses (and recomputes);
    the client detaches, closes the stale session so the daemon drops its pins, and re-attaches."""
    async with AsyncKVClient(socket_path, NS, pool, timeout=0.2) as client:
        hashes = client.hasher.hash_blocks(range(4))
        await client.store(hashes, [0])
        old = client.session_id
        daemon.load_delay = 0.5
        assert [r.status for r in await client.load(hashes, [1])] == [kvcache_pb2.MISSING]
        daemon.load_delay = 0.0
        await eventually(lambda: client.attached)
        assert old in daemon.closed and client.reattachments == 1
        assert [r.status for r in await client.load(hashes, [1])] == [kvcache_pb2.LOADED]


def test_sync_client_round_trip_and_futures(daemon, socket_path, pool):
    with KVClient(socket_path, NS, pool, client_name="sync") as client:
        assert client.attached
        hashes = client.hasher.hash_blocks(range(12))
        for b in range(3):
            pool.write_block(b, pattern(64, 20 + b))
        assert [r.status for r in client.submit_store(hashes, [0, 1, 2]).result(10)] == [kvcache_pb2.STORED] * 3
        assert client.lookup(hashes) == (3, [kvcache_pb2.TIER_HOST] * 3)
        assert [r.status for r in client.load(hashes, [7, 8, 9])] == [kvcache_pb2.LOADED] * 3
        assert [pool.read_block(b) for b in (7, 8, 9)] == [pattern(64, 20 + i) for i in range(3)]
        session_id = client.session_id
    assert daemon.closed == [session_id]


def test_sync_client_lookup_goes_out_on_the_callers_thread(daemon, socket_path, pool):
    """Scenario: the facade sends Lookup (blocking, and as a future) on its own synchronous channel
    from the caller's thread, so it answers while the client's loop thread is busy; a session the
    daemon forgot answers as an empty cache would, and the client re-attaches as after any call."""
    with KVClient(socket_path, NS, pool, client_name="sync") as client:
        hashes = client.hasher.hash_blocks(range(12))
        assert [r.status for r in client.store(hashes[:2], [0, 1])] == [kvcache_pb2.STORED] * 2
        deadline = time.monotonic() + 10
        while not client.lookup_channel_ready and time.monotonic() < deadline:  # it connects at connect()
            time.sleep(0.01)
        assert client.lookup_channel_ready
        gate = threading.Event()
        client._loop.call_soon_threadsafe(gate.wait, 30)  # the loop thread is blocked until gate is set
        try:
            assert client.submit_lookup(hashes).result(10) == (2, [kvcache_pb2.TIER_HOST] * 2)
            assert client.lookup(hashes[:1]) == (1, [kvcache_pb2.TIER_HOST])
            with pytest.raises(KVClientError) as info:
                client.submit_lookup([b"short"])
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            gate.set()
        old = client.session_id
        with daemon.lock:
            del daemon.sessions[old]  # the daemon restarted, say: NOT_FOUND
        assert client.submit_lookup(hashes).result(10) == (0, [])
        deadline = time.monotonic() + 10
        while not (client.attached and client.session_id != old) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.attached and client.session_id != old
        assert client.lookup(hashes) == (2, [kvcache_pb2.TIER_HOST] * 2)


def test_a_cancelled_lookup_future_is_dropped_quietly(daemon, socket_path, pool, caplog):
    """Scenario: the engine's scheduler gives up on a slow Lookup and cancels its future. The late
    answer is dropped (no InvalidStateError in gRPC's callback), the cancel detaches nothing, and
    the next Lookup answers."""
    with KVClient(socket_path, NS, pool, client_name="cancel") as client:
        hashes = client.hasher.hash_blocks(range(12))
        assert [r.status for r in client.store(hashes[:2], [0, 1])] == [kvcache_pb2.STORED] * 2
        deadline = time.monotonic() + 10
        while not client.lookup_channel_ready and time.monotonic() < deadline:
            time.sleep(0.01)
        daemon.lookup_delay = 0.3
        session = client.session_id
        with caplog.at_level("DEBUG"):
            late = client.submit_lookup(hashes)
            assert late.cancel() and late.cancelled()
            time.sleep(0.6)  # the daemon's answer would have come by now
        assert not [r for r in caplog.records if r.exc_info or "InvalidStateError" in r.getMessage()]
        daemon.lookup_delay = 0.0
        assert client.attached and client.session_id == session
        assert client.submit_lookup(hashes).result(10) == (2, [kvcache_pb2.TIER_HOST] * 2)


def test_sync_client_lookup_waits_out_a_restart_on_the_async_path(socket_path, pool):
    """Scenario: the daemon restarts. Until the facade's synchronous channel has reconnected (it
    backs off like any channel), Lookup takes the async client's path instead of failing on a
    channel in TRANSIENT_FAILURE (which would detach the freshly re-attached client again)."""
    first = StandInDaemon()
    server = serve(first, socket_path)
    client = KVClient(socket_path, NS, pool, client_name="restart")
    client.connect()
    try:
        hashes = client.hasher.hash_blocks(range(12))
        assert [r.status for r in client.store(hashes[:2], [0, 1])] == [kvcache_pb2.STORED] * 2
        server.stop(0).wait()
        first.shutdown()
        assert client.lookup(hashes) == (0, [])  # the daemon is gone: an empty cache's answer
        second = StandInDaemon()
        second.blocks = dict(first.blocks)  # the restarted daemon still has the blocks (its disk tier)
        server = serve(second, socket_path)
        deadline = time.monotonic() + 10
        while not client.attached and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.attached
        answers = [client.lookup(hashes) for _ in range(20)]  # right after re-attaching
        assert answers == [(2, [kvcache_pb2.TIER_HOST] * 2)] * 20
        assert client.reattachments == 1
        second.shutdown()
    finally:
        client.close()
        server.stop(0).wait()


async def test_reattach_refused_for_a_canary_mismatch_makes_data_calls_raise(daemon, socket_path, pool):
    """Scenario: while detached, the namespace was claimed by a build that hashes differently.
    Re-attaching is refused with FAILED_PRECONDITION; retrying cannot help, so the client stops
    and every data call raises that error rather than missing silently forever."""
    async with AsyncKVClient(socket_path, NS, pool, heartbeat_interval=0.05) as client:
        daemon.canaries[NS.to_proto().SerializeToString(deterministic=True)] = b"\x01" * 32
        daemon.sessions.pop(client.session_id)[0].close()
        await eventually(lambda: client.error is not None)
        assert client.error.code == grpc.StatusCode.FAILED_PRECONDITION and not client.attached
        with pytest.raises(KVClientError) as info:
            await client.lookup(client.hasher.hash_blocks(range(4)))
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
