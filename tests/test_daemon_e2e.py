"""End-to-end scenarios of DESIGN §5 against a real daemon subprocess and real engine processes.

Engines are harness/engine_proc.py processes talking over the daemon's Unix socket; block number i
has the same bytes and hash in every process, and every load is checked byte for byte ("exact").
Host tier 64 KiB = 16 blocks of 4 KiB, so a store of 16 new blocks pushes older ones to disk.
"""

from __future__ import annotations

import math
import os
import re
import stat
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from engine_client import KVClient, Namespace, ShmKVPool
from tests.corekit import content, h
from tests.daemon_kit import Daemon, free_tcp_port
from tests.engine_kit import EngineProc

HOST, DISK = 2, 3  # kvservice.v1.Tier
STORED, ALREADY_STORED, NOT_STORED = 1, 2, 5  # kvservice.v1.StoreStatus
LOADED, MISSING = 1, 2  # kvservice.v1.LoadStatus
BLOCK = 4096
HOST_CAPACITY, DISK_CAPACITY = 64 * 1024, 1024 * 1024


def small_daemon(**kw) -> Daemon:
    return Daemon(host_capacity="64KiB", disk_capacity="1MiB", **kw)


@contextmanager
def engines(target: str, *arg_lists: tuple[str, ...]) -> Iterator[list[EngineProc]]:
    """Start engine processes in parallel (each imports torch: seconds), close them all after."""
    with ThreadPoolExecutor(len(arg_lists)) as ex:
        futures = [ex.submit(EngineProc, target, *args) for args in arg_lists]
    procs, errors = [], []
    for f in futures:
        try:
            procs.append(f.result())
        except Exception as e:  # noqa: BLE001  # close the ones that did start, then fail
            errors.append(e)
    try:
        if errors:
            raise errors[0]
        yield procs
    finally:
        for p in procs:
            p.close()


