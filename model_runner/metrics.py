"""Prometheus metrics of the reference engine, on a registry of its own (one per Engine, so several
engines in one process, as in tests, do not collide). GET /metrics of http_api serves it, with the
standard process_* and python_* series, and without the `_created` series prometheus-client adds to
every counter and histogram by default (a second series per counter that dashboards do not use)."""

from __future__ import annotations

import os
import threading

import prometheus_client as prom
from prometheus_client.core import CounterMetricFamily

prom.disable_created_metrics()  # process-wide, as prometheus-client offers it; the engine is its own process


def _cpu_seconds(stat_path: str) -> float:
    """utime + stime of a /proc .../stat file, in seconds."""
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _ThreadCpu:
    """model_runner_thread_cpu_seconds_total{thread}: CPU time (user + system) of each Python thread of
    this process by its name (Linux /proc), and "other" for the rest (gRPC's and torch's native
    threads): which threads besides the engine loop take the CPU."""

    def collect(self):
        fam = CounterMetricFamily("model_runner_thread_cpu_seconds", "CPU time of this process's threads, by "
                                  "Python thread name; other: threads Python did not start", labels=("thread",))
        by_name: dict[str, float] = {}
        try:
            for t in threading.enumerate():
                if t.native_id is None:
                    continue
                name = t.name.split(" (")[0] if t.name.startswith("Thread-") else t.name
                by_name[name] = by_name.get(name, 0.0) + _cpu_seconds(f"/proc/self/task/{t.native_id}/stat")
            total = _cpu_seconds("/proc/self/stat")
        except OSError:  # not Linux, or a thread ended between the two reads
            return [fam]
        for name, v in sorted(by_name.items()):
            fam.add_metric([name], v)
        fam.add_metric(["other"], max(0.0, total - sum(by_name.values())))
        return [fam]


_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class EngineMetrics:
    def __init__(self, registry: prom.CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else prom.CollectorRegistry()
        if registry is None:
            for standard in (prom.PROCESS_COLLECTOR, prom.PLATFORM_COLLECTOR, prom.GC_COLLECTOR):
                r.register(standard)
            r.register(_ThreadCpu())

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> prom.Counter:
            return prom.Counter(f"model_runner_{name}", doc, labels, registry=r)

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> prom.Gauge:
            return prom.Gauge(f"model_runner_{name}", doc, labels, registry=r)

        self.ttft = prom.Histogram("model_runner_ttft_seconds", "Time from submit to the first output token",
                                   buckets=_TTFT_BUCKETS, registry=r)
        self.requests = counter("requests", "Finished requests, by where their prompt KV came from",
                                ("kv_source", "finish_reason"))
        self.failed = counter("failed_requests", "Requests that ended in an error")
        self.reused_tokens = counter("reused_tokens", "Prompt tokens whose KV was reused, by tier", ("tier",))
        self.prefill_tokens = counter("prefill_tokens", "Prompt tokens computed")
        self.parked = gauge("parked_requests", "Requests waiting for their KV blocks to load")
        self.running = gauge("running_requests", "Requests prefilling or decoding")
        self.waiting = gauge("waiting_requests", "Requests queued for admission")
        self.prefetches = counter("prefetches", "Prefetch jobs (a request's disk blocks, staged in chunks) issued "
                                  "for queued requests")
        self.lookup_seconds = prom.Histogram("model_runner_lookup_seconds",
                                             "Lookup round trips, sent at enqueue -> answer landed",
                                             buckets=_TTFT_BUCKETS, registry=r)
        self.lookup_wait = prom.Histogram("model_runner_lookup_wait_seconds",
                                          "Time a request at the head of the queue waited for its Lookup's answer",
                                          buckets=_TTFT_BUCKETS, registry=r)
        self.prefetched_blocks = counter("prefetched_blocks", "Prefetch answers per block", ("status",))
        self.prefetch_stops = counter("prefetch_stops", "Blocks a prefetch job stopped or paused at (not staged), by "
                                      "reason: lease_cap, no_room (the job asks again), read_failed, not_found, other",
                                      ("reason",))
        self.decisions = counter("load_decisions", "Load-or-recompute decisions for prefixes the service holds",
                                 ("decision",))
        self.loaded_blocks = counter("loaded_blocks", "Blocks loaded from the service, by tier", ("tier",))
        self.load_failures = counter("load_failed_blocks", "Blocks asked of the service that did not load")
        self.evictions = counter("gpu_evictions", "GPU-tier blocks evicted from the radix tree")
        self.stored_blocks = counter("stored_blocks", "Blocks sent to the service, by reason and answer",
                                     ("reason", "status"))
        self.load_bandwidth = gauge("load_bandwidth_bytes_per_second", "Estimated load bandwidth per service tier",
                                    ("tier",))
        self.prefill_rate = gauge("prefill_tokens_per_second", "Estimated prefill throughput")
        self.gpu_blocks_free = gauge("gpu_blocks_free", "Free GPU-tier blocks")
        self.gpu_blocks_cached = gauge("gpu_blocks_cached", "GPU-tier blocks in the radix tree")
        self.forward_seconds = prom.Summary("model_runner_forward_seconds",
                                            "One request's forward in a model step, to its sampled token (device "
                                            "time included), by phase", ("phase",), registry=r)
        self.loop_seconds = counter("loop_seconds", "Engine loop thread time, by what it was doing: model steps "
                                    "(forward), the scheduler's bookkeeping (schedule), waiting for work (idle)",
                                    ("activity",))
