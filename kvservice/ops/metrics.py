"""Prometheus export: a custom collector that reads the core's own figures at scrape time.

No bookkeeping here: every sample comes from BlockCache (tier_stats, namespace_stats, counters,
queue_depths, latencies, sessions) when Prometheus scrapes. The HTTP server runs in a thread,
so when given the daemon's event loop the collector takes its snapshot on that loop and never
reads core state while a request is changing it.

Conventions (promtool check metrics): counters end in _total and exist from the first scrape,
before any namespace does (a sample with namespace="" holds what no namespace was charged with);
per-namespace series carry the namespace id and its model id; a quotient is a _ratio; the
standard process_* and python_* series come from prometheus-client's own collectors.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

import kvservice
from kvservice.core.cache import BlockCache
from kvservice.ops.config import parse_host_port
from kvservice.ops.stats import Counters, Histogram

log = logging.getLogger(__name__)

SNAPSHOT_TIMEOUT_S = 5.0
_COUNTER_NAMES = [f.name for f in fields(Counters)] + ["blocks_offloaded", "blocks_loaded_back"]
_COUNTER_HELP = {
    "stores": "Blocks stored (new)",
    "store_hits": "Blocks already present at Store",
    "loads_host": "Blocks loaded from the host tier",
    "loads_disk": "Blocks loaded from the disk tier",
    "load_misses": "Blocks asked for by Load that were not stored",
    "load_failures": "Blocks whose Load failed (checksum or I/O); the block was discarded",
    "spills": "Host victims written to disk",
    "disk_onboards": "Disk blocks read back into the host tier",
    "host_evictions": "Blocks that left host memory",
    "drops_gate": "Host victims the admission gate kept off disk",
    "drops_pressure": "Best-effort spills shed by a full write queue",
    "drops_no_disk": "Host victims dropped because there is no disk tier",
    "admission_refusals": "Blocks refused because the disk is full of protected retained blocks",
    "retain_cap_refusals": "TTLs refused by the per-namespace retained-bytes cap",
    "prefetch_wasted": "Prefetched blocks whose lease ran out before a Load used them",
    "blocks_offloaded": "Blocks offloaded (= stores)",
    "blocks_loaded_back": "Blocks loaded back (= loads_host + loads_disk)",
}
_QUEUE_GAUGES = (
    ("write_queue_depth", "Disk writes waiting for a writer"),
    ("writes_in_progress", "Disk writes a writer is doing now"),
    ("write_queue_high_water", "Most disk writes waiting at once since start"),
    ("write_queue_capacity", "Disk writes that may wait (the configured write_queue_depth)"),
    ("read_queue_depth", "Disk reads in progress"),
)


@dataclass(frozen=True, slots=True)
class _Snapshot:
    io_backend: str
    tiers: list[dict]
    total: dict[str, float]
    by_namespace: list[tuple[str, str, dict[str, float]]]  # (namespace id, model id, counters)
    queues: dict[str, int]
    latencies: list[tuple[str, tuple[float, ...], list[int], int, float]]
    sessions: int


def _snapshot(cache: BlockCache) -> _Snapshot:
    def copy_hist(h: Histogram) -> tuple[str, tuple[float, ...], list[int], int, float]:
        return (h.name, tuple(h.bounds), list(h.counts), h.count, h.sum)

    return _Snapshot(
        io_backend=cache.io_backend_name,
        tiers=[dict(t) for t in cache.tier_stats()],
        total=cache.counters.as_dict(),
        by_namespace=[
            (str(n["namespace_id"]), str(n.get("model_id", "")), n["counters"].as_dict())
            for n in cache.namespace_stats() if "counters" in n
        ],
        queues=dict(cache.queue_depths()),
        latencies=[copy_hist(h) for h in cache.latencies],
        sessions=len(cache.sessions()),
    )


def _metric_label(name: str) -> str:
    return re.sub(r"[^a-z0-9_]", "_", name.lower())


class CacheCollector(Collector):
    """Yields kvservice_* families from one consistent snapshot of the cache per scrape."""

    def __init__(self, cache: BlockCache, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._cache = cache
        self._loop = loop

    def _take_snapshot(self) -> _Snapshot:
        loop = self._loop
        if loop is None or not loop.is_running() or _on_loop_thread(loop):
            return _snapshot(self._cache)

        async def on_loop() -> _Snapshot:
            return _snapshot(self._cache)

        return asyncio.run_coroutine_threadsafe(on_loop(), loop).result(timeout=SNAPSHOT_TIMEOUT_S)

    def collect(self) -> Iterator[Metric]:
        s = self._take_snapshot()

        info = GaugeMetricFamily("kvservice_info", "Daemon version and I/O backend", labels=["version", "io_backend"])
        info.add_metric([kvservice.__version__, s.io_backend], 1)
        yield info

        for key, help_text in (
            ("capacity_bytes", "Tier capacity in bytes"),
            ("used_bytes", "Bytes stored in the tier"),
            ("blocks", "Blocks stored in the tier"),
            ("pinned_blocks", "Blocks pinned against eviction"),
            ("retained_blocks", "Blocks with a retention deadline"),
        ):
            g = GaugeMetricFamily(f"kvservice_tier_{key}", help_text, labels=["tier"])
            for t in s.tiers:
                if key in t:
                    g.add_metric([str(t["name"])], float(t[key]))
            yield g

        for name in _COUNTER_NAMES:
            c = CounterMetricFamily(f"kvservice_{name}", _COUNTER_HELP.get(name, name.replace("_", " ")) +
                                    ", per namespace", labels=["namespace", "model"])
            attributed = 0.0
            for ns, model, values in s.by_namespace:
                c.add_metric([ns, model], values[name])
                attributed += values[name]
            # What the core counted outside any namespace, so that sum() equals the global figure;
            # always present before the first namespace, so that rate() has a series from the start.
            if s.total[name] > attributed or not s.by_namespace:
                c.add_metric(["", ""], s.total[name] - attributed)
            yield c

        yield GaugeMetricFamily(
            "kvservice_recovery_ratio", "Blocks loaded back / blocks offloaded since start (can exceed 1)",
            value=s.total["recovery_rate"],
        )
        for key, help_text in _QUEUE_GAUGES:
            yield GaugeMetricFamily(f"kvservice_{key}", help_text, value=s.queues.get(key, 0))
        yield GaugeMetricFamily("kvservice_sessions", "Open engine sessions", value=s.sessions)

        h = HistogramMetricFamily("kvservice_latency_seconds", "Store, Load and Prefetch latency in seconds "
                                  "(prefetch_read: the disk reads of Prefetch calls)", labels=["op"])
        for name, bounds, counts, count, total in s.latencies:
            cumulative, buckets = 0, []
            for bound, n in zip(bounds, counts):
                cumulative += n
                buckets.append((repr(float(bound)), cumulative))
            buckets.append(("+Inf", count))
            h.add_metric([_metric_label(name)], buckets, total)
        yield h


def _on_loop_thread(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class ChannelCollector(Collector):
    """The frames channel's figures (Lookup, Store and Load without gRPC): open connections, and
    calls served by call, so an operator sees whether engines use it. `read()` returns (connections,
    {call name: calls}); plain counters of the channel, read as they are at scrape time."""

    def __init__(self, read: Callable[[], tuple[int, dict[str, int]]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        connections, calls = self._read()
        yield GaugeMetricFamily("kvservice_frames_channel_connections",
                                "Open engine connections to the frames channel (Lookup, Store, Load without gRPC)",
                                value=connections)
        c = CounterMetricFamily("kvservice_frames_channel_calls",
                                "Calls served on the frames channel, by call (not counting gRPC calls)", labels=["call"])
        for name, n in sorted(calls.items()):
            c.add_metric([name], n)
        yield c


def make_registry(cache: BlockCache, loop: asyncio.AbstractEventLoop | None = None,
                  channel: Callable[[], tuple[int, dict[str, int]]] | None = None) -> CollectorRegistry:
    """kvservice_* from the cache (and the frames channel's figures, `channel`: a reader of them),
    plus process_* (CPU, RSS, fds, start time) and python_* (GC, version)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CacheCollector(cache, loop))
    if channel is not None:
        registry.register(ChannelCollector(channel))
    for standard in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(standard)  # stateless readers of /proc and the interpreter: shareable
    return registry


class _MetricsServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002  # scrapes are not log lines
        pass


def _only_metrics(app):
    """The exposition app on /metrics and nothing else: any other path is 404."""
    def serve(environ, start_response):
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"not found: this endpoint serves /metrics only\n"]
        return app(environ, start_response)
    return serve


def start_metrics_server(address: str, registry: CollectorRegistry) -> tuple[object, threading.Thread]:
    """Serve /metrics (only) on address ("host:port"); returns (server, thread)."""
    host, port = parse_host_port(address)

    class Server(_MetricsServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    server = make_server(host, port, _only_metrics(make_wsgi_app(registry)), Server, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="kvservice-metrics", daemon=True)
    thread.start()
    log.info("metrics: http://%s:%d/metrics", address.rpartition(":")[0], server.server_port)
    return server, thread
