"""Access control with real processes of two uids (issue 11; docs/operations.md, "Security model").

The daemon and the victim engine run as this test's uid (root here and on CI); the stranger is
tests/uid_probe.py, which drops to uid 65534 with os.setuid before it does anything. The daemon's socket directory is made searchable
(0711) so the stranger reaches the registration socket (mode 0666): each refusal below is the
daemon's decision on the kernel's SO_PEERCRED, unless the test says the kernel refuses (the
data sockets are 0600, each owned by the uid it serves).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import grpc
import pytest

from harness.blocks import h
from harness.daemon import ROOT, Daemon, child_env
from harness.engine import EngineProc
from kvservice.ops.config import ConfigError, load_config
from kvwire.v1 import admin_pb2, admin_pb2_grpc, kvcache_pb2, kvcache_pb2_grpc

STRANGER = 65534  # nobody
TOKEN = "access-test-token"
STORED, LOADED = 1, 1


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start a process of another uid")


def as_stranger(d: Daemon, *steps: dict) -> list[dict]:
    """Run the steps in one uid-65534 process against daemon `d`; its results, one per step."""
    r = subprocess.run([sys.executable, "-m", "tests.uid_probe", str(STRANGER), d.socket_path, json.dumps(list(steps))],
                       cwd=str(ROOT), env=child_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    who, *results = json.loads(r.stdout.strip().splitlines()[-1])
    assert who == {"uid": STRANGER, "gid": STRANGER}
    return results


def reachable_daemon(**kw) -> Daemon:
    d = Daemon(**kw)
    os.chmod(d.dir, 0o711)  # the stranger may traverse (not list) the socket directory
    return d


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    """No allowed_uids: only this uid and root may open sessions. TCP on, with an admin token."""
    with reachable_daemon(tcp=True, env={"KVSERVICE_ADMIN_TOKEN": TOKEN}) as d:
        yield d


@pytest.fixture
def shared() -> Iterator[Daemon]:
    """uid 65534 is allowed: it gets sessions of its own, on a data socket of its own."""
    with reachable_daemon(extra=["--allowed-uids", str(STRANGER), "--max-sessions-per-uid", "2"],
                          env={"KVSERVICE_ADMIN_TOKEN": TOKEN}) as d:
        yield d


def victim_digest(e: EngineProc, blocks: list[int]) -> list[str]:
    return e.call("read", blocks=blocks)["sha256"]


def store_step(target: str, session: str, pairs: list[tuple[int, int]]) -> dict:
    return {"op": "call", "target": target, "method": "Store", "session": session,
            "blocks": [[h(i).hex(), b] for i, b in pairs]}


def load_step(target: str, session: str, pairs: list[tuple[int, int]]) -> dict:
    return {"op": "call", "target": target, "method": "Load", "session": session,
            "blocks": [[h(i).hex(), b] for i, b in pairs]}


@needs_root
def test_another_uid_cannot_open_a_session_reach_a_pool_over_tcp_or_use_a_learned_id(daemon):
    """Scenario: the victim engine (this uid) stores blocks 0-3. uid 65534, which the daemon does
    not serve, learns the victim's session id. It is refused at registration by the daemon
    (PERMISSION_DENIED naming its uid); the data socket refuses it in the kernel (EACCES); over
    TCP the data plane does not exist (UNIMPLEMENTED) and Evict is refused (read-only Admin), and
    ListSessions never shows the id. The victim's blocks, pool and session are untouched, and it
    keeps working as before."""
    with EngineProc(daemon.target) as victim:
        assert victim.call("store", numbers=[0, 1, 2, 3])["status"] == [STORED] * 4
        sid = victim.hello["session"]
        before = victim_digest(victim, list(range(8)))
        tcp = daemon.tcp_address
        got = as_stranger(
            daemon,
            {"op": "register"},
            {"op": "connect", "path": daemon.socket_path},
            store_step(tcp, sid, [(90, 0)]),
            load_step(tcp, sid, [(0, 1)]),
            {"op": "call", "target": tcp, "method": "CloseSession", "session": sid},
            {"op": "admin", "target": tcp, "method": "ListSessions"},
            {"op": "admin", "target": tcp, "method": "Evict", "request": {"all": True}},
            {"op": "admin", "target": tcp, "method": "Evict", "request": {"all": True, "admin_token": TOKEN}},
            store_step(f"unix:{daemon.socket_path}", sid, [(90, 0)]),
        )
        reg, conn, tcp_store, tcp_load, tcp_close, listing, evict, evict_token, unix_store = got
        assert reg["code"] == "PERMISSION_DENIED" and f"uid {STRANGER} may not open sessions" in reg["message"]
        assert conn["errno"] == "EACCES"  # the kernel: the data socket is 0600
        for r in (tcp_store, tcp_load, tcp_close):
            assert r["code"] == "UNIMPLEMENTED", r
        assert listing["code"] == "OK" and sid not in json.dumps(listing)
        assert [s["label"] for s in listing["reply"]["sessions"]] == [victim.hello["label"]]
        for r in (evict, evict_token):
            assert r["code"] == "PERMISSION_DENIED" and "read-only Admin" in r["details"], r
        assert unix_store["code"] == "UNAVAILABLE"  # cannot connect at all

        assert victim_digest(victim, list(range(8))) == before
        assert victim.call("state") == {"attached": True, "session": sid, "label": victim.hello["label"],
                                        "reattachments": 0}
        assert victim.call("lookup", numbers=[0, 1, 2, 3])["prefix"] == 4
        loaded = victim.call("load", numbers=[0, 1, 2, 3])
        assert loaded["status"] == [LOADED] * 4 and all(loaded["exact"])
        assert victim.call("lookup", numbers=[90])["prefix"] == 0

        # a CUDA IPC handle is refused the same way: the uid is checked before any handle is opened
        (cuda,) = as_stranger(daemon, {"op": "register", "cuda_handle": "00" * 64})
        assert cuda["code"] == "PERMISSION_DENIED" and f"uid {STRANGER}" in cuda["message"]


@needs_root
def test_an_allowed_uid_gets_its_own_data_socket_and_cannot_use_a_learned_session_id(shared):
    """Scenario: uid 65534 is allowed. It opens a session of its own, served on its own data
    socket (socket_path.uid65534), and stores and loads its own blocks there. Given the victim's
    session id, every call naming it on that socket is refused by the daemon (PERMISSION_DENIED),
    and the victim's socket refuses the stranger in the kernel. Nothing of the victim changes."""
    d = shared
    with EngineProc(d.target) as victim:
        assert victim.call("store", numbers=[0, 1])["status"] == [STORED] * 2
        sid = victim.hello["session"]
        before = victim_digest(victim, list(range(8)))
        mine = f"unix:{d.socket_path}.uid{STRANGER}"
        got = as_stranger(
            d,
            {"op": "register", "fill": "STRANGER"},
            store_step(mine, "$own", [(50, 3)]),
            load_step(mine, "$own", [(50, 7)]),
            {"op": "read", "blocks": [7]},
            store_step(mine, sid, [(60, 0)]),
            load_step(mine, sid, [(0, 1)]),
            {"op": "call", "target": mine, "method": "Heartbeat", "session": sid},
            {"op": "call", "target": mine, "method": "CloseSession", "session": sid},
            {"op": "call", "target": mine, "method": "Lookup", "session": sid, "hashes": [h(0).hex()]},
            {"op": "connect", "path": d.socket_path},
        )
        reg, own_store, own_load, own_read, *theirs, conn = got
        assert reg["code"] == "OK" and reg["data_socket"] == f"{d.socket_path}.uid{STRANGER}"
        assert own_store["results"][0]["status"] == "STORED"
        assert own_load["results"][0]["status"] == "LOADED"
        assert bytes.fromhex(own_read["blocks"][0]) == (b"STRANGER" * 512)[:4096]
        for r in theirs:
            assert r["code"] == "PERMISSION_DENIED" and "registered by another peer" in r["details"], r
            assert sid not in r["details"]
        assert conn["errno"] == "EACCES"
        st = os.stat(f"{d.socket_path}.uid{STRANGER}")
        assert (st.st_uid, st.st_mode & 0o777) == (STRANGER, 0o600)

        assert victim_digest(victim, list(range(8))) == before
        assert victim.call("state")["attached"] is True
        assert victim.call("store", numbers=[60])["status"] == [STORED]  # not taken by the stranger's try

        # engine_client itself, run by that uid: registers, follows the daemon to its data socket, round-trips
        (client,) = as_stranger(d, {"op": "client"})
        assert client["ready"], client
        assert client["data_target"] == f"unix://{d.socket_path}.uid{STRANGER}"
        assert client["stored"] == [STORED] * 4 and client["loaded"] == [LOADED] * 4 and all(client["exact"])
        loaded = victim.call("load", numbers=[0, 1])
        assert loaded["status"] == [LOADED] * 2 and all(loaded["exact"])