def wait_for(what: str, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def spills_settled(d: Daemon, n: int) -> Callable[[], bool]:
    """True once n spills are on disk and nothing is left in the write queue."""
    def check() -> bool:
        s = d.stats()
        return s.counters.spills >= n and s.write_queue_depth == 0
    return check


def settled(s) -> bool:
    """No disk I/O queued or in flight, and every reserved byte belongs to a block."""
    return s.write_queue_depth == 0 and s.read_queue_depth == 0 and all(
        t.used_bytes == t.blocks * BLOCK for t in s.tiers)


def assert_stored(reply: dict, n: int) -> None:
    assert reply.get("status") == [STORED] * n, reply


def assert_loaded(reply: dict, n: int, tier: int) -> None:
    assert reply.get("status") == [LOADED] * n, reply
    assert reply["tier"] == [tier] * n, reply
    assert reply["exact"] == [True] * n, reply


def assert_missing(e: EngineProc, numbers: list[int]) -> None:
    assert e.call("lookup", numbers=numbers) == {"prefix": 0, "tiers": []}
    r = e.call("load", numbers=numbers)
    assert r["status"] == [MISSING] * len(numbers), r


def tiers_by_name(d: Daemon) -> dict:
    return {t.name: t for t in d.stats().tiers}


def namespace_row(d: Daemon, namespace_id: str):
    rows = [n for n in d.stats().namespaces if n.namespace_id == namespace_id]
    assert len(rows) == 1, f"namespace {namespace_id} in Stats: {[n.namespace_id for n in d.stats().namespaces]}"
    return rows[0]


def test_blocks_round_trip_exactly_through_host_and_disk_tiers():
    """Scenario: an engine stores 8 blocks and loads them back from the host tier; it then
    stores 16 more (the whole host tier), which pushes the first 8 to disk; they load back
    from the disk tier with the same bytes."""
    with small_daemon() as d, engines(d.target, ()) as (a,):
        first, more = list(range(8)), list(range(8, 24))
        assert_stored(a.call("store", numbers=first), 8)
        assert a.call("lookup", numbers=first) == {"prefix": 8, "tiers": [HOST] * 8}
        assert_loaded(a.call("load", numbers=first), 8, HOST)

        assert_stored(a.call("store", numbers=more), 16)
        wait_for("8 spills", spills_settled(d, 8))
        assert a.call("lookup", numbers=first) == {"prefix": 8, "tiers": [DISK] * 8}
        assert_loaded(a.call("load", numbers=first), 8, DISK)
        newer = a.call("load", numbers=more[:8])
        assert newer["status"] == [LOADED] * 8 and newer["exact"] == [True] * 8, newer


def test_engines_share_a_namespace_and_nothing_else():
    """Scenario: two engine processes of one namespace; the second hits what the first stored,
    in host memory and after it was pushed to disk. Engines of another model, and either rank
    of a tensor-parallel pair, share the daemon but never see those blocks."""
    with small_daemon() as d, engines(
        d.target, (), (), ("--model", "other"), ("--rank", "1", "--tp", "2"), ("--rank", "0", "--tp", "2"),
    ) as (a, b, other_model, tp_rank1, tp_rank0):
        assert a.hello["namespace"] == b.hello["namespace"]
        strangers = (other_model, tp_rank1, tp_rank0)
        assert len({a.hello["namespace"], *(e.hello["namespace"] for e in strangers)}) == 4

        blocks = list(range(8))
        assert_stored(a.call("store", numbers=blocks), 8)
        assert b.call("lookup", numbers=blocks) == {"prefix": 8, "tiers": [HOST] * 8}
        assert_loaded(b.call("load", numbers=blocks), 8, HOST)
        for e in strangers:
            assert_missing(e, blocks)

        assert_stored(a.call("store", numbers=list(range(8, 24))), 16)
        wait_for("8 spills", spills_settled(d, 8))
        assert_loaded(b.call("load", numbers=blocks), 8, DISK)
        for e in strangers:
            assert_missing(e, blocks)

        # a stranger storing the same block numbers gets its own copies, not a hit on a's
        assert_stored(tp_rank1.call("store", numbers=[0, 1]), 2)
        assert_missing(tp_rank0, [0, 1])


def test_client_with_a_different_hash_canary_is_refused_and_others_carry_on():
    """Scenario: an engine built with a different hash function (another canary) tries to join
    a namespace in use. It is refused with FAILED_PRECONDITION saying the hash functions differ;
    the engine already there and a newcomer with the right hashing keep storing and hitting."""
    with small_daemon() as d, engines(d.target, ()) as (a,):
        assert_stored(a.call("store", numbers=[0, 1, 2, 3]), 4)
        with engines(d.target, ("--canary-salt", "x"), ()) as (bad, newcomer):
            assert bad.hello["ready"] is False
            assert bad.hello["code"] == "FAILED_PRECONDITION"
            assert "hash functions differ" in bad.hello["message"]
            assert a.hello["namespace"] in bad.hello["message"]

            assert d.serving()
            sessions = {s.label for s in d.admin("ListSessions").sessions}
            assert sessions == {a.hello["label"], newcomer.hello["label"]}
            assert_loaded(newcomer.call("load", numbers=[0, 1, 2, 3]), 4, HOST)
            assert_stored(a.call("store", numbers=[4, 5]), 2)
            assert_loaded(a.call("load", numbers=[4, 5]), 2, HOST)


def test_stats_and_admin_views_follow_the_traffic():
    """Scenario: one engine stores, hits, misses and pushes blocks to disk; Admin.Stats counts
    each of those globally and in the namespace's row, the tiers report their capacity, and
    ListSessions / ListNamespaces / GetConfig describe the engine and the daemon."""
    with small_daemon() as d, engines(d.target, ()) as (a,):
        ns = a.hello["namespace"]
        assert_stored(a.call("store", numbers=list(range(8))), 8)
        assert a.call("store", numbers=[0, 1])["status"] == [ALREADY_STORED] * 2
        assert_loaded(a.call("load", numbers=list(range(8))), 8, HOST)
        assert_stored(a.call("store", numbers=list(range(8, 24))), 16)
        wait_for("8 spills", spills_settled(d, 8))
        s = d.stats()
        assert (s.counters.spills, s.counters.host_evictions) == (8, 8)
        assert_loaded(a.call("load", numbers=list(range(8))), 8, DISK)
        assert a.call("load", numbers=[100, 101, 102])["status"] == [MISSING] * 3
        # disk hits are onboarded into host memory after the reply: let that settle first
        wait_for("tiers to settle", lambda: settled(d.stats()))

        s = d.stats()
        c = s.counters
        assert (c.stores, c.store_hits, c.loads_host, c.loads_disk, c.load_misses) == (24, 2, 8, 8, 3)
        assert (c.blocks_offloaded, c.blocks_loaded_back) == (24, 16)
        assert c.recovery_rate == pytest.approx(16 / 24)
        assert c.load_failures == c.checksum_failures == c.io_errors == 0
        assert s.sessions == 1
        assert s.io_backend == "posix"
        latency = {h.name: h for h in s.latencies}
        assert latency["store"].count == 3 and latency["load"].count == 3
        assert sum(latency["load"].counts) == latency["load"].count

        tiers = {t.name: t for t in s.tiers}
        assert set(tiers) == {"host", "disk"}
        assert tiers["host"].capacity_bytes == HOST_CAPACITY
        assert tiers["disk"].capacity_bytes == DISK_CAPACITY
        assert 0 < tiers["host"].used_bytes <= HOST_CAPACITY
        assert tiers["host"].used_bytes == tiers["host"].blocks * BLOCK
        assert tiers["disk"].blocks >= 8 and tiers["disk"].used_bytes == tiers["disk"].blocks * BLOCK

        row = namespace_row(d, ns)
        assert (row.model_id, row.tp_rank, row.tp_size, row.block_bytes, row.sessions) == ("m", 0, 1, BLOCK, 1)
        assert (row.counters.stores, row.counters.loads_host, row.counters.loads_disk) == (24, 8, 8)
        assert row.host_blocks == tiers["host"].blocks and row.disk_blocks == tiers["disk"].blocks

        (session,) = d.admin("ListSessions").sessions
        assert (session.label, session.pid, session.uid) == (a.hello["label"], a.hello["pid"], os.getuid())
        assert session.namespace_id == ns
        assert session.client_name == f"engine_proc pid {a.hello['pid']}"
        assert (session.pool_kind, session.pool_blocks) == ("shm", 64)
        assert abs(session.opened_at.ToSeconds() - time.time()) < 60
        assert 0 < session.lease_expires_in <= 2.0

        (listed,) = d.admin("ListNamespaces").namespaces
        assert (listed.namespace_id, listed.model_id, listed.counters.stores) == (ns, "m", 24)

        toml = d.admin("GetConfig").toml
        assert "host_capacity_bytes = 65536" in toml
        assert "disk_capacity_bytes = 1048576" in toml
        assert f'disk_path = "{d.disk_path}"' in toml


def test_admin_evict_by_namespace_expired_and_all_needs_the_token():
    """Scenario: a daemon configured with an admin token. Evict without the token or with a
    wrong one is PERMISSION_DENIED and removes nothing; with it, Evict removes exactly the
    expired retained blocks, then one namespace's blocks, then everything. GetConfig never
    shows the token."""
    with small_daemon(extra=["--admin-token", "s3cret"]) as d, engines(
        d.target, (), ("--model", "other"),
    ) as (a, other):
        assert_stored(a.call("store", numbers=[0, 1, 2, 3]), 4)
        retained = a.call("store", numbers=[4, 5], ttl=1)
        assert_stored(retained, 2)
        assert all(dl > 0 for dl in retained["deadline"])
        assert_stored(other.call("store", numbers=[0, 1, 2]), 3)

        for token in ("", "wrong"):
            with pytest.raises(grpc.RpcError) as err:
                d.admin("Evict", all=True, admin_token=token)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "admin_token" in err.value.details()
        assert tiers_by_name(d)["host"].blocks == 9
        assert "s3cret" not in d.admin("GetConfig").toml

        with pytest.raises(grpc.RpcError) as err:
            d.admin("Evict", admin_token="s3cret")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "exactly one target" in err.value.details()

        assert d.admin("Evict", expired=True, admin_token="s3cret").evicted_blocks == 0
        wait_for("the 1 s retention to run out", lambda: time.time() > max(retained["deadline"]) + 0.05)
        assert d.admin("Evict", expired=True, admin_token="s3cret").evicted_blocks == 2
        assert_missing(a, [4, 5])
        assert a.call("lookup", numbers=[0, 1, 2, 3])["prefix"] == 4

        assert d.admin("Evict", namespace_id=other.hello["namespace"], admin_token="s3cret").evicted_blocks == 3
        assert_missing(other, [0, 1, 2])
        assert a.call("lookup", numbers=[0, 1, 2, 3])["prefix"] == 4

        assert d.admin("Evict", all=True, admin_token="s3cret").evicted_blocks == 4
        assert_missing(a, [0, 1, 2, 3])
        s = d.stats()
        assert s.counters.evictions_admin == 9
        assert {t.name: t.blocks for t in s.tiers} == {"host": 0, "disk": 0}
        # evicted blocks can be stored again
        assert_stored(a.call("store", numbers=[0]), 1)


def test_unix_socket_is_owner_only():
    """Scenario: a daemon starts; its Unix socket is mode 0600, so other local users cannot
    talk to it."""
    with small_daemon() as d:
        mode = os.stat(d.socket_path).st_mode
        assert stat.S_ISSOCK(mode)
        assert stat.S_IMODE(mode) == 0o600


def test_sigterm_drains_queued_spills_and_a_restart_serves_them_from_disk():
    """Scenario: an engine pushes 8 blocks out of host memory and the daemon gets SIGTERM
    right away, spills possibly still queued (one writer). It exits 0; a daemon restarted on
    the same directory recovers all 8 and serves them byte-exact from the disk tier."""
    d = small_daemon(extra=["--writer-threads", "1"])
    d.start()
    try:
        with engines(d.target, ()) as (a,):
            ns = a.hello["namespace"]
            assert_stored(a.call("store", numbers=list(range(8))), 8)
            assert_stored(a.call("store", numbers=list(range(8, 24))), 16)
            assert d.stop() == 0
        assert "draining queued disk writes" in d.log()
        assert not os.path.exists(d.socket_path)
        # no write is half done (the default disk format keeps blocks in segment files: the restart
        # below is what shows every spill complete, with its bytes)
        assert not list(Path(d.disk_path).rglob("*.tmp"))

        with Daemon(d.dir, host_capacity="64KiB", disk_capacity="1MiB") as again:
            assert tiers_by_name(again)["disk"].blocks == 8
            with engines(again.target, ()) as (b,):
                assert b.hello["namespace"] == ns
                assert b.call("lookup", numbers=list(range(8))) == {"prefix": 8, "tiers": [DISK] * 8}
                assert_loaded(b.call("load", numbers=list(range(8))), 8, DISK)
                assert again.stats().counters.checksum_failures == 0
            assert again.stop() == 0
    finally:
        d.close()


def _metrics(address: str) -> dict[tuple[str, frozenset], float]:
    """Parse the Prometheus text format into {(series name, labels): value}."""
    body = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    out = {}
    for line in body.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)", line)
        assert m, f"unparsable metrics line: {line!r}"
        labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def test_prometheus_endpoint_reports_tiers_and_traffic():
    """Scenario: a daemon with --metrics; an engine stores 4 blocks and loads 4 back (plus one
    miss). A scrape of /metrics shows the tier capacities, the per-namespace counters, the
    recovery rate, the session and the latency histograms."""
    address = f"127.0.0.1:{free_tcp_port()}"
    with small_daemon(extra=["--metrics", address]) as d, engines(d.target, ()) as (a,):
        ns = a.hello["namespace"]
        assert_stored(a.call("store", numbers=[0, 1, 2, 3]), 4)
        assert_loaded(a.call("load", numbers=[0, 1, 2, 3]), 4, HOST)
        assert a.call("load", numbers=[9])["status"] == [MISSING]

        m = _metrics(address)
        ns_label = frozenset({("namespace", ns), ("model", "m")})
        assert m[("kvservice_tier_capacity_bytes", frozenset({("tier", "host")}))] == HOST_CAPACITY
        assert m[("kvservice_tier_capacity_bytes", frozenset({("tier", "disk")}))] == DISK_CAPACITY
        assert m[("kvservice_tier_used_bytes", frozenset({("tier", "host")}))] == 4 * BLOCK
        assert m[("kvservice_stores_total", ns_label)] == 4
        assert m[("kvservice_loads_host_total", ns_label)] == 4
        assert m[("kvservice_load_misses_total", ns_label)] == 1
        assert m[("kvservice_recovery_ratio", frozenset())] == 1.0
        assert m[("kvservice_sessions", frozenset())] == 1
        assert m[("kvservice_latency_seconds_count", frozenset({("op", "store")}))] == 1
        assert m[("kvservice_latency_seconds_count", frozenset({("op", "load")}))] == 2
        assert math.isfinite(m[("kvservice_latency_seconds_sum", frozenset({("op", "load")}))])
        assert m[("kvservice_info", frozenset({("version", d.stats().version), ("io_backend", "posix")}))] == 1


