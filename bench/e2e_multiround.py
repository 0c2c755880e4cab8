#!/usr/bin/env python3
"""End-to-end benchmark: model runners over HTTP, with and without a kvservice daemon (DESIGN §7).

    python bench/e2e_multiround.py --out DIR [--budget-seconds 330] [--model 8b --device cuda]
    python bench/e2e_multiround.py --model tiny --device cpu --budget-seconds 60 --out /tmp/e2e   # smoke test

One command, one host. The script starts the daemons (`python -m kvservice serve --io-backend auto`,
sockets and the disk tier under a fresh /tmp directory) and every model runner it needs
(`python -m model_runner --port 0 ...`) at once, calibrates on the recompute-only runner, plans what fits
in --budget-seconds, then runs these configurations one after another, each driven over HTTP
(streaming /v1/completions, token-id prompts):

1. Multi-round QA, in the shape of LMBenchmark's long-input/short-output run: U users, R rounds; every
   prompt is a shared system prompt + the user's own context + all earlier questions and answers + a new
   question; short answers. Arrivals at a fixed rate (user u's round r is due at (r*U + u) / rate, and
   waits for the user's previous answer); the rate keeps the recompute-only runner --load-factor busy
   in the last (longest) round, by its measured service time. The per-user histories grow until the
   working set is larger than GPU + host tier, so that the disk tier serves part of the hits.
   Configurations: recompute only (GPU tier, no daemon); daemon with a host tier only; host + disk with
   prefetch N = 4, 0, 2, 8 (the runner's --prefetch-reqs). Every configuration sends prompts of the same
   lengths at the same times (its own token ids, so nothing left over from an earlier run can hit); the
   daemon is emptied (Admin.Evict all) before each one, and every multi-round runner is a fresh process.
2. No reuse: unique prompts, closed loop; throughput of the recompute-only runner (no daemon) against
   a runner with the host + disk daemon (write-through stores of every prefill). Halves in the order
   alone, daemon, daemon, alone, so that drift cancels.
3. Four engines, one daemon: the four host+disk runners (prefetch 0/2/4/8, one namespace). One runner
   stores two sets of contexts; a runner that never computed them loads set 1 (one engine's load
   bandwidth), then all four load set 2 at once (aggregate load bandwidth; every load of a block another
   process stored is cross-engine reuse). Bandwidth = blocks loaded (Admin.Stats) x block bytes / wall
   time, host-tier hits, twice on a GPU (see run_four for how GPU-tier leftovers are kept out).

Sizes follow the runner's GPU tier (default_sizes): for 8b, 256 blocks of 2 MiB, host tier 2.5 x and disk
tier 16 x that, prompts up to ~3.6k tokens, 8 users x 8 rounds. Six 8B runners share the GPU at once (about
16.5 GiB each for weights and pool, plus their attention buffers; see default_sizes).

Importance, for what is dropped when the budget is short (after U and R are scaled down as far as the
workload allows): recompute-only, host+disk N=4, host+disk N=0, host-only, no reuse, four engines,
N=2, N=8. Progress bars with tqdm when installed. After every configuration --out gets results.json,
results.md (the tables, ratios against the DESIGN §7 targets, PASS/MISS) and, with matplotlib, the
PNG plots (bench/plot_e2e.py, which also redraws them from a results.json).
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import importlib.metadata
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from model_runner.config import PRESETS  # noqa: E402  # no torch behind this import

try:  # optional
    from tqdm import tqdm as _tqdm  # type: ignore
except Exception:  # noqa: BLE001
    _tqdm = None

MiB, GiB = 1 << 20, 1 << 30
TPB = 16

# name -> (label, kind, engine key, daemon key)
CONFIGS: dict[str, tuple[str, str, tuple[str, ...], str]] = {
    "recompute": ("recompute only (no daemon)", "mr", ("R",), ""),
    "hd_p4": ("host+disk, prefetch 4", "mr", ("P4",), "D"),
    "hd_p0": ("host+disk, prefetch 0", "mr", ("P0",), "D"),
    "host_only": ("host tier only, prefetch 4", "mr", ("H",), "H"),
    "no_reuse": ("no reuse: engine alone vs with daemon", "nr", ("R", "P4"), "D"),
    "four_engines": ("four engines, one daemon", "fe", ("P0", "P2", "P4", "P8"), "D"),
    "hd_p2": ("host+disk, prefetch 2", "mr", ("P2",), "D"),
    "hd_p8": ("host+disk, prefetch 8", "mr", ("P8",), "D"),
}
IMPORTANCE = ["recompute", "hd_p4", "hd_p0", "host_only", "no_reuse", "four_engines", "hd_p2", "hd_p8"]
RUN_ORDER = ["recompute", "hd_p4", "hd_p0", "host_only", "no_reuse", "hd_p2", "hd_p8", "four_engines"]
ENGINE_PREFETCH = {"R": 4, "H": 4, "P0": 0, "P2": 2, "P4": 4, "P8": 8}
PREFETCH_CONFIGS = {0: "hd_p0", 2: "hd_p2", 4: "hd_p4", 8: "hd_p8"}
KV_SOURCES = ["none", "gpu", "loaded", "recomputed:cheaper", "recomputed:load-failed", "recomputed:service-down"]


# ----------------------------------------------------------------------------------------------
# Sizes


@dataclass
class Sizes:
    model: str
    dtype_bytes: int
    block_bytes: int
    gpu_blocks: int
    host_blocks: int
    disk_blocks: int
    sys_len: int  # shared system prompt
    ctx_len: int  # each user's own context, before round 0
    q_len: int  # question per round
    answer: int  # max_tokens of a multi-round request
    users: int
    rounds: int
    fe_len: int  # four-engine context: whole blocks + 1 token, so that every full block can be loaded
    fe_k: int  # contexts per set
    nr_len: int  # no-reuse prompt length
    nr_conc: int  # no-reuse concurrent clients

    @property
    def pool_tokens(self) -> int:
        return self.gpu_blocks * TPB

    def user_part(self, r: int) -> int:
        """Tokens after the system prompt in round r's prompt (answers counted at full length)."""
        return self.ctx_len + r * (self.q_len + self.answer) + self.q_len

    def prompt_len(self, r: int) -> int:
        return self.sys_len + self.user_part(r)

    def working_set_blocks(self) -> int:
        """Distinct blocks of all users' final histories plus the system prompt."""
        return (self.sys_len + self.users * (self.ctx_len + self.rounds * (self.q_len + self.answer))) // TPB

    def scaled(self, users: int, rounds: int) -> "Sizes":
        """Fewer rounds: longer initial user contexts, so the final histories (and working set) stay."""
        extra = (self.rounds - rounds) * (self.q_len + self.answer)
        d = asdict(self)
        d.update(users=users, rounds=rounds, ctx_len=self.ctx_len + extra)
        return Sizes(**d)