@needs_root
def test_a_session_moves_bytes_only_between_the_daemon_and_memory_its_peer_passed(shared):
    """Scenario: the victim's pool holds its blocks. The stranger (another uid, same model and
    layout) registers a pool of its own, stores its blocks 0-7 and loads one back into its block 9:
    the bytes are its own memory's. Its namespace is its own tenant's (another id than the
    victim's), so the victim's block 0 is MISSING to it and its blocks are invisible to the
    victim. Ids past its own pool are refused. The victim's pool is byte for byte what it was."""
    d = shared
    with EngineProc(d.target) as victim:
        assert victim.call("store", numbers=[0])["status"] == [STORED]
        before = victim_digest(victim, list(range(64)))
        mine = f"unix:{d.socket_path}.uid{STRANGER}"
        got = as_stranger(
            d,
            {"op": "register", "blocks": 16, "fill": "OWN"},
            store_step(mine, "$own", [(100 + b, b) for b in range(8)]),
            load_step(mine, "$own", [(100, 9)]),
            {"op": "read", "blocks": [9]},
            load_step(mine, "$own", [(0, 10)]),
            load_step(mine, "$own", [(0, 16)]),
            store_step(mine, "$own", [(200, 40)]),
        )
        reg, store, load, read, theirs, past_load, past_store = got
        assert reg["code"] == "OK" and reg["namespace"] != victim.hello["namespace"]
        assert [r["status"] for r in store["results"]] == ["STORED"] * 8
        assert load["results"][0]["status"] == "LOADED"
        assert bytes.fromhex(read["blocks"][0]) == (b"OWN" * 2000)[:4096]  # its own memory's bytes, in its pool
        assert theirs["results"][0]["status"] == "MISSING"
        for r in (past_load, past_store):
            assert r["code"] == "INVALID_ARGUMENT" and "outside the pool's 16 blocks" in r["details"], r
        assert victim_digest(victim, list(range(64))) == before
        assert victim.call("lookup", numbers=[100, 101])["prefix"] == 0
        assert victim.call("load", numbers=[0])["exact"] == [True]

    with pytest.raises(KeyError):  # the OpenSession RPC that took a segment name is gone from the data plane
        kvcache_pb2.DESCRIPTOR.services_by_name["KVCache"].methods_by_name["OpenSession"]


