"""A client opened right after a daemon restart connects at once (engine_client channel readiness).

Real daemon processes over the real Unix socket; the clients live in this test process, as two
engine threads of one process would.
"""

from __future__ import annotations

import time

from engine_client import KVClient, Namespace, ShmKVPool
from tests.daemon_kit import Daemon

BLOCK = 4096


def _client(d: Daemon, ns: Namespace, pool: ShmKVPool, name: str) -> KVClient:
    return KVClient(d.target, ns, pool, client_name=name, open_timeout=10.0)


def test_new_client_connects_at_once_after_a_restart_under_a_live_client() -> None:
    """Scenario: engine A holds a session; the daemon restarts and reports SERVING; engine B,
    in the same process, connects immediately. B must not see UNAVAILABLE ("failed to connect
    to all addresses") just because A's channel to the old daemon is still backing off, and A
    re-attaches on its own."""
    ns = Namespace("reconnect-test", "float16", 16, "layer-first")
    pool_a = ShmKVPool(8, BLOCK, layout="layer-first", num_layers=1)
    pool_b = ShmKVPool(8, BLOCK, layout="layer-first", num_layers=1)
    try:
        with Daemon(disk_capacity="") as d:
            a = _client(d, ns, pool_a, "engine-a")
            a.connect()
            first_session = a.session_id
            for round_ in range(3):  # several rounds: the backoff of a shared subchannel grows each time
                d.stop()
                n, _ = a.lookup([bytes(32)])  # A notices the daemon is gone and starts re-attaching
                assert n == 0 and not a.attached
                d.start()
                b = _client(d, ns, pool_b, f"engine-b-{round_}")
                t0 = time.monotonic()
                b.connect(required=True)  # raised UNAVAILABLE before channels waited for readiness
                assert b.attached, f"round {round_}: B not attached"
                assert time.monotonic() - t0 < 10.0
                b.close()
                deadline = time.monotonic() + 10
                while not a.attached and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert a.attached and a.session_id != first_session, f"round {round_}: A did not re-attach"
            a.close()
    finally:
        for p in (pool_a, pool_b):
            p.close()
            p.unlink()


def test_connect_to_no_daemon_still_fails_fast(tmp_path) -> None:
    """Scenario: nothing listens on the socket. connect(required=True) raises UNAVAILABLE quickly
    (waiting for readiness must not turn a missing daemon into a long hang)."""
    import grpc
    import pytest

    from engine_client import KVClientError

    ns = Namespace("reconnect-test", "float16", 16, "layer-first")
    pool = ShmKVPool(2, BLOCK, layout="layer-first", num_layers=1)
    try:
        kv = KVClient(f"unix://{tmp_path}/nothing.sock", ns, pool, open_timeout=10.0)
        t0 = time.monotonic()
        with pytest.raises(KVClientError) as err:
            kv.connect(required=True)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - t0 < 5.0
        kv.close()
    finally:
        pool.close()
        pool.unlink()
