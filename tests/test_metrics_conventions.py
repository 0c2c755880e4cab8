"""Both /metrics endpoints follow Prometheus conventions (issue 12).

Every scrape is parsed with prometheus-client's own text parser and checked against the rules of
`promtool check metrics` (its lint: counters end in _total, non-counters do not, no _count/_sum/
_bucket outside histograms and summaries, snake_case, HELP present, base units) plus three of this
project's: the standard process_* series are there, counters exist before any namespace does, and a
quotient is named _ratio. The daemon is a real process scraped over HTTP; the engine's registry is
the one its HTTP API serves (tests/test_deployment.py scrapes both over HTTP as well).
"""

from __future__ import annotations

import re
import urllib.request

import prometheus_client as prom
from prometheus_client.parser import text_string_to_metric_families

from engine_client import KVClient, Namespace, ShmKVPool
from model_runner.metrics import EngineMetrics
from tests.daemon_kit import Daemon, free_tcp_port

SNAKE = re.compile(r"^[a-z_:][a-z0-9_:]*$")
NON_BASE_UNITS = ("_milliseconds", "_microseconds", "_nanoseconds", "_kilobytes", "_megabytes", "_gigabytes",
                  "_minutes", "_hours", "_days", "_percent")


def promtool_problems(text: str) -> list[str]:
    """What `promtool check metrics` would report about this exposition, and our own conventions."""
    problems = []
    seen = set()
    for fam in text_string_to_metric_families(text):
        name = fam.name
        if name in seen:
            problems.append(f"{name}: family exposed twice")
        seen.add(name)
        exposed = name + "_total" if fam.type == "counter" else name
        if not SNAKE.match(exposed):
            problems.append(f"{exposed}: metric names should be written in snake_case")
        if not fam.documentation:
            problems.append(f"{exposed}: no help text")
        if fam.type != "counter" and exposed.endswith("_total"):
            problems.append(f"{exposed}: non-counter metrics should not have _total suffix")
        if fam.type not in ("histogram", "summary", "gaugehistogram") and \
                exposed.endswith(("_count", "_sum", "_bucket")):
            problems.append(f"{exposed}: non-histogram and non-summary metrics should not have a _count/_sum/_bucket suffix")
        if any(unit in exposed for unit in NON_BASE_UNITS):
            problems.append(f"{exposed}: use base units (seconds, bytes)")
        if fam.type == "gauge" and exposed.endswith("_rate"):
            problems.append(f"{exposed}: a gauge holding a quotient is a _ratio, not a _rate")
        for sample in fam.samples:
            if fam.type == "counter" and not sample.name.endswith(("_total", "_created")):
                problems.append(f"{sample.name}: counter sample without _total")
    return problems


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_daemon_metrics_follow_conventions_from_the_first_scrape() -> None:
    """Scenario: Prometheus scrapes a daemon that no engine has talked to yet, then again after one
    stored blocks. From the first scrape: process_* series, every counter at 0 (namespace=""), the
    recovery ratio under its _ratio name, no _created series, and promtool finds nothing; after the
    Store the counters carry the namespace id and the model id."""
    port = free_tcp_port()
    with Daemon(disk_capacity="1MiB", extra=["--metrics", f"127.0.0.1:{port}"]) as d:
        url = f"http://127.0.0.1:{port}/metrics"
        first = scrape(url)
        assert promtool_problems(first) == []
        m = samples(first)
        for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds",
                     "process_start_time_seconds"):
            assert (name, frozenset()) in m, name
        assert m[("process_resident_memory_bytes", frozenset())] > 0
        empty = frozenset({("namespace", ""), ("model", "")})
        for counter in ("stores", "loads_host", "loads_disk", "load_misses", "spills", "admission_refusals",
                        "checksum_failures", "blocks_offloaded"):
            assert m[(f"kvservice_{counter}_total", empty)] == 0, counter
        assert m[("kvservice_recovery_ratio", frozenset())] == 0
        assert not any(name.startswith("kvservice_recovery_rate") for name, _ in m)
        assert not any(name.endswith("_created") for name, _ in m)
        for gauge in ("write_queue_depth", "writes_in_progress", "write_queue_high_water", "write_queue_capacity"):
            assert (f"kvservice_{gauge}", frozenset()) in m, gauge
        assert m[("kvservice_frames_channel_connections", frozenset())] == 0
        for call in ("lookup", "store", "load"):  # the frames channel's calls, from the first scrape
            assert m[("kvservice_frames_channel_calls_total", frozenset({("call", call)}))] == 0, call

        ns = Namespace("metrics-model", "float16", 16, "layer-first")
        pool = ShmKVPool(4, 4096, layout="layer-first", num_layers=1)
        try:
            with KVClient(d.target, ns, pool, client_name="metrics") as kv:
                hashes = kv.hasher.hash_blocks(list(range(4 * 16)))
                kv.store(hashes, [0, 1, 2, 3])
                kv.load(hashes[:2], [0, 1])
                assert kv.lookup(hashes)[0] == 4
                later = scrape(url)
                ns_id = kv.namespace_id
        finally:
            pool.close()
            pool.unlink()
        assert promtool_problems(later) == []
        m = samples(later)
        labels = frozenset({("namespace", ns_id), ("model", "metrics-model")})
        assert m[("kvservice_stores_total", labels)] == 4
        assert m[("kvservice_loads_host_total", labels)] == 2
        assert m[("kvservice_recovery_ratio", frozenset())] == 0.5
        assert ("kvservice_stores_total", empty) not in m  # nothing counted outside the namespace
        # the engine's Store, Load and Lookup went on the frames channel, over connections it kept open
        assert m[("kvservice_frames_channel_connections", frozenset())] >= 1
        for call in ("lookup", "store", "load"):
            assert m[("kvservice_frames_channel_calls_total", frozenset({("call", call)}))] == 1, call


def test_engine_metrics_have_process_series_and_no_created() -> None:
    """Scenario: the reference engine's /metrics (the registry http_api serves) after a request."""
    metrics = EngineMetrics()
    metrics.requests.labels("gpu", "stop").inc()
    metrics.ttft.observe(0.02)
    text = prom.generate_latest(metrics.registry).decode()
    assert promtool_problems(text) == []
    m = samples(text)
    assert ("process_resident_memory_bytes", frozenset()) in m
    assert m[("model_runner_requests_total", frozenset({("kv_source", "gpu"), ("finish_reason", "stop")}))] == 1
    assert not any(name.endswith("_created") for name, _ in m)


def test_the_lint_catches_what_promtool_would() -> None:
    """The checker itself: a gauge named _rate, a counter-ish gauge with _total, missing help."""
    bad = ("# HELP x_recovery_rate r\n# TYPE x_recovery_rate gauge\nx_recovery_rate 1\n"
           "# HELP y_total y\n# TYPE y_total gauge\ny_total 1\n"
           "# TYPE z_latency_milliseconds gauge\nz_latency_milliseconds 1\n")
    problems = promtool_problems(bad)
    assert any("x_recovery_rate" in p and "_ratio" in p for p in problems)
    assert any("y_total" in p and "non-counter" in p for p in problems)
    assert any("z_latency_milliseconds" in p and "base units" in p for p in problems)
    assert any("z_latency_milliseconds" in p and "help" in p for p in problems)