@needs_root
def test_per_uid_session_caps_hold_while_other_uids_connect(shared):
    """Scenario: max_sessions_per_uid = 2. This uid has an engine open; uid 65534 tries to open 3
    sessions: the third is refused with RESOURCE_EXHAUSTED naming its uid and the cap, while this
    uid still opens its second session and serves (4 sessions open in all). This uid's third is
    refused the same way: the cap is per uid, for every uid."""
    d = shared
    with EngineProc(d.target) as a:
        got = as_stranger(d, {"op": "register"}, {"op": "register"}, {"op": "register"})
        assert [r["code"] for r in got] == ["OK", "OK", "RESOURCE_EXHAUSTED"]
        assert "max_sessions_per_uid = 2" in got[2]["message"] and f"uid {STRANGER}" in got[2]["message"]
        with EngineProc(d.target) as b:
            assert a.hello["ready"] and b.hello["ready"]
            assert b.call("store", numbers=[5])["status"] == [STORED]
            assert a.call("load", numbers=[5])["status"] == [LOADED]
            c = EngineProc(d.target)
            try:
                assert c.hello["ready"] is False and c.hello["code"] == "RESOURCE_EXHAUSTED"
                assert f"uid {os.getuid()} has 2 open sessions" in c.hello["message"]
            finally:
                c.close()