def default_sizes(model: str, dtype_bytes: int, args: argparse.Namespace) -> Sizes:
    """Sizes in proportion to the GPU tier (P tokens): prompts up to ~0.85 P, host tier 2.5 x and disk tier
    16 x the GPU tier, so that 8 users' final histories are ~1.5 x (GPU + host).

    8b: 256 blocks of 2 MiB (0.5 GiB GPU tier, 4096 tokens), host 1.25 GiB, disk 8 GiB; system prompt 1000
    tokens, user context 100, question 300, answer 8; 8 rounds make prompts of up to ~3.6k tokens. Why not
    longer: model_runner's attention passes 3-D tensors to SDPA, which on CUDA means the math kernel in
    float32, [heads, new tokens, context] scores materialised twice or three times (~5 GB at 3.5k x 3.5k
    tokens), and six 8B engines (16.5 GiB each with weights and pool) share one 141 GB GPU.
    """
    cfg = PRESETS[model]
    block_bytes = cfg.kv_bytes_per_token(dtype_bytes) * TPB
    gpu_blocks = args.gpu_blocks or (128 if model == "tiny" else 256)
    p = gpu_blocks * TPB
    answer = args.answer_tokens or (4 if model == "tiny" else 8)
    host_blocks = (args.host_capacity // block_bytes) if args.host_capacity else gpu_blocks * 5 // 2
    disk_blocks = (args.disk_capacity // block_bytes) if args.disk_capacity else 16 * gpu_blocks
    # four engines: sets of 2 contexts of half the GPU tier each (+1 token, so every block is loadable); a set
    # needs 2 x (P/2 + 1) blocks > the GPU tier, and two sets fit the host tier
    return Sizes(model=model, dtype_bytes=dtype_bytes, block_bytes=block_bytes, gpu_blocks=gpu_blocks,
                 host_blocks=host_blocks, disk_blocks=disk_blocks,
                 sys_len=args.system_prompt or round(0.2442 * p), ctx_len=round(0.0244 * p),
                 q_len=args.question_tokens or round(0.0732 * p), answer=answer,
                 users=args.users or 8, rounds=args.rounds or 8,
                 fe_len=(gpu_blocks // 2) * TPB + 1, fe_k=2, nr_len=round(0.2442 * p), nr_conc=4)


# ----------------------------------------------------------------------------------------------
# Small helpers


def now() -> float:
    return time.monotonic()


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def fmt(x: Any, nd: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if math.isnan(x) or math.isinf(x):
            return "-"
        return f"{x:.{nd}f}"
    return str(x)


def hb(n: float) -> str:
    """Bytes for people: 1.5 GiB, 8 MiB, 64 KiB."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def log(msg: str) -> None:
    line = f"[e2e {time.strftime('%H:%M:%S')}] {msg}"
    if _tqdm is not None:
        _tqdm.write(line, file=sys.stderr)
    else:
        print(line, file=sys.stderr, flush=True)


class Progress:
    """tqdm when installed, else a line at every quarter."""

    def __init__(self, total: int, desc: str, unit: str = "req") -> None:
        self.total, self.desc, self.n, self._lock = max(1, total), desc, 0, threading.Lock()
        self._bar = _tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=True) if _tqdm else None
        self._next = 0.25
        if self._bar is None:
            log(f"{desc}: 0/{total}")

    def update(self, k: int = 1) -> None:
        with self._lock:
            self.n += k
            if self._bar is not None:
                self._bar.update(k)
            elif self.n / self.total >= self._next:
                log(f"{self.desc}: {self.n}/{self.total}")
                while self.n / self.total >= self._next:
                    self._next += 0.25

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def interpolate(pts: list[tuple[float, float]]) -> Any:
    """Piecewise-linear y(x) through measured points (x ascending), the end segments extended."""
    pts = sorted(pts)

    def f(x: float) -> float:
        if len(pts) == 1:
            return pts[0][1]
        i = 1
        while i < len(pts) - 1 and x > pts[i][0]:
            i += 1
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        slope = max(0.0, (y1 - y0) / (x1 - x0)) if x1 != x0 else 0.0
        return max(1e-3, y0 + slope * (x - x0))
    return f


def rand_tokens(seed: Any, n: int, vocab: int) -> list[int]:
    rng = random.Random(str(seed))
    return [rng.randrange(1, vocab) for _ in range(n)]


# ----------------------------------------------------------------------------------------------
# Processes


class Children:
    """Every process this script starts, stopped by pid at the end."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def add(self, name: str, p: subprocess.Popen) -> None:
        self.procs.append((name, p))

    def stop_all(self, timeout: float = 10.0) -> None:
        """SIGTERM the engines, then the daemons (SIGKILL what is left at the deadline)."""
        deadline = now() + timeout
        for group in ("aux", "engine", "daemon"):
            procs = [p for name, p in self.procs if name.startswith(group)]
            for p in procs:
                if p.poll() is None:
                    try:
                        p.send_signal(signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            for p in procs:
                try:
                    p.wait(max(0.1, (deadline - now()) * (0.6 if group == "engine" else 1.0)))
                except subprocess.TimeoutExpired:
                    p.kill()
                    try:
                        p.wait(5)
                    except subprocess.TimeoutExpired:
                        pass


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


class DaemonProc:
    def __init__(self, key: str, workdir: Path, logdir: Path, host_bytes: int, disk_bytes: int, children: Children,
                 io_backend: str) -> None:
        import grpc  # noqa: F401  # fail early if missing
        self.key = key
        self.dir = workdir / f"d{key}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.socket = str(self.dir / "kv.sock")
        self.target = f"unix://{self.socket}"
        self.disk = disk_bytes > 0
        argv = [sys.executable, "-m", "kvservice", "serve", "--socket-path", self.socket,
                "--host-capacity", str(host_bytes), "--io-backend", io_backend, "--log-level", "warning"]
        if disk_bytes:
            argv += ["--disk-path", str(self.dir / "disk"), "--disk-capacity", str(disk_bytes)]
        self.log_path = logdir / f"daemon-{key}.log"
        with open(self.log_path, "ab") as f:
            self.proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=child_env(), cwd=str(ROOT))
        children.add(f"daemon-{key}", self.proc)
        self.argv = argv

    def wait_ready(self, timeout: float) -> None:
        deadline = now() + timeout
        while now() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon {self.key} exited with {self.proc.returncode}: {self.tail()}")
            if os.path.exists(self.socket) and self.serving():
                return
            time.sleep(0.1)
        raise TimeoutError(f"daemon {self.key} not serving after {timeout:.0f}s: {self.tail()}")

    def tail(self, n: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def serving(self) -> bool:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        try:
            with grpc.insecure_channel(self.target) as ch:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                return r.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def _admin(self, method: str, **kw: Any) -> Any:
        import grpc
        from kvservice.v1 import admin_pb2, admin_pb2_grpc
        with grpc.insecure_channel(self.target) as ch:
            stub = admin_pb2_grpc.AdminStub(ch)
            return getattr(stub, method)(getattr(admin_pb2, f"{method}Request")(**kw), timeout=30)

    def stats(self) -> dict:
        r = self._admin("Stats")
        c = r.counters
        counters = {f.name: getattr(c, f.name) for f in c.DESCRIPTOR.fields}
        lat = {h.name: {"count": h.count, "sum": h.sum} for h in r.latencies}
        tiers = {t.name: {"capacity_bytes": t.capacity_bytes, "used_bytes": t.used_bytes, "blocks": t.blocks,
                          "pinned_blocks": t.pinned_blocks} for t in r.tiers}
        return {"counters": counters, "latencies": lat, "tiers": tiers, "io_backend": r.io_backend,
                "write_queue_depth": r.write_queue_depth, "read_queue_depth": r.read_queue_depth,
                "sessions": r.sessions, "version": r.version,
                "block_bytes": [n.block_bytes for n in r.namespaces]}

    def evict_all(self) -> int:
        return int(self._admin("Evict", all=True).evicted_blocks)

    def settle(self, timeout: float) -> bool:
        """Wait until the write queue is empty (spills written); True when it is."""
        deadline = now() + timeout
        while True:
            s = self.stats()
            if s["write_queue_depth"] == 0 and s["read_queue_depth"] == 0:
                return True
            if now() > deadline:
                return False
            time.sleep(0.1)


_COLD_DISK_LOOP = """
import os, sys, time
root, interval = sys.argv[1], float(sys.argv[2])
while True:
    for d, _, names in os.walk(root):
        for n in names:
            try:
                fd = os.open(os.path.join(d, n), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
            finally:
                os.close(fd)
    time.sleep(interval)
"""


class ColdDisk:
    """--cold-disk: a helper process that every `interval` seconds posix_fadvise(DONTNEED)s every file of a disk
    tier, so that disk-tier hits read the device rather than the page cache (a disk tier much larger than RAM).
    A process of its own, so that it takes no GIL time from the client threads that time the requests."""

    def __init__(self, directory: str, children: Children, interval: float = 0.5) -> None:
        self.dir, self.interval = directory, interval
        self.proc = subprocess.Popen([sys.executable, "-c", _COLD_DISK_LOOP, directory, str(interval)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        children.add("aux-cold-disk", self.proc)


class EngineProc:
    def __init__(self, key: str, args: argparse.Namespace, sizes: Sizes, daemon: DaemonProc | None,
                 logdir: Path, children: Children) -> None:
        self.key = key
        self.daemon = daemon
        self.prefetch = ENGINE_PREFETCH[key]
        argv = [sys.executable, "-m", "model_runner", "--service", daemon.target if daemon else "",
                "--model", args.model, "--device", args.device, "--dtype", args.dtype, "--port", "0",
                "--tokens-per-block", str(TPB), "--gpu-blocks", str(sizes.gpu_blocks),
                "--prefetch-reqs", str(self.prefetch), "--load-policy", args.load_policy,
                "--client-name", f"e2e-{key}", "--log-level", "warning"]
        self.argv = argv
        self.log_path = logdir / f"engine-{key}.log"
        self._log = open(self.log_path, "ab")
        env = child_env()
        if args.device != "cpu" and args.engine_alloc_conf and "PYTORCH_CUDA_ALLOC_CONF" not in env:
            env["PYTORCH_CUDA_ALLOC_CONF"] = args.engine_alloc_conf  # the KV pool is its own cudaMalloc
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._log, env=env, cwd=str(ROOT),
                                     text=True, bufsize=1)
        children.add(f"engine-{key}", self.proc)
        self.url: str | None = None
        self.host, self.port = "", 0
        self.t_start = now()
        self.t_ready: float | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read_stdout, daemon=True).start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            m = re.search(r"model-runner listening on (http://\S+)", line)
            if m and self.url is None:
                self.url = m.group(1)
                u = re.match(r"http://\[?([^\]/]+?)\]?:(\d+)$", self.url)
                if u:
                    self.host, self.port = u.group(1), int(u.group(2))
                self.t_ready = now()
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float) -> None:
        self._ready.wait(timeout)
        if self.url is None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine {self.key} exited with {self.proc.returncode}: {self.tail()}")
            raise TimeoutError(f"engine {self.key} not listening after {timeout:.0f}s: {self.tail()}")

    def tail(self, n: int = 1500) -> str:
        try:
            self._log.flush()
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
        c = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            c.request("GET", path)
            r = c.getresponse()
            return r.status, r.read()
        finally:
            c.close()

    def health(self) -> dict:
        try:
            st, body = self.get("/health")
            return json.loads(body) if st == 200 else {"status": st}
        except Exception as e:  # noqa: BLE001
            return {"error": repr(e)}

    def metrics(self) -> dict[str, float]:
        try:
            st, body = self.get("/metrics")
        except Exception:  # noqa: BLE001
            return {}
        out: dict[str, float] = {}
        for line in body.decode(errors="replace").splitlines():
            if not line or line.startswith("#"):
                continue
            try:
                name, val = line.rsplit(" ", 1)
                out[name] = float(val)
            except ValueError:
                continue
        return out


# ----------------------------------------------------------------------------------------------
# HTTP client


@dataclass
class Reply:
    ok: bool
    error: str = ""
    t_send: float = 0.0  # monotonic
    ttft_ms: float | None = None  # client side: request sent -> first token
    total_ms: float | None = None
    output_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    by_tier: dict[str, int] = field(default_factory=dict)
    kv_source: str = ""
    engine_ttft_ms: float | None = None


def complete(engine: EngineProc, prompt: list[int], max_tokens: int, timeout: float) -> Reply:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}).encode()
    t0 = now()
    rep = Reply(ok=False, t_send=t0)
    conn = http.client.HTTPConnection(engine.host, engine.port, timeout=max(1.0, timeout))
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            rep.error = f"HTTP {r.status}: {r.read()[:300]!r}"
            return rep
        final = None
        while True:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                rep.error = str(obj["error"].get("message", obj["error"]))[:300]
                return rep
            ids = obj.get("token_ids") or []
            if ids and rep.ttft_ms is None:
                rep.ttft_ms = (now() - t0) * 1e3
            rep.output_ids.extend(ids)
            if "usage" in obj:
                final = obj
        rep.total_ms = (now() - t0) * 1e3
        if final is None:
            rep.error = "stream ended without usage"
            return rep
        u, kv = final["usage"], final.get("kv_cache", {})
        rep.prompt_tokens = u.get("prompt_tokens", len(prompt))
        rep.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        rep.by_tier = {k: int(v) for k, v in (kv.get("cached_tokens_by_tier") or {}).items()}
        rep.kv_source = kv.get("kv_source", "")
        rep.engine_ttft_ms = kv.get("ttft_ms")
        if rep.ttft_ms is None:
            rep.ttft_ms = rep.total_ms
        rep.ok = True
        return rep
    except Exception as e:  # noqa: BLE001
        rep.error = f"{type(e).__name__}: {e}"[:300]
        return rep
    finally:
        conn.close()


# ----------------------------------------------------------------------------------------------
# Measurements


def counter_delta(after: dict, before: dict) -> dict:
    a, b = after["counters"], before["counters"]
    d = {k: (a[k] - b.get(k, 0)) for k in a if k != "recovery_rate"}
    d["recovery_rate"] = d["blocks_loaded_back"] / d["blocks_offloaded"] if d.get("blocks_offloaded") else None
    lat = {}
    for name, h in after["latencies"].items():
        h0 = before["latencies"].get(name, {"count": 0, "sum": 0.0})
        n = h["count"] - h0["count"]
        lat[name] = {"count": n, "mean_ms": (h["sum"] - h0["sum"]) / n * 1e3 if n else None}
    d["latencies"] = lat
    return d


def metrics_delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    out = {}
    for k, v in after.items():
        if k.endswith("_total") or "_total{" in k:
            dv = v - before.get(k, 0.0)
            if dv:
                out[k] = dv
        elif k.startswith(("model_runner_load_bandwidth", "model_runner_prefill_tokens_per_second")):
            out[k] = v
    return out


def summarize_requests(recs: list[dict], duration: float) -> dict:
    ok = [r for r in recs if r["ok"]]
    ttft = [r["ttft_ms"] for r in ok]
    later = [r["ttft_ms"] for r in ok if r.get("round", 1) >= 1]
    prompt_toks = sum(r["prompt_tokens"] for r in ok)
    out_toks = sum(r["output_tokens"] for r in ok)
    tiers = {t: sum(r["by_tier"].get(t, 0) for r in ok) for t in ("gpu", "host", "disk")}
    src: dict[str, int] = {}
    for r in ok:
        src[r["kv_source"]] = src.get(r["kv_source"], 0) + 1
    return {
        "requests": len(recs), "ok": len(ok), "errors": len(recs) - len(ok),
        "duration_s": duration,
        "ttft_p50_ms": pct(ttft, 50), "ttft_p90_ms": pct(ttft, 90), "ttft_mean_ms": statistics.fmean(ttft) if ttft else None,
        "ttft_p50_rounds1plus_ms": pct(later, 50), "ttft_p90_rounds1plus_ms": pct(later, 90),
        "engine_ttft_p50_ms": pct([r["engine_ttft_ms"] for r in ok if r["engine_ttft_ms"] is not None], 50),
        "req_per_s": len(ok) / duration if duration > 0 else None,
        "prompt_tok_per_s": prompt_toks / duration if duration > 0 else None,
        "output_tok_per_s": out_toks / duration if duration > 0 else None,
        "total_tok_per_s": (prompt_toks + out_toks) / duration if duration > 0 else None,
        "prompt_tokens": prompt_toks, "output_tokens": out_toks,
        "reused_tokens": tiers, "reused_fraction": (sum(tiers.values()) / prompt_toks) if prompt_toks else None,
        "kv_source": src,
    }


def rec_of(rep: Reply, **kw: Any) -> dict:
    return {"ok": rep.ok, "error": rep.error, "ttft_ms": rep.ttft_ms, "total_ms": rep.total_ms,
            "engine_ttft_ms": rep.engine_ttft_ms, "prompt_tokens": rep.prompt_tokens,
            "output_tokens": len(rep.output_ids), "cached_tokens": rep.cached_tokens, "by_tier": rep.by_tier,
            "kv_source": rep.kv_source, **kw}


# ----------------------------------------------------------------------------------------------
# The benchmark


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = now()
        self.deadline = self.t0 + args.budget_seconds
        dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[args.dtype]
        self.base_sizes = default_sizes(args.model, dtype_bytes, args)
        self.sizes = self.base_sizes
        b = self.base_sizes
        if b.prompt_len(b.rounds - 1) + b.answer > b.pool_tokens:
            raise SystemExit(f"the last round's prompt ({b.prompt_len(b.rounds - 1)} tokens) + answer does not fit "
                             f"the runner's GPU tier ({b.pool_tokens} tokens): fewer rounds or more --gpu-blocks")
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kve2e-", dir="/tmp"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.logdir = self.out / "logs"
        self.logdir.mkdir(exist_ok=True)
        self.children = Children()
        self.vocab = PRESETS[args.model].vocab
        self.daemons: dict[str, DaemonProc] = {}
        self.engines: dict[str, EngineProc] = {}
        self.cold: ColdDisk | None = None
        self.results: dict[str, Any] = {
            "meta": self._meta(), "sizes": asdict(self.base_sizes), "plan": {}, "calibration": {},
            "configs": {}, "no_reuse": None, "four_engines": None, "skipped": [], "targets": [], "startup": {},
        }

    # --- bookkeeping
    def remaining(self) -> float:
        return self.deadline - now()

    def _meta(self) -> dict:
        a = self.args

        def ver(pkg: str) -> str:
            try:
                return importlib.metadata.version(pkg)
            except Exception:  # noqa: BLE001
                return "-"

        gpu = "-"
        if shutil.which("nvidia-smi"):
            try:
                gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                      "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
            except Exception:  # noqa: BLE001
                pass
        cpu = "-"
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        mem = "-"
        try:
            kb = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))
            mem = f"{kb / (1 << 20):.1f} GiB"
        except Exception:  # noqa: BLE001
            pass
        commit = "-"
        try:
            commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, timeout=5).stdout.strip() or "-"
            dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True, text=True,
                                   timeout=5).stdout.strip()
            if dirty and commit != "-":
                commit += " (+ working-tree changes)"
        except Exception:  # noqa: BLE001
            pass
        return {
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%a %b %d %H:%M:%S UTC %Y"),
            "host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "cpu": cpu, "nproc": os.cpu_count(), "memory": mem, "gpu": gpu,
            "torch": ver("torch"),
            "kvikio": next((v for v in map(ver, ("kvikio", "kvikio-cu13", "kvikio-cu12")) if v != "-"), "-"),
            "grpcio": ver("grpcio"), "commit": commit,
            "args": vars(a),
        }

    def save(self) -> None:
        """results.json, results.md and the plots, as they stand (called after every configuration)."""
        self.results["targets"] = self.targets()
        self.results["elapsed_s"] = now() - self.t0
        try:
            import plot_e2e  # bench/plot_e2e.py
            self.results["plots"] = plot_e2e.plot(self.results, self.out)
        except Exception as e:  # noqa: BLE001  # matplotlib missing or a plotting problem: data first
            self.results["plots"] = [f"not drawn: {type(e).__name__}: {e}"]
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=1, default=str))
        tmp.replace(self.out / "results.json")
        (self.out / "results.md").write_text(render_md(self.results))

    def skip(self, name: str, reason: str) -> None:
        log(f"skip {name}: {reason}")
        self.results["skipped"].append({"config": name, "reason": reason})

    # --- planning
    def priors(self) -> dict:
        """Service-time model before calibration (seconds): s(x) = a + b*x for x prompt tokens computed."""
        if self.args.device.startswith("cuda"):
            per_tok = {"8b": 30e-6, "1b": 6e-6}.get(self.args.model, 2e-6)
            return {"a": 0.02, "b": per_tok, "c": 1e-9 if self.args.model == "8b" else 0.0,
                    "decode": {"8b": 0.012, "1b": 0.006}.get(self.args.model, 0.004),
                    "startup": 45.0 if self.args.model == "8b" else 25.0}
        return {"a": 0.01, "b": 4e-6, "c": 5e-8, "decode": 0.004, "startup": 10.0}

    def costs(self, cal: dict, sizes: Sizes, configs: list[str]) -> dict[str, float]:
        """Estimated seconds per configuration (multi-round: for the given sizes)."""
        s_max = cal["s"](sizes.user_part(sizes.rounds - 1))
        lam = self.rate_for(cal, sizes)
        n = sizes.users * sizes.rounds
        gpu = self.args.device != "cpu"
        fixed = 3.0 if gpu else 0.8  # emptying and settling the daemon, Stats, metrics, results
        mr = 0.3 + n / lam + self.drain(s_max) + fixed
        s_nr = cal["s"](sizes.nr_len)
        nr = (2 * self.nr_warm(sizes) + 4 * self.nr_count(cal, sizes)) * s_nr / 1.2 + fixed + 1.0
        s_fe = cal["ttft"](sizes.fe_len)
        # per repetition: flush (4 engines x fe_k prefills), populate (2 fe_k), loads, and spills to settle
        fe = self.fe_reps() * (8 * sizes.fe_k * s_fe + (4.0 if gpu else 0.5)) + fixed
        est = {"mr": mr, "nr": nr, "fe": fe}
        return {c: est[CONFIGS[c][1]] for c in configs}

    def rate_for(self, cal: dict, sizes: Sizes) -> float:
        """Arrivals per second. Users move through the rounds together and prompts grow every round, so the
        rate is set against the last (longest) round: there the recompute-only runner is --load-factor busy,
        and never more than that earlier; its TTFT is prefill plus little queueing, not a growing backlog."""
        return self.args.rate or self.args.load_factor / cal["s"](sizes.user_part(sizes.rounds - 1))

    def drain(self, s_max: float) -> float:
        """Time after the last arrival for the queue to empty."""
        return max(2.0 if self.args.device != "cpu" else 0.5, 3 * s_max)

    def fe_reps(self) -> int:
        return 1 if self.args.device == "cpu" else 2

    def nr_warm(self, sizes: Sizes) -> int:
        """Warm-up requests per engine: enough to push earlier blocks out of its GPU tier."""
        return max(2, math.ceil(sizes.pool_tokens / sizes.nr_len) + 1)

    def nr_count(self, cal: dict, sizes: Sizes) -> int:
        """Requests per half of the no-reuse run (four halves)."""
        target_s = 4.0 if self.args.device != "cpu" else 1.5
        return max(2 * sizes.nr_conc, int(target_s / cal["s"](sizes.nr_len)))

    def plan(self, cal: dict, candidates: list[str], budget: float) -> tuple[list[str], Sizes]:
        """What fits the budget. First fewer rounds (each user's first context grows so that the final
        histories stay), then fewer users as long as the working set stays >= 1.2 x (GPU + host), then the
        least important configurations go; fewer users than that only as a last resort."""
        base = self.base_sizes
        r_min = min(base.rounds, 3 if self.args.model != "tiny" else 2)
        u_min = min(base.users, 2)
        hist = base.ctx_len + base.rounds * (base.q_len + base.answer)  # tokens per user at the end
        need = 1.2 * (base.gpu_blocks + base.host_blocks) * TPB
        u_floor = min(base.users, max(u_min, math.ceil((need - base.sys_len) / hist)))
        shapes = [(base.users, r) for r in range(base.rounds, r_min - 1, -1)]
        shapes += [(u, r_min) for u in range(base.users - 1, u_min - 1, -1)]
        ordered = [c for c in IMPORTANCE if c in candidates]
        for allowed in ([sh for sh in shapes if sh[0] >= u_floor], shapes):
            for k in range(len(ordered), 0, -1):
                sel = ordered[:k]
                for users, rounds in allowed:
                    sizes = base.scaled(users, rounds)
                    if sum(self.costs(cal, sizes, sel).values()) <= budget:
                        return sel, sizes
        return [], base.scaled(u_min, r_min)

    # --- start-up
    def start(self, engines: set[str]) -> None:
        a, s = self.args, self.sizes
        need_d = bool(engines & {"P0", "P2", "P4", "P8"})
        t = now()
        if "H" in engines:
            self.daemons["H"] = DaemonProc("H", self.workdir, self.logdir, s.host_blocks * s.block_bytes, 0,
                                           self.children, a.io_backend)
        if need_d:
            self.daemons["D"] = DaemonProc("D", self.workdir, self.logdir, s.host_blocks * s.block_bytes,
                                           s.disk_blocks * s.block_bytes, self.children, a.io_backend)
        for d in list(self.daemons.values()):
            try:
                d.wait_ready(min(60.0, max(5.0, self.remaining() - 10)))
            except Exception as e:  # noqa: BLE001
                log(f"daemon {d.key} failed: {e}")
                del self.daemons[d.key]
        if a.cold_disk and "D" in self.daemons:
            self.cold = ColdDisk(str(self.daemons["D"].dir / "disk"), self.children)
        self.results["startup"]["daemons_s"] = now() - t
        order = [k for k in ("R", "P4", "P0", "H", "P2", "P8") if k in engines]
        for k in order:
            daemon = None if k == "R" else self.daemons.get("H" if k == "H" else "D")
            if k != "R" and daemon is None:
                continue
            self.engines[k] = EngineProc(k, a, s, daemon, self.logdir, self.children)
        failed = []
        for k, e in list(self.engines.items()):
            try:
                e.wait_ready(max(5.0, min(a.engine_start_timeout, self.remaining() - 10)))
            except Exception as ex:  # noqa: BLE001
                log(f"engine {k} failed to start: {ex}")
                failed.append(k)
        for k in failed:
            del self.engines[k]
        self.results["startup"].update({
            "engines_s": now() - t,
            "per_engine_s": {k: (e.t_ready - e.t_start) if e.t_ready else None for k, e in self.engines.items()},
            "engine_argv": {k: e.argv for k, e in self.engines.items()},
            "daemon_argv": {k: d.argv for k, d in self.daemons.items()},
        })
        for k, e in self.engines.items():
            if e.daemon is not None:
                h = e.health()
                if not h.get("service_attached"):
                    log(f"warning: engine {k} reports service_attached={h.get('service_attached')}: {h}")
        for d in self.daemons.values():
            st = d.stats()
            self.results["startup"][f"daemon_{d.key}"] = {"io_backend": st["io_backend"], "tiers": st["tiers"],
                                                          "version": st["version"]}
        log(f"started daemons {sorted(self.daemons)} and engines {sorted(self.engines)} in {now() - t:.1f}s")

    # --- calibration on the recompute-only runner
    def calibrate(self) -> dict:
        e = self.engines["R"]
        s = self.sizes
        sys_cal = rand_tokens("cal-sys", s.sys_len, self.vocab)
        x1 = s.ctx_len + s.q_len
        x2 = max(x1 + TPB, min(s.user_part(s.rounds - 1), s.pool_tokens - s.sys_len - s.answer - 2 * TPB))
        pts = []
        # Every runner's first request (R: computes the system prompt). For the runners with a daemon it also
        # makes the daemon allocate its pinned host memory and map the pools before anything is timed, and
        # seeds the runner's prefill-speed estimate; every such runner gets the same one request.
        warm: list[Reply] = []
        ts = [threading.Thread(target=lambda k=k: warm.append(complete(
            self.engines[k], sys_cal + rand_tokens(f"cal-0-{k}", x1, self.vocab), s.answer, 300)), daemon=True)
            for k in self.engines if k != "R"]
        for t in ts:
            t.start()
        complete(e, sys_cal + rand_tokens("cal-0", x1, self.vocab), s.answer, 300)
        for t in ts:
            t.join(300)
        bad = [w.error for w in warm if not w.ok]
        if bad:
            log(f"warning: {len(bad)} warm-up request(s) failed: {bad[0]}")
        for d in self.daemons.values():
            d.settle(30)
        xm = (x1 + x2) // 2
        for i, x in enumerate((x1, xm, x2, x1)):
            rep = complete(e, sys_cal + rand_tokens(f"cal-{i + 1}", x, self.vocab), s.answer, 300)
            if not rep.ok:
                raise RuntimeError(f"calibration request failed: {rep.error}")
            pts.append((x, rep.total_ms / 1e3, rep.ttft_ms / 1e3))
        best: dict[int, tuple[float, float]] = {}
        for x, tot, ttft in pts:
            o = best.get(x)
            best[x] = (min(tot, o[0]), min(ttft, o[1])) if o else (tot, ttft)
        xs = sorted(best)
        cal = {"points": pts, "service": [(x, best[x][0]) for x in xs], "ttft": [(x, best[x][1]) for x in xs],
               "system_prompt_tokens": s.sys_len,
               "decode_per_token_s": max(0.0, (best[x1][0] - best[x1][1]) / max(1, s.answer - 1))}
        log("calibration (recompute-only runner, system prompt cached), new tokens: TTFT / total ms: "
            + ", ".join(f"{x}: {best[x][1] * 1e3:.0f} / {best[x][0] * 1e3:.0f}" for x in xs))
        return cal

    @staticmethod
    def model_of(cal: dict) -> dict:
        return {"s": interpolate(cal["service"]), "ttft": interpolate(cal["ttft"])}

    # --- run
    def run(self) -> None:
        a = self.args
        wanted = [c for c in IMPORTANCE if not a.configs or c in a.configs.split(",")]
        pri = self.priors()
        prior_cal = {"s": lambda x: pri["a"] + pri["b"] * x + pri["c"] * x * x + pri["decode"] * self.base_sizes.answer,
                     "ttft": lambda x: pri["a"] + pri["b"] * x + pri["c"] * x * x}
        # Before start-up: which engines to start (priors; generous so nothing is dropped early).
        pre_sel, _ = self.plan(prior_cal, wanted, 1.3 * (a.budget_seconds - pri["startup"] - a.reserve_seconds))
        if not pre_sel:
            pre_sel = wanted[:1]
        engines = {"R"} | {k for c in pre_sel for k in CONFIGS[c][2]}
        for c in wanted:
            if c not in pre_sel:
                self.skip(c, "does not fit the budget (estimate before start-up)")
        self.start(engines)
        if "R" not in self.engines:
            raise RuntimeError("the recompute-only engine did not start; nothing to calibrate on")
        cal = self.calibrate()
        self.results["calibration"] = cal
        m = self.model_of(cal)
        runnable = []
        for c in pre_sel:
            missing = [k for k in CONFIGS[c][2] if k not in self.engines]
            if missing:
                self.skip(c, f"engine(s) {missing} did not start")
            else:
                runnable.append(c)
        budget = self.remaining() - a.reserve_seconds
        sel, sizes = self.plan(m, runnable, budget)
        for c in runnable:
            if c not in sel:
                self.skip(c, "does not fit the budget (estimate after calibration)")
        self.sizes = sizes
        s_mean = statistics.fmean(m["s"](sizes.user_part(r)) for r in range(sizes.rounds))
        self.rate = self.rate_for(m, sizes)
        est = self.costs(m, sizes, sel)
        ws = sizes.working_set_blocks()
        self.results["plan"] = {
            "selected": sel, "run_order": [c for c in RUN_ORDER if c in sel], "estimates_s": est,
            "budget_left_s": budget, "users": sizes.users, "rounds": sizes.rounds,
            "rate_req_per_s": self.rate, "load_factor": a.load_factor,
            "recompute_mean_service_s": s_mean, "recompute_last_round_service_s": m["s"](sizes.user_part(sizes.rounds - 1)),
            "requests_per_config": sizes.users * sizes.rounds,
            "working_set_blocks": ws, "gpu_plus_host_blocks": sizes.gpu_blocks + sizes.host_blocks,
            "working_set_over_gpu_host": ws / (sizes.gpu_blocks + sizes.host_blocks),
            "max_prompt_tokens": sizes.prompt_len(sizes.rounds - 1),
        }
        self.results["sizes"] = asdict(sizes)
        log(f"plan: {sel}; U={sizes.users} R={sizes.rounds} rate={self.rate:.2f} req/s; "
            f"working set {ws} blocks = {ws / (sizes.gpu_blocks + sizes.host_blocks):.2f} x (GPU + host); "
            f"estimates {', '.join(f'{k} {v:.0f}s' for k, v in est.items())}; {budget:.0f}s left")
        self.save()
        pending = [c for c in RUN_ORDER if c in sel]
        while pending:
            c = pending.pop(0)
            more_important = [p for p in pending if IMPORTANCE.index(p) < IMPORTANCE.index(c)]
            need = est[c] + sum(est[p] for p in more_important)
            left = self.remaining() - a.reserve_seconds
            if left < est[c] * 0.6 or left < need * 0.85:
                self.skip(c, f"out of time ({left:.0f}s left, needs ~{est[c]:.0f}s"
                             f"{' + more important ones' if more_important else ''})")
                continue
            t = now()
            try:
                kind = CONFIGS[c][1]
                if kind == "mr":
                    self.run_multiround(c, m, hard_s=min(left, est[c] * 1.6))
                elif kind == "nr":
                    self.run_no_reuse(m, hard_s=min(left, est[c] * 1.6))
                else:
                    self.run_four(m, hard_s=min(left, est[c] * 1.8))
            except Exception as ex:  # noqa: BLE001  # one failed configuration must not lose the others
                log(f"{c} failed: {type(ex).__name__}: {ex}")
                self.results["skipped"].append({"config": c, "reason": f"failed: {type(ex).__name__}: {ex}"})
            log(f"{c}: {now() - t:.1f}s (estimate {est[c]:.1f}s); {self.remaining():.0f}s of the budget left")
            self.save()

    # --- 1. multi-round QA
    def workload(self, tag: str) -> tuple[list[int], list[list[int]], list[list[list[int]]]]:
        """Token ids of one configuration's run. Each configuration gets its own ids (same lengths, same
        times): a block left over from an earlier run (prefetched blocks stay pinned, and Evict skips pinned
        blocks) can never be a hit."""
        s = self.sizes
        sys_p = rand_tokens(f"{tag}-sys", s.sys_len, self.vocab)
        ctx = [rand_tokens(f"{tag}-ctx-{u}", s.ctx_len, self.vocab) for u in range(s.users)]
        qs = [[rand_tokens(f"{tag}-q-{u}-{r}", s.q_len, self.vocab) for r in range(s.rounds)] for u in range(s.users)]
        return sys_p, ctx, qs

    def empty_daemon(self, d: DaemonProc) -> dict:
        """Admin.Evict all once the write queue is empty; what stays is pinned (prefetch leases)."""
        d.settle(15)
        n = d.evict_all()
        st = d.stats()
        left = {k: v["blocks"] for k, v in st["tiers"].items()}
        if any(left.values()):
            log(f"daemon {d.key}: {n} blocks evicted, {left} still there (pinned)")
        return {"evicted": n, "left": left}

    def run_multiround(self, name: str, m: dict, hard_s: float) -> None:
        label, _, (ekey,), dkey = CONFIGS[name]
        e = self.engines[ekey]
        d = self.daemons.get(dkey) if dkey else None
        s = self.sizes
        emptied = self.empty_daemon(d) if d is not None else None
        st0 = d.stats() if d else None
        mt0 = e.metrics()
        sys_p, ctx, qs = self.workload(name)
        U, R, lam = s.users, s.rounds, self.rate
        s_max = m["s"](s.user_part(R - 1))
        t_start = now() + 0.3
        last_due = t_start + (U * R - 1) / lam
        hard_end = t_start + hard_s
        stop_issue = hard_end - max(1.0, 1.5 * s_max)
        recs: list[dict] = []
        lock = threading.Lock()
        bar = Progress(U * R, f"{name:>12}")

        def user(u: int) -> None:
            hist = sys_p + ctx[u]
            prev_len = 0
            for r in range(R):
                due = t_start + (r * U + u) / lam
                wait = due - now()
                if wait > 0:
                    time.sleep(wait)
                if now() > stop_issue:
                    with lock:
                        recs.append({"user": u, "round": r, "ok": False, "error": "not sent: config time limit",
                                     "unsent": True, "ttft_ms": None, "total_ms": None, "engine_ttft_ms": None,
                                     "prompt_tokens": 0, "output_tokens": 0, "cached_tokens": 0, "by_tier": {},
                                     "kv_source": "", "late_ms": 0.0, "reusable_tokens": 0, "t_send_s": None})
                    bar.update()
                    continue
                prompt = hist + qs[u][r]
                late = max(0.0, now() - due) * 1e3
                rep = complete(e, prompt, s.answer, timeout=max(5.0, hard_end - now() + 5))
                usable = (len(prompt) - 1) // TPB * TPB
                # what the previous round left cached: its prompt and answer but the last answer token (no KV)
                reusable = min(usable, (prev_len - 1) // TPB * TPB) if r else s.sys_len // TPB * TPB
                rec = rec_of(rep, user=u, round=r, late_ms=late, reusable_tokens=reusable,
                             t_send_s=rep.t_send - t_start)
                with lock:
                    recs.append(rec)
                bar.update()
                hist = prompt + rep.output_ids
                prev_len = len(hist)

        threads = [threading.Thread(target=user, args=(u,), daemon=True) for u in range(U)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.1, hard_end + 10 - now()))
        bar.close()
        t_end = now()
        done = [r for r in recs if r["ok"]]
        first_send = t_start
        last_done = max((t_start + r["t_send_s"] + r["total_ms"] / 1e3 for r in done), default=t_end)
        duration = max(1e-6, last_done - first_send)
        res = {"label": label, "engine": ekey, "prefetch": e.prefetch, "daemon_key": dkey or None, "emptied": emptied,
               "rate_req_per_s": lam, "users": U, "rounds": R, "scheduled_span_s": last_due - t_start,
               "truncated": any(r.get("unsent") for r in recs) or any(t.is_alive() for t in threads),
               "late_requests": sum(1 for r in recs if r.get("late_ms", 0) > 1000.0 / lam),
               **summarize_requests([r for r in recs if not r.get("unsent")], duration),
               "unsent": sum(1 for r in recs if r.get("unsent"))}
        res["first_request_error"] = next((r["error"] for r in recs if not r["ok"] and not r.get("unsent")), "")
        res["requests_detail"] = sorted(recs, key=lambda r: (r["round"], r["user"]))
        res["engine_metrics"] = metrics_delta(e.metrics(), mt0)
        if d is not None:
            d.settle(3)
            st1 = d.stats()
            dd = counter_delta(st1, st0)
            res["daemon"] = dd
            res["daemon_tiers_end"] = st1["tiers"]
            res["recovery_rate"] = dd["recovery_rate"]
            res["dropped_blocks"] = dd["drops_gate"] + dd["drops_pressure"] + dd["drops_no_disk"]
            res["daemon_errors"] = dd["load_failures"] + dd["checksum_failures"] + dd["io_errors"]
        else:
            res["recovery_rate"] = None
            res["dropped_blocks"] = None
            res["daemon_errors"] = None
        self.results["configs"][name] = res
        log(f"{name}: {res['ok']}/{res['requests']} ok, p50 TTFT {fmt(res['ttft_p50_ms'])} ms, "
            f"p90 {fmt(res['ttft_p90_ms'])} ms, reused {res['reused_tokens']}, recovery {fmt(res['recovery_rate'], 3)}")

    # --- 2. no reuse
    def run_no_reuse(self, m: dict, hard_s: float) -> None:
        s = self.sizes
        alone, withd = self.engines["R"], self.engines["P4"]
        d = self.daemons["D"]
        self.empty_daemon(d)
        n_half = self.nr_count(m, s)
        n_warm = self.nr_warm(s)
        hard_end = now() + hard_s
        seq = iter(range(10**9))
        seq_lock = threading.Lock()

        def prompt() -> list[int]:
            with seq_lock:
                i = next(seq)
            return rand_tokens(f"nr-{i}", s.nr_len, self.vocab)

        def closed_loop(e: EngineProc, n: int, bar: Progress | None) -> dict:
            todo = list(range(n))
            lock = threading.Lock()
            recs: list[dict] = []

            def worker() -> None:
                while True:
                    with lock:
                        if not todo or now() > hard_end:
                            return
                        todo.pop()
                    rep = complete(e, prompt(), s.answer, timeout=max(5.0, hard_end - now() + 5))
                    with lock:
                        recs.append(rec_of(rep, t_send=rep.t_send))
                    if bar:
                        bar.update()
            t0 = now()
            ts = [threading.Thread(target=worker, daemon=True) for _ in range(s.nr_conc)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(max(0.1, hard_end + 10 - now()))
            return {"recs": recs, "t0": t0, "t1": now()}

        closed_loop(alone, n_warm, None)
        closed_loop(withd, n_warm, None)
        d.settle(10)
        st0 = d.stats()
        mt0 = withd.metrics()
        bar = Progress(4 * n_half, "    no_reuse")
        halves = []
        for key, e in (("alone", alone), ("daemon", withd), ("daemon", withd), ("alone", alone)):
            if key == "alone":
                d.settle(10)  # the daemon's spills of the previous half must not run into the engine-alone half
            h = closed_loop(e, n_half, bar)
            halves.append((key, h))
        bar.close()
        out: dict[str, Any] = {"label": CONFIGS["no_reuse"][0], "prompt_tokens": s.nr_len, "max_tokens": s.answer,
                               "concurrency": s.nr_conc, "requests_per_half": n_half, "warmup_per_engine": n_warm,
                               "order": [k for k, _ in halves]}
        for key in ("alone", "daemon"):
            recs = [r for k, h in halves if k == key for r in h["recs"]]
            dur = sum(h["t1"] - h["t0"] for k, h in halves if k == key)
            sm = summarize_requests(recs, dur)
            out[key] = {k: sm[k] for k in ("requests", "ok", "errors", "duration_s", "req_per_s", "total_tok_per_s",
                                           "prompt_tok_per_s", "output_tok_per_s", "ttft_p50_ms", "ttft_p90_ms",
                                           "reused_tokens", "kv_source")}
            out[key]["halves_req_per_s"] = [len([r for r in h["recs"] if r["ok"]]) / max(1e-6, h["t1"] - h["t0"])
                                            for k, h in halves if k == key]
        a_t, d_t = out["alone"]["total_tok_per_s"], out["daemon"]["total_tok_per_s"]
        out["throughput_ratio"] = d_t / a_t if a_t and d_t else None
        out["request_ratio"] = (out["daemon"]["req_per_s"] / out["alone"]["req_per_s"]
                                if out["alone"]["req_per_s"] and out["daemon"]["req_per_s"] else None)
        d.settle(3)
        out["daemon_counters"] = counter_delta(d.stats(), st0)
        out["engine_metrics"] = metrics_delta(withd.metrics(), mt0)
        self.results["no_reuse"] = out
        log(f"no_reuse: alone {fmt(a_t, 0)} tok/s, with daemon {fmt(d_t, 0)} tok/s, "
            f"ratio {fmt(out['throughput_ratio'], 3)}")

    # --- 3. four engines, one daemon
    def run_four(self, m: dict, hard_s: float) -> None:
        """One engine's load bandwidth, then four engines' aggregate, through daemon D (host tier hits).

        Per repetition: empty the daemon; flush every engine's GPU tier with the same prompts (so what any
        engine evicts later is already stored: a store hit, no new bytes during the timed phases); the writer
        computes set 4, then set 1 (set 1 alone is more than a GPU tier, so none of set 4 stays on the
        writer's GPU); the single engine, which never computed set 1, loads it; then all four load set 4 at
        once. Both sets fit the host tier. Bandwidth = blocks loaded (Admin.Stats delta) x block bytes / wall
        time from the first request sent to the last answer."""
        s = self.sizes
        keys = ["P0", "P2", "P4", "P8"]
        eng = {k: self.engines[k] for k in keys}
        writer, single = "P8", "P4"
        d = self.daemons["D"]
        hard_end = now() + hard_s
        errors: list[str] = []

        def timeout() -> float:
            return max(5.0, hard_end - now() + 5)

        def send_all(jobs: list[tuple[str, list[int]]], concurrent: bool, tag: str) -> dict:
            recs: list[dict] = []
            lock = threading.Lock()

            def one(k: str, p: list[int]) -> None:
                rep = complete(eng[k], p, 1, timeout())
                with lock:
                    recs.append(rec_of(rep, engine=k))
                    if not rep.ok:
                        errors.append(f"{tag}/{k}: {rep.error}")
            t0 = now()
            if concurrent:
                ts = [threading.Thread(target=one, args=j, daemon=True) for j in jobs]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join(max(0.1, hard_end + 10 - now()))
            else:
                for j in jobs:
                    one(*j)
            return {"recs": recs, "wall_s": now() - t0}

        def timed(jobs: list[tuple[str, list[int]]], tag: str) -> dict:
            st0 = d.stats()
            r = send_all(jobs, True, tag)
            c = counter_delta(d.stats(), st0)
            loaded = c["loads_host"] + c["loads_disk"]
            per_engine: dict[str, dict] = {}
            for rec in r["recs"]:
                pe = per_engine.setdefault(rec["engine"], {"requests": 0, "ok": 0, "gpu": 0, "host": 0, "disk": 0,
                                                           "ttft_ms": []})
                pe["requests"] += 1
                if rec["ok"]:
                    pe["ok"] += 1
                    for t in ("gpu", "host", "disk"):
                        pe[t] += rec["by_tier"].get(t, 0)
                    pe["ttft_ms"].append(rec["ttft_ms"])
            lat = c["latencies"].get("load", {})
            lat_sum = (lat.get("mean_ms") or 0.0) * (lat.get("count") or 0) / 1e3
            return {"wall_s": r["wall_s"], "blocks_loaded": loaded, "loads_host": c["loads_host"],
                    "loads_disk": c["loads_disk"], "load_misses": c["load_misses"], "stores_new": c["stores"],
                    "bytes_loaded": loaded * s.block_bytes, "load_rpcs": lat.get("count"), "load_rpc_s": lat_sum,
                    "per_engine": per_engine, "errors": sum(1 for x in r["recs"] if not x["ok"])}

        reps = []
        n_reps = self.fe_reps()
        bar = Progress(4 * n_reps, "four_engines", unit="step")
        for rep in range(n_reps):
            if rep and now() > hard_end - 2:
                break
            self.empty_daemon(d)
            tag = f"fe{rep}"
            flush = [rand_tokens(f"{tag}-flush-{i}", s.fe_len, self.vocab) for i in range(s.fe_k)]
            set1 = [rand_tokens(f"{tag}-s1-{i}", s.fe_len, self.vocab) for i in range(s.fe_k)]
            set4 = [rand_tokens(f"{tag}-s4-{i}", s.fe_len, self.vocab) for i in range(s.fe_k)]
            ts = [threading.Thread(target=send_all, args=([(k, p) for p in flush], False, "flush"), daemon=True)
                  for k in keys]
            for t in ts:
                t.start()
            for t in ts:
                t.join(max(0.1, hard_end - now()))
            d.settle(30)
            bar.update()
            send_all([(writer, p) for p in set4 + set1], False, "populate")
            d.settle(30)
            bar.update()
            one = timed([(single, p) for p in set1], "single")
            bar.update()
            d.settle(10)
            four = timed([(k, p) for k in keys for p in set4], "four")
            bar.update()
            reps.append({"single": one, "four": four})
        bar.close()

        def total(ph: str) -> dict:
            ps = [r[ph] for r in reps]
            wall = sum(p["wall_s"] for p in ps)
            b = sum(p["bytes_loaded"] for p in ps)
            lat = sum(p["load_rpc_s"] for p in ps)
            per: dict[str, dict] = {}
            for p in ps:
                for k, v in p["per_engine"].items():
                    q = per.setdefault(k, {"requests": 0, "ok": 0, "gpu": 0, "host": 0, "disk": 0, "ttft_ms": []})
                    for f in ("requests", "ok", "gpu", "host", "disk"):
                        q[f] += v[f]
                    q["ttft_ms"] += v["ttft_ms"]
            for q in per.values():
                q["ttft_p50_ms"] = pct(q.pop("ttft_ms"), 50)
            return {"wall_s": wall, "bytes_loaded": b, "load_gbps": b / wall / 1e9 if wall > 0 and b else None,
                    "loads_host": sum(p["loads_host"] for p in ps), "loads_disk": sum(p["loads_disk"] for p in ps),
                    "stores_new": sum(p["stores_new"] for p in ps),
                    "load_rpcs": sum(p["load_rpcs"] or 0 for p in ps),
                    "load_rpc_mean_ms": lat / max(1, sum(p["load_rpcs"] or 0 for p in ps)) * 1e3,
                    "per_rpc_gbps": b / lat / 1e9 if lat > 0 and b else None,
                    "rpcs_in_flight": lat / wall if wall > 0 else None,
                    "per_rep_gbps": [p["bytes_loaded"] / p["wall_s"] / 1e9 if p["wall_s"] > 0 else None for p in ps],
                    "per_engine": per, "errors": sum(p["errors"] for p in ps)}

        phases = {"single": total("single"), "four": total("four")} if reps else {}
        one_bw = phases.get("single", {}).get("load_gbps")
        four_bw = phases.get("four", {}).get("load_gbps")
        pe = phases.get("four", {}).get("per_engine", {})
        cross = sum(v["host"] + v["disk"] for k, v in pe.items() if k != writer)
        total_loaded = sum(v["host"] + v["disk"] for v in pe.values())
        out = {"label": CONFIGS["four_engines"][0], "engines": keys, "writer": writer, "single_engine": single,
               "repetitions": len(reps), "context_tokens": s.fe_len, "contexts_per_set": s.fe_k,
               "set_bytes": s.fe_k * (s.fe_len // TPB) * s.block_bytes, "block_bytes": s.block_bytes,
               "phases": phases, "reps": reps, "one_engine_gbps": one_bw, "four_engines_gbps": four_bw,
               "bandwidth_ratio": four_bw / one_bw if one_bw and four_bw else None,
               "cross_engine_tokens": cross, "loaded_tokens": total_loaded,
               "cross_engine_fraction": cross / total_loaded if total_loaded else None,
               "errors": errors[:10], "error_count": len(errors)}
        self.results["four_engines"] = out
        log(f"four_engines: one engine {fmt(one_bw, 2)} GB/s, four {fmt(four_bw, 2)} GB/s, "
            f"ratio {fmt(out['bandwidth_ratio'], 3)}, cross-engine tokens {cross}")

    # --- targets
    def targets(self) -> list[dict]:
        return compute_targets(self.results)


# ----------------------------------------------------------------------------------------------
# Targets and Markdown (pure functions of the results dict, so results.md can be rebuilt)


def disk_regime_keys(res0: dict) -> set[tuple[int, int]]:
    """(user, round) of requests that needed the disk tier in the prefetch-0 run: disk hits, or less reused
    than was stored before (the rest of the prefix was on disk and recomputed, or lost)."""
    keys = set()
    for r in res0.get("requests_detail", []):
        if not r["ok"] or r["round"] == 0:
            continue
        reused = sum(r["by_tier"].get(t, 0) for t in ("gpu", "host", "disk"))
        if r["by_tier"].get("disk", 0) > 0 or reused + TPB < r["reusable_tokens"]:
            keys.add((r["user"], r["round"]))
    return keys


def disk_regime_p50(res: dict, keys: set[tuple[int, int]]) -> tuple[float | None, int]:
    xs = [r["ttft_ms"] for r in res.get("requests_detail", []) if r["ok"] and (r["user"], r["round"]) in keys]
    return pct(xs, 50), len(xs)


def compute_targets(results: dict) -> list[dict]:
    cfg = results.get("configs", {})
    out = []

    def add(figure: str, target: str, measured: str, value: float | None, ok: bool | None, note: str = "") -> None:
        verdict = "n/a" if ok is None else ("PASS" if ok else "MISS")
        out.append({"figure": figure, "target": target, "measured": measured, "value": value, "verdict": verdict,
                    "note": note})

    rc, p4, p0 = cfg.get("recompute"), cfg.get("hd_p4"), cfg.get("hd_p0")
    if rc and p4 and rc.get("ttft_p50_ms") and p4.get("ttft_p50_ms"):
        v = rc["ttft_p50_ms"] / p4["ttft_p50_ms"]
        add("multi-round QA: p50 TTFT, recompute-only / host+disk N=4", ">= 5x",
            f"{rc['ttft_p50_ms']:.1f} ms / {p4['ttft_p50_ms']:.1f} ms", v, v >= 5.0)
    else:
        add("multi-round QA: p50 TTFT, recompute-only / host+disk N=4", ">= 5x", "not measured", None, None)
    if p0 and p4:
        keys = disk_regime_keys(p0)
        a, na = disk_regime_p50(p0, keys)
        b, nb = disk_regime_p50(p4, keys)
        if a and b:
            v = 1.0 - b / a
            add("prefetch N=4 vs N=0: p50 TTFT of disk-tier requests", ">= 25% lower",
                f"{b:.1f} ms vs {a:.1f} ms ({na} requests)", v, v >= 0.25,
                "disk-tier requests: (user, round) pairs that in the N=0 run had disk hits or reused less than was "
                "stored before them")
        else:
            add("prefetch N=4 vs N=0: p50 TTFT of disk-tier requests", ">= 25% lower",
                f"no disk-tier requests in the N=0 run ({len(keys)})", None, None)
    else:
        add("prefetch N=4 vs N=0: p50 TTFT of disk-tier requests", ">= 25% lower", "not measured", None, None)
    nr = results.get("no_reuse")
    if nr and nr.get("throughput_ratio"):
        v = nr["throughput_ratio"]
        add("no reuse: token throughput with daemon / engine alone", ">= 0.97",
            f"{nr['daemon']['total_tok_per_s']:.0f} / {nr['alone']['total_tok_per_s']:.0f} tok/s", v, v >= 0.97)
    else:
        add("no reuse: token throughput with daemon / engine alone", ">= 0.97", "not measured", None, None)
    fe = results.get("four_engines")
    if fe and fe.get("bandwidth_ratio"):
        v = fe["bandwidth_ratio"]
        add("four engines: aggregate load bandwidth / one engine's", ">= 0.9",
            f"{fe['four_engines_gbps']:.2f} / {fe['one_engine_gbps']:.2f} GB/s", v, v >= 0.9)
    else:
        add("four engines: aggregate load bandwidth / one engine's", ">= 0.9", "not measured", None, None)
    return out


def lower(v: float) -> str:
    return f"{v * 100:.0f}% lower" if v >= 0 else f"{-v * 100:.0f}% higher"


def render_md(results: dict) -> str:
    meta, plan, sizes = results.get("meta", {}), results.get("plan", {}), results.get("sizes", {})
    L: list[str] = []
    L.append("# kvservice end-to-end benchmark (bench/e2e_multiround.py)\n")
    L.append(f"- Command: `{meta.get('command', '')}`")
    L.append(f"- Date: {meta.get('date', '-')}; commit {meta.get('commit', '-')}; elapsed {fmt(results.get('elapsed_s'), 0)} s")
    L.append(f"- Hardware: GPU {meta.get('gpu', '-')}; CPU {meta.get('cpu', '-')} x {meta.get('nproc', '-')}; "
             f"memory {meta.get('memory', '-')}")
    L.append(f"- Software: Python {meta.get('python', '-')}, torch {meta.get('torch', '-')}, "
             f"kvikio {meta.get('kvikio', '-')}, grpcio {meta.get('grpcio', '-')}; {meta.get('platform', '-')}")
    st = results.get("startup", {})
    io = st.get("daemon_D", st.get("daemon_H", {})).get("io_backend", "-")
    cache = ("disk tier kept out of the page cache (--cold-disk)" if meta.get("args", {}).get("cold_disk") else
             "disk tier reads through the OS page cache")
    if sizes:
        bb = sizes["block_bytes"]
        L.append(f"- Model `{sizes['model']}` ({sizes['dtype_bytes'] * 8}-bit KV), {TPB}-token blocks of "
                 f"{hb(bb)}; GPU tier {sizes['gpu_blocks']} blocks ({hb(sizes['gpu_blocks'] * bb)}) per engine; host "
                 f"tier {sizes['host_blocks']} blocks ({hb(sizes['host_blocks'] * bb)}); disk tier "
                 f"{hb(sizes['disk_blocks'] * bb)}; daemon I/O backend `{io}`, {cache}")
    if plan:
        L.append(f"- Multi-round workload: U={plan.get('users')} users x R={plan.get('rounds')} rounds; system prompt "
                 f"{sizes.get('sys_len')} tokens (shared), user context {sizes.get('ctx_len')}, question "
                 f"{sizes.get('q_len')}, answer {sizes.get('answer')} tokens; prompts up to "
                 f"{plan.get('max_prompt_tokens')} tokens; arrivals at {fmt(plan.get('rate_req_per_s'), 2)} req/s "
                 f"(user u's round r due at (r*U + u) / rate) = {plan.get('load_factor')} / the recompute-only "
                 f"runner's estimated service time in the last round "
                 f"({fmt((plan.get('recompute_last_round_service_s') or 0) * 1e3, 0)} ms; mean over rounds "
                 f"{fmt((plan.get('recompute_mean_service_s') or 0) * 1e3, 0)} ms); working set "
                 f"{plan.get('working_set_blocks')} blocks = {fmt(plan.get('working_set_over_gpu_host'), 2)} x "
                 f"(GPU + host tier)")
        L.append(f"- Start-up: daemons {fmt(st.get('daemons_s'), 1)} s, engines {fmt(st.get('engines_s'), 1)} s "
                 f"(all at once); selected: {', '.join(plan.get('selected', []))}")
        cal = results.get("calibration", {})
        if cal.get("service"):
            L.append("- Calibration (recompute-only runner alone, system prompt cached; new prompt tokens: TTFT / "
                     "total ms): " + ", ".join(f"{x}: {f * 1e3:.0f} / {t * 1e3:.0f}"
                                               for (x, t), (_, f) in zip(cal["service"], cal["ttft"])))
    for sk in results.get("skipped", []):
        L.append(f"- Skipped `{sk['config']}`: {sk['reason']}")
    if results.get("error"):
        L.append(f"- **Stopped early:** {results['error']} (runner and daemon logs: logs/ beside this file)")
    L.append("")

    L.append("## Targets (DESIGN §7)\n")
    L.append("| figure | target | measured | ratio | verdict |")
    L.append("| --- | --- | --- | ---: | --- |")
    for t in results.get("targets", []) or compute_targets(results):
        v = t["value"]
        vs = "-" if v is None else (f"{v:.2f}x" if "x" in t["target"] and "%" not in t["target"] else
                                    (lower(v) if "%" in t["target"] else f"{v:.3f}"))
        L.append(f"| {t['figure']} | {t['target']} | {t['measured']} | {vs} | {t['verdict']} |")
    L.append("")

    cfg = results.get("configs", {})
    if cfg:
        rc = cfg.get("recompute", {}).get("ttft_p50_ms")
        L.append("## Multi-round QA\n")
        L.append("TTFT is measured by the client: request sent -> first streamed token. Throughput over the span "
                 "from the first arrival to the last answer. Reused tokens: prompt tokens not computed, by the tier "
                 "they came from. Recovery rate, drops and daemon errors are deltas of Admin.Stats over the run.\n")
        L.append("| configuration | ok / sent | p50 TTFT ms | p90 TTFT ms | p50 rounds>=1 | recompute p50 / p50 | req/s | "
                 "prompt tok/s | output tok/s | reused gpu / host / disk tokens | reused % | recovery rate | "
                 "dropped blocks | errors (HTTP / daemon) |")
        L.append("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- |")
        for name in [c for c in RUN_ORDER if c in cfg]:
            r = cfg[name]
            rt = r["reused_tokens"]
            speed = rc / r["ttft_p50_ms"] if rc and r.get("ttft_p50_ms") else None
            trunc = " (truncated)" if r.get("truncated") else ""
            L.append(f"| {r['label']}{trunc} | {r['ok']} / {r['requests']} | {fmt(r['ttft_p50_ms'])} | "
                     f"{fmt(r['ttft_p90_ms'])} | {fmt(r['ttft_p50_rounds1plus_ms'])} | {fmt(speed, 2)} | "
                     f"{fmt(r['req_per_s'], 2)} | {fmt(r['prompt_tok_per_s'], 0)} | {fmt(r['output_tok_per_s'], 1)} | "
                     f"{rt['gpu']} / {rt['host']} / {rt['disk']} | {fmt((r['reused_fraction'] or 0) * 100, 1)} | "
                     f"{fmt(r['recovery_rate'], 3)} | {fmt(r['dropped_blocks'])} | {r['errors']} / "
                     f"{fmt(r['daemon_errors'])} |")
        L.append("")
        L.append("Where the prompt KV came from (kv_source counts), the daemon's side and the engine's estimates:\n")
        L.append("| configuration | kv_source | engine-side p50 TTFT ms | late arrivals | daemon loads host / disk | "
                 "spills / onboards | prefetch staged / used / wasted | daemon Load RPC mean ms | "
                 "engine est. load GB/s host / disk | engine est. prefill tok/s | load decisions load / recompute |")
        L.append("| --- | --- | ---: | ---: | --- | --- | --- | ---: | --- | ---: | --- |")
        for name in [c for c in RUN_ORDER if c in cfg]:
            r = cfg[name]
            em = r.get("engine_metrics", {})
            dd = r.get("daemon") or {}
            src = ", ".join(f"{k}: {v}" for k, v in sorted(r["kv_source"].items()))
            bwh = em.get('model_runner_load_bandwidth_bytes_per_second{tier="host"}')
            bwd = em.get('model_runner_load_bandwidth_bytes_per_second{tier="disk"}')
            pf = em.get("model_runner_prefill_tokens_per_second")
            dl = em.get('model_runner_load_decisions_total{decision="load"}', 0)
            dr = em.get('model_runner_load_decisions_total{decision="recompute"}', 0)
            lat = (dd.get("latencies") or {}).get("load", {}).get("mean_ms")
            if dd:
                dcols = (f"{dd['loads_host']} / {dd['loads_disk']} | {dd['spills']} / {dd['disk_onboards']} | "
                         f"{dd['prefetch_staged']} / {dd['prefetch_used']} / {dd['prefetch_wasted']} | {fmt(lat, 1)}")
            else:
                dcols = "- | - | - | -"
            L.append(f"| {r['label']} | {src} | {fmt(r.get('engine_ttft_p50_ms'))} | {r['late_requests']} | {dcols} | "
                     f"{fmt(bwh / 1e9 if bwh else None, 2)} / {fmt(bwd / 1e9 if bwd else None, 2)} | {fmt(pf, 0)} | "
                     f"{int(dl)} / {int(dr)} |")
        L.append("")
        names = [c for c in RUN_ORDER if c in cfg]
        rounds = max((r["round"] for c in names for r in cfg[c].get("requests_detail", [])), default=-1) + 1
        if rounds:
            L.append("p50 TTFT (ms) by round; prompts grow every round, and the later rounds no longer fit GPU + host:\n")
            L.append("| configuration | " + " | ".join(f"r{i}" for i in range(rounds)) + " |")
            L.append("| --- | " + " | ".join("---:" for _ in range(rounds)) + " |")
            for c in names:
                det = cfg[c].get("requests_detail", [])
                row = [fmt(pct([r["ttft_ms"] for r in det if r["ok"] and r["round"] == i], 50), 0) for i in range(rounds)]
                L.append(f"| {cfg[c]['label']} | " + " | ".join(row) + " |")
            lens = sorted({(r["round"], r["prompt_tokens"]) for c in names[:1] for r in cfg[c].get("requests_detail", [])
                           if r["ok"]})
            if lens:
                by_round: dict[int, list[int]] = {}
                for rr, n in lens:
                    by_round.setdefault(rr, []).append(n)
                L.append("| prompt tokens (mean) | " + " | ".join(
                    str(round(statistics.fmean(by_round[i]))) if i in by_round else "-" for i in range(rounds)) + " |")
            L.append("")
            L.append("TTFT by where the prompt's KV came from (p50 ms, requests):\n")
            L.append("| configuration | " + " | ".join(KV_SOURCES) + " |")
            L.append("| --- | " + " | ".join("---" for _ in KV_SOURCES) + " |")
            for c in names:
                det = [r for r in cfg[c].get("requests_detail", []) if r["ok"]]
                cells = []
                for src in KV_SOURCES:
                    xs = [r["ttft_ms"] for r in det if r["kv_source"] == src]
                    cells.append(f"{fmt(pct(xs, 50), 0)} ({len(xs)})" if xs else "-")
                L.append(f"| {cfg[c]['label']} | " + " | ".join(cells) + " |")
            L.append("")
        sweep = [(n, cfg[c]) for n, c in sorted(PREFETCH_CONFIGS.items()) if c in cfg]
        if sweep:
            keys = disk_regime_keys(cfg["hd_p0"]) if "hd_p0" in cfg else set()
            L.append("### Prefetch sweep (host + disk)\n")
            L.append(f"Disk-tier requests: {len(keys)} (user, round) pairs that in the N=0 run had disk hits or reused "
                     "less than was stored before them; the same pairs in every run.\n")
            L.append("| prefetch N | p50 TTFT ms | p90 TTFT ms | p50 TTFT disk-tier requests ms | vs N=0 | "
                     "recovery rate | prefetch staged / used / wasted |")
            L.append("| ---: | ---: | ---: | ---: | ---: | ---: | --- |")
            base = disk_regime_p50(cfg["hd_p0"], keys)[0] if "hd_p0" in cfg else None
            for n, r in sweep:
                p, cnt = disk_regime_p50(r, keys)
                dd = r.get("daemon") or {}
                vs = lower(1 - p / base) if p and base else "-"
                L.append(f"| {n} | {fmt(r['ttft_p50_ms'])} | {fmt(r['ttft_p90_ms'])} | {fmt(p)} ({cnt}) | {vs} | "
                         f"{fmt(r['recovery_rate'], 3)} | {dd.get('prefetch_staged', '-')} / "
                         f"{dd.get('prefetch_used', '-')} / {dd.get('prefetch_wasted', '-')} |")
            L.append("")

    nr = results.get("no_reuse")
    if nr:
        L.append("## No reuse\n")
        L.append(f"Unique prompts of {nr['prompt_tokens']} tokens, {nr['max_tokens']} output tokens, "
                 f"{nr['concurrency']} clients in a closed loop; {nr['requests_per_half']} requests per half, halves "
                 f"in the order {' / '.join(nr['order'])} after {nr['warmup_per_engine']} warm-up requests per engine. "
                 "With the daemon every prefill is written through to it (host + disk tier).\n")
        L.append("| engine | requests ok | req/s (per half) | total tok/s | p50 TTFT ms | p90 TTFT ms |")
        L.append("| --- | ---: | --- | ---: | ---: | ---: |")
        for key, lab in (("alone", "engine alone"), ("daemon", "engine + daemon")):
            r = nr[key]
            halves = ", ".join(f"{x:.2f}" for x in r["halves_req_per_s"])
            L.append(f"| {lab} | {r['ok']} | {fmt(r['req_per_s'], 2)} ({halves}) | {fmt(r['total_tok_per_s'], 0)} | "
                     f"{fmt(r['ttft_p50_ms'])} | {fmt(r['ttft_p90_ms'])} |")
        dc = nr.get("daemon_counters", {})
        L.append(f"\nThroughput ratio {fmt(nr.get('throughput_ratio'), 3)} (tokens), {fmt(nr.get('request_ratio'), 3)} "
                 f"(requests). Daemon during the timed halves: {dc.get('stores', '-')} blocks stored, "
                 f"{dc.get('spills', '-')} spilled, Store RPC mean "
                 f"{fmt((dc.get('latencies') or {}).get('store', {}).get('mean_ms'), 1)} ms.\n")

    fe = results.get("four_engines")
    if fe and fe.get("phases"):
        L.append("## Four engines, one daemon\n")
        L.append(f"Engines {', '.join(fe['engines'])} (prefetch 0/2/4/8, one namespace) share daemon D. Per repetition "
                 f"({fe['repetitions']}): the daemon is emptied, every engine's GPU tier flushed with the same prompts, "
                 f"`{fe['writer']}` computes two sets of {fe['contexts_per_set']} contexts of {fe['context_tokens']} "
                 f"tokens ({hb(fe['set_bytes'])} of KV per set; both stay in the host tier), "
                 f"`{fe['single_engine']}`, which never computed set 1, loads it alone, then all four load set 2 at "
                 "once (each engine's requests sent together, max_tokens 1). Load bandwidth = blocks loaded "
                 "(Admin.Stats) x block bytes / wall time from the first request to the last answer, so it includes "
                 "each request's HTTP, admission and one-token forward; per-RPC = bytes / summed Load RPC latency "
                 "inside the daemon.\n")
        L.append("| phase | wall s | blocks loaded (host / disk) | bytes loaded | load GB/s (per repetition) | Load RPCs, "
                 "mean ms | per-RPC GB/s | RPCs in flight | per engine: loaded tokens, p50 TTFT ms | errors |")
        L.append("| --- | ---: | --- | ---: | --- | --- | ---: | ---: | --- | ---: |")
        for ph in ("single", "four"):
            p = fe["phases"].get(ph)
            if not p:
                continue
            per = "; ".join(f"{k}: {v['host'] + v['disk']}" + (f" (+{v['gpu']} GPU hits)" if v["gpu"] else "")
                            + f", {fmt(v['ttft_p50_ms'])}" for k, v in sorted(p["per_engine"].items()))
            reps = ", ".join(fmt(x, 2) for x in p["per_rep_gbps"])
            L.append(f"| {'one engine' if ph == 'single' else 'four engines'} | {fmt(p['wall_s'], 3)} | "
                     f"{p['loads_host']} / {p['loads_disk']} | {hb(p['bytes_loaded'])} | {fmt(p['load_gbps'], 2)} "
                     f"({reps}) | {p['load_rpcs']}, {fmt(p['load_rpc_mean_ms'], 1)} | {fmt(p['per_rpc_gbps'], 2)} | "
                     f"{fmt(p['rpcs_in_flight'], 2)} | {per} | {p['errors']} |")
        L.append(f"\nAggregate / one engine: {fmt(fe.get('bandwidth_ratio'), 3)}. Cross-engine reuse in the four-engine "
                 f"phase: {fe['cross_engine_tokens']} of {fe['loaded_tokens']} loaded tokens "
                 f"({fmt((fe.get('cross_engine_fraction') or 0) * 100, 1)}%) were stored by another engine process.\n")
    plots = [p for p in results.get("plots", []) if isinstance(p, str) and p.endswith(".png")]
    if plots:
        L.append("## Plots\n")
        for p in plots:
            L.append(f"![{p}]({p})")
        L.append("")
    return "\n".join(L) + "\n"


# ----------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="/tmp/kvservice-e2e", help="results.json, results.md, PNGs and logs go here")
    p.add_argument("--budget-seconds", type=float, default=330.0, help="wall time for everything, start-up included")
    p.add_argument("--model", default="8b", choices=sorted(PRESETS))
    p.add_argument("--device", default="cuda", help="cpu | cuda | cuda:N (every runner on this device)")
    p.add_argument("--dtype", default="", help="KV and weights dtype [bfloat16 on CUDA, float32 on CPU]")
    p.add_argument("--load-policy", default="auto", choices=["auto", "always", "never"],
                   help="model runners' --load-policy (daemon configurations)")
    p.add_argument("--load-factor", type=float, default=0.8,
                   help="arrival rate x the recompute-only runner's estimated service time in the last round")
    p.add_argument("--rate", type=float, default=0.0, help="fixed arrival rate, req/s (overrides --load-factor)")
    p.add_argument("--users", type=int, default=0, help="users before budget scaling [8]")
    p.add_argument("--rounds", type=int, default=0, help="rounds before budget scaling [8]")
    p.add_argument("--system-prompt", type=int, default=0, help="shared system prompt tokens [~0.24 x GPU tier tokens]")
    p.add_argument("--question-tokens", type=int, default=0, help="tokens per question [~0.073 x GPU tier tokens]")
    p.add_argument("--answer-tokens", type=int, default=0, help="max_tokens per answer [8; tiny: 4]")
    p.add_argument("--gpu-blocks", type=int, default=0, help="GPU-tier blocks per runner [512; tiny: 128]")
    p.add_argument("--host-capacity", type=int, default=0, help="host tier bytes [3 x the GPU tier]")
    p.add_argument("--disk-capacity", type=int, default=0, help="disk tier bytes [16 x the GPU tier]")
    p.add_argument("--io-backend", default="auto", help="daemons' --io-backend")
    p.add_argument("--cold-disk", action=argparse.BooleanOptionalAction, default=True,
                   help="keep the disk tier's block files out of the page cache (posix_fadvise DONTNEED twice a "
                        "second), as for a disk tier much larger than RAM, so that disk hits read the device; "
                        "--no-cold-disk: the OS page cache as it comes (this host's RAM holds the whole disk tier)")
    p.add_argument("--configs", default="", help=f"comma list, subset of {','.join(IMPORTANCE)} [all]")
    p.add_argument("--workdir", default="", help="sockets and disk tier [fresh /tmp/kve2e-*, removed at the end]")
    p.add_argument("--engine-start-timeout", type=float, default=150.0)
    p.add_argument("--engine-alloc-conf", default="expandable_segments:True",
                   help="PYTORCH_CUDA_ALLOC_CONF of the CUDA runners (six 8B runners share one GPU: keep each one's "
                        "cached attention buffers from fragmenting); empty: inherit")
    p.add_argument("--reserve-seconds", type=float, default=0.0,
                   help="budget kept for shutdown and plots [12 on CUDA, 5 on CPU]")
    a = p.parse_args(argv)
    if not a.dtype:
        a.dtype = "float32" if a.device == "cpu" else "bfloat16"
    if not a.reserve_seconds:
        a.reserve_seconds = 5.0 if a.device == "cpu" else 12.0
    if a.configs:
        bad = set(a.configs.split(",")) - set(IMPORTANCE)
        if bad:
            p.error(f"unknown configs {sorted(bad)}")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = Bench(args)

    def on_signal(signum: int, _frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one is enough: let the clean-up below finish
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    rc = 0
    try:
        bench.run()
    except KeyboardInterrupt as e:
        log(f"interrupted ({e}); partial results are in {bench.out}")
        bench.results["error"] = f"interrupted ({e or 'Ctrl-C'})"
        rc = 130
    except Exception as e:  # noqa: BLE001
        log(f"failed: {type(e).__name__}: {e}")
        bench.results["error"] = f"{type(e).__name__}: {e}"
        rc = 1
    finally:
        try:
            bench.save()
        except Exception as e:  # noqa: BLE001
            log(f"could not write results: {e}")
        bench.children.stop_all(timeout=8.0)
        if not args.workdir:
            shutil.rmtree(bench.workdir, ignore_errors=True)
    md = (bench.out / "results.md")
    if md.exists():
        print(md.read_text())
    log(f"done in {now() - bench.t0:.0f}s; results in {bench.out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