def test_a_batch_larger_than_the_host_tier_says_why_its_tail_was_not_stored():
    """Scenario: an engine stores a 32-block chain in one call into a 16-block host tier with
    plenty of disk, nothing pinned. At least the head of the chain (16 blocks) is stored; any
    block left NOT_STORED carries a message that says why, and it must not blame pinned blocks
    when Stats shows none: an operator would go looking for a leak that does not exist."""
    with small_daemon() as d, ShmKVPool(64, BLOCK) as pool:
        ns = Namespace("m", "float32", 16, "block-contiguous")
        with KVClient(d.target, ns, pool, client_name="big batch") as kv:
            for i in range(32):
                pool.write_block(i, content(i, BLOCK))
            results = kv.store([h(i) for i in range(32)], list(range(32)))
        statuses = [r.status for r in results]
        assert statuses[:16] == [STORED] * 16
        stored = statuses.count(STORED)
        assert statuses[stored:] == [NOT_STORED] * (32 - stored), "only a chain's tail may be left out"
        assert all(t.pinned_blocks == 0 for t in d.stats().tiers)
        for r in results[stored:]:
            assert r.message and "pinned" not in r.message, r.message


def test_a_second_block_size_gets_room_in_a_host_tier_of_one_segment() -> None:
    """Scenario: two models with different block sizes share a daemon whose host tier is one arena
    segment. Engine A's 64 KiB blocks hold the segment; engine B's 32 KiB blocks can only be placed
    once all of A's blocks have left it (spilled to disk, including those on the spill-staging
    budget). B's Store must wait for those spills, not be refused; afterwards both engines load
    their blocks back byte-exact (A's from disk)."""
    with Daemon(host_capacity="4MiB", disk_capacity="8MiB") as d, \
            EngineProc(d.target, "--blocks", "64", "--block-bytes", str(64 << 10), "--model", "big") as a:
        assert a.call("store", numbers=list(range(40)))["status"] == [STORED] * 40
        with EngineProc(d.target, "--blocks", "64", "--block-bytes", str(32 << 10), "--model", "small") as b:
            r = b.call("store", numbers=list(range(100, 110)))
            assert r["status"] == [STORED] * 10, r["message"]
            r = b.call("load", numbers=list(range(100, 110)))
            assert r["status"] == [LOADED] * 10 and all(r["exact"])
        r = a.call("load", numbers=list(range(8)))
        assert r["status"] == [LOADED] * 8 and all(r["exact"]) and set(r["tier"]) == {DISK}