@needs_root
def test_idle_registration_connections_of_another_uid_do_not_block_engines(daemon):
    """Scenario: uid 65534 opens 20 connections to the registration socket and sends nothing (it
    may not even open sessions). While it holds them, an engine of this uid registers, stores and
    loads as usual; the stranger's extra connections beyond its handshake quota were dropped."""
    p = subprocess.Popen([sys.executable, "-m", "tests.uid_probe", str(STRANGER), daemon.socket_path,
                          json.dumps([{"op": "hold", "connects": 20}])],
                         cwd=str(ROOT), env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "holding"
        with EngineProc(daemon.target) as e:
            assert e.hello["ready"], e.hello
            assert e.call("store", numbers=[0, 1])["status"] == [STORED] * 2
            assert e.call("load", numbers=[0, 1])["status"] == [LOADED] * 2
        out, _ = p.communicate("\n", timeout=60)
        who, held = json.loads(out.strip().splitlines()[-1])
        assert who["uid"] == STRANGER and held == {"held": 20}
        assert f"uid {STRANGER} has 8 handshakes in progress; dropping a connection" in daemon.log()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def register_as_me(d: Daemon, canary: bytes):
    """Open a session from this process (this uid) with the engines' namespace and `canary`."""
    from engine_client import BlockHasher, Namespace, ShmKVPool
    from engine_client.errors import KVClientError
    from engine_client.registration import register

    ns = Namespace("m", "float32", 16, "block-contiguous")
    with ShmKVPool(64, 4096) as pool:
        request = kvcache_pb2.OpenSessionRequest(namespace=ns.to_proto(), pool=pool.description(),
                                                 hash_canary=canary or BlockHasher(ns).canary(), client_name="probe")
        fds = pool.registration_fds()
        try:
            return register(d.socket_path, request, fds, timeout=10)
        except KVClientError as e:
            return e
        finally:
            for fd in fds:
                os.close(fd)


@needs_root
def test_a_bogus_canary_probe_does_not_lock_a_namespace_and_the_operator_can_reset_one(shared):
    """Scenario: a probe opens the engines' namespace first with a bogus canary and stores
    nothing: the namespace is not locked, and a real engine opens and stores. A second bogus
    probe is then refused (the engine's store fixed the canary). The operator resets the canary:
    refused without the token; with it the canary is reset, the probe gets in, and the engine's
    next store fixes the canary again. Another uid's bogus canary never reaches this namespace:
    its namespaces are its own tenant's."""
    d = shared
    bogus = b"\x07" * 32
    lease, probe = register_as_me(d, bogus)  # opened; it never stores
    ns = probe.namespace_id
    lease.close()
    (stranger,) = as_stranger(d, {"op": "register", "canary": bogus.hex()})
    assert stranger["code"] == "OK" and stranger["namespace"] != ns
    with EngineProc(d.target) as engine:
        assert engine.hello["ready"] and engine.hello["namespace"] == ns
        assert engine.call("store", numbers=[0, 1])["status"] == [STORED] * 2
        again = register_as_me(d, bogus)
        assert again.code == grpc.StatusCode.FAILED_PRECONDITION and "hash canary differs" in again.message

        with pytest.raises(grpc.RpcError) as err:
            d.admin("ResetCanary", namespace_id=ns)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "admin_token" in err.value.details()
        assert d.admin("ResetCanary", namespace_id=ns, admin_token=TOKEN).was_set is True
        with pytest.raises(grpc.RpcError) as err:
            d.admin("ResetCanary", namespace_id="../../etc", admin_token=TOKEN)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        lease, _ = register_as_me(d, bogus)
        lease.close()
        assert engine.call("store", numbers=[2])["status"] == [STORED]  # fixes the engine's canary again
        last = register_as_me(d, bogus)
        assert last.code == grpc.StatusCode.FAILED_PRECONDITION


def test_reset_canary_over_tcp_only_with_tcp_admin_mutations_and_the_token():
    """Scenario: a daemon with tcp_admin_mutations and a token serves ResetCanary over TCP with
    the token and refuses it without; one with tcp_admin_mutations and no token refuses to start
    with a message that says why."""
    with Daemon(tcp=True, extra=["--tcp-admin-mutations"], env={"KVSERVICE_ADMIN_TOKEN": TOKEN}) as d:
        with EngineProc(d.target) as e:
            assert e.call("store", numbers=[0])["status"] == [STORED]
            with grpc.insecure_channel(d.tcp_address) as ch:
                stub = admin_pb2_grpc.AdminStub(ch)
                with pytest.raises(grpc.RpcError) as err:
                    stub.ResetCanary(admin_pb2.ResetCanaryRequest(namespace_id=e.hello["namespace"]), timeout=10)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                ok = stub.ResetCanary(admin_pb2.ResetCanaryRequest(namespace_id=e.hello["namespace"],
                                                                   admin_token=TOKEN), timeout=10)
                assert ok.was_set is True
    bad = Daemon(tcp=True, extra=["--tcp-admin-mutations"])
    try:
        with pytest.raises(RuntimeError) as err:
            bad.start(timeout=60)
        assert "tcp_admin_mutations" in str(err.value) and "admin_token" in str(err.value)
    finally:
        bad.close()


def test_tcp_serves_no_data_plane_even_to_this_uid(daemon):
    """Scenario: the engine's own uid tries the data plane over TCP: UNIMPLEMENTED; and an engine
    given a TCP target is told the data plane is on the Unix socket only."""
    with EngineProc(daemon.target) as e, grpc.insecure_channel(daemon.tcp_address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            kvcache_pb2_grpc.KVCacheStub(ch).Lookup(
                kvcache_pb2.LookupRequest(session_id=e.hello["session"], hashes=h(0)), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    tcp_engine = EngineProc(daemon.tcp_address)
    try:
        assert tcp_engine.hello["ready"] is False and tcp_engine.hello["code"] == "INVALID_ARGUMENT"
        assert "Unix socket only" in tcp_engine.hello["message"]
    finally:
        tcp_engine.close()


# --- hygiene: logs, error messages, binding rules


def test_client_strings_are_logged_escaped_never_raw(daemon):
    """Scenario: an engine names itself with a newline and a forged log line in its client name
    and model id. The daemon's log shows both escaped (repr) inside its own line: no line of
    the log starts with the forged text."""
    forged = "00:00 WARNING FORGED"
    e = EngineProc(daemon.target, "--model", f"m\n{forged}")
    try:
        assert e.hello["ready"], e.hello
        assert e.call("store", numbers=[0])["status"] == [STORED]
    finally:
        e.close()
    log = daemon.log()
    assert "model 'm\\n00:00 WARNING FORGED'" in log
    assert not [line for line in log.splitlines() if line.startswith(forged)]
    assert e.hello["session"] not in log  # the secret is never logged


def test_error_messages_quote_at_most_a_short_prefix_of_client_input(daemon):
    """Scenario: a client sends a 1 MiB session id and a 1 MiB namespace id (to the data plane and
    to Admin.DescribeBlocks). The answers are the right refusals (NOT_FOUND, PERMISSION_DENIED), not
    RESOURCE_EXHAUSTED from an oversized error, and each message stays short."""
    with EngineProc(daemon.target) as e, grpc.insecure_channel(daemon.target) as ch:
        stub = kvcache_pb2_grpc.KVCacheStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.Lookup(kvcache_pb2.LookupRequest(session_id="x" * (1 << 20), hashes=h(0)), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and len(err.value.details()) < 200
        with pytest.raises(grpc.RpcError) as err:
            stub.Lookup(kvcache_pb2.LookupRequest(session_id=e.hello["session"], hashes=h(0),
                                                  namespace_id="n" * (1 << 20)), timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and len(err.value.details()) < 300
        assert "(1048576 characters)" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        daemon.admin("DescribeBlocks", namespace_id="n" * (1 << 20), hashes=[h(0).hex()])
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and len(err.value.details()) < 200


@pytest.mark.parametrize("setting, value, allow, says", [
    ("metrics_address", "0.0.0.0:9400", "allow_remote_metrics", "metrics_address: 0.0.0.0:9400 is not a loopback"),
    ("tcp_address", "0.0.0.0:50051", "allow_remote_tcp", "tcp_address: 0.0.0.0:50051 is not a loopback"),
])
def test_metrics_and_tcp_listen_on_loopback_unless_explicitly_allowed(tmp_path, setting, value, allow, says):
    """Scenario: a non-loopback metrics or TCP address is refused at start with a message naming
    the allow flag; with the flag it is accepted; loopback needs no flag."""
    base = {"socket_path": str(tmp_path / "kv.sock")}
    with pytest.raises(ConfigError) as err:
        load_config(None, {}, {**base, setting: value})
    assert says in str(err.value) and allow in str(err.value)
    assert getattr(load_config(None, {}, {**base, setting: value, allow: True}), setting) == value
    assert getattr(load_config(None, {}, {**base, setting: "127.0.0.1:9400"}), setting) == "127.0.0.1:9400"
    with pytest.raises(ConfigError, match="tcp_admin_mutations: .*needs admin_token"):
        load_config(None, {}, {**base, "tcp_address": "127.0.0.1:1", "tcp_admin_mutations": True})


def test_metrics_endpoint_serves_metrics_and_nothing_else():
    """Scenario: a scraper reads /metrics; any other path (/, /favicon.ico, a traversal) is 404."""
    import urllib.error
    import urllib.request

    from prometheus_client import CollectorRegistry

    from kvservice.ops.metrics import start_metrics_server

    server, _thread = start_metrics_server("127.0.0.1:0", CollectorRegistry())
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        assert urllib.request.urlopen(f"{base}/metrics", timeout=10).status == 200
        for path in ("/", "/favicon.ico", "/metrics/../x", "/anything"):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(base + path, timeout=10)
            assert err.value.code == 404, path
    finally:
        server.shutdown()
        server.server_close()
