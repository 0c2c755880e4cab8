"""The runs of the end-to-end benchmark, each a function of a Context (processes, sizes, results).

- run_multiround: the multi-round QA workload (workload.py) against one engine, arrivals at a fixed
  rate; per request: client TTFT, where the prompt's KV came from; the daemon's counters over the run.
- run_no_reuse: unique prompts in a closed loop, the engine alone against the engine with the service
  (every prefill written through); halves in the order alone, service, service, alone.
- run_lmbenchmark: LMBenchmark's own multi-round-qa.py, unmodified, against an engine (completions or
  chat mode); its CSV summarised.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e2e.client import complete
from e2e.configs import CONFIGS, ENGINES, TierSetting
from e2e.report import counter_delta, metrics_delta, pct, stats_dict, summarize_requests
from e2e.workload import TPB, Conversations, Shape, due, rand_tokens


def log(msg: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Context:
    args: Any
    shape: Shape
    settings: dict[str, TierSetting]
    vocab: int
    out: Path
    daemons: dict[str, Any] = field(default_factory=dict)  # harness.daemon.Daemon by key
    engines: dict[str, Any] = field(default_factory=dict)  # harness.runner.ModelRunner by key
    rate: float = 1.0  # arrivals per second (x Config.rate_factor)
    results: dict = field(default_factory=dict)


def engine_metrics(engine: Any) -> dict[str, float]:
    try:
        status, _, body = engine.request("GET", "/metrics", timeout=10)
    except Exception:  # noqa: BLE001
        return {}
    out: dict[str, float] = {}
    for line in body.decode(errors="replace").splitlines():
        if line and not line.startswith("#"):
            try:
                name, val = line.rsplit(" ", 1)
                out[name] = float(val)
            except ValueError:
                pass
    return out


def empty_daemon(d: Any) -> None:
    """Admin.Evict all once the disk queues are idle: every configuration starts from empty tiers."""
    d.settle(30)
    d.evict_all()


def run_multiround(ctx: Context, name: str) -> dict:
    cfg = CONFIGS[name]
    e = ctx.engines[cfg.engines[0]]
    d = ctx.daemons.get(cfg.daemon) if cfg.daemon else None
    s = ctx.shape
    if d is not None:
        empty_daemon(d)
    st0 = stats_dict(d.stats()) if d is not None else None
    mt0 = engine_metrics(e)
    conv = Conversations.make(name, s, ctx.vocab)
    rate = ctx.rate * cfg.rate_factor
    rate0 = rate * (ctx.args.disk_round0_rate_factor if cfg.setting == "disk" else 1.0)
    seed = 14 if cfg.setting == "disk" and ctx.args.disk_arrivals == "poisson" else None
    t_start = time.monotonic() + 0.3
    hard_end = t_start + ctx.args.config_timeout
    recs: list[dict] = []
    lock = threading.Lock()

    def user(u: int) -> None:
        hist = conv.system + conv.history[u]
        prev_len = 0
        for r in range(s.rounds):
            wait = t_start + due(u, r, s.users, rate, rate0, seed) - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            if time.monotonic() > hard_end:
                with lock:
                    recs.append({"user": u, "round": r, "ok": False, "unsent": True, "error": "not sent: time limit"})
                continue
            prompt = hist + conv.questions[u][r]
            late = max(0.0, time.monotonic() - (t_start + due(u, r, s.users, rate, rate0, seed))) * 1e3
            rep = complete(e.url, prompt, s.answer, timeout=max(5.0, hard_end - time.monotonic() + 30))
            # What the previous round left cached: its prompt and answer but the last answer token (no KV).
            usable = (len(prompt) - 1) // TPB * TPB
            reusable = min(usable, (prev_len - 1) // TPB * TPB) if r else s.sys_len // TPB * TPB
            with lock:
                recs.append(rep.record(user=u, round=r, late_ms=late, reusable_tokens=reusable,
                                       t_send_s=rep.t_send - t_start))
            hist = prompt + rep.output_ids
            prev_len = len(hist)

    threads = [threading.Thread(target=user, args=(u,), daemon=True) for u in range(s.users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.1, hard_end + 60 - time.monotonic()))
    sent = [r for r in recs if not r.get("unsent")]
    done = [r for r in sent if r["ok"]]
    last = max((t_start + r["t_send_s"] + r["total_ms"] / 1e3 for r in done), default=time.monotonic())
    res = {"label": cfg.label, "engine": cfg.engines[0], "prefetch": ENGINES[cfg.engines[0]].prefetch,
           "setting": cfg.setting, "rate_req_per_s": rate, "round0_rate_req_per_s": rate0,
           "arrivals": "uniform" if seed is None else f"poisson (seed {seed})",
           "users": s.users, "rounds": s.rounds,
           **summarize_requests(sent, max(1e-6, last - t_start)),
           "unsent": len(recs) - len(sent),
           "first_error": next((r["error"] for r in sent if not r["ok"]), ""),
           "requests_detail": sorted(recs, key=lambda r: (r["round"], r["user"])),
           "engine_metrics": metrics_delta(engine_metrics(e), mt0)}
    if d is not None:
        st1 = stats_dict(d.settle(5))
        dd = counter_delta(st1, st0)
        res.update(daemon=dd, daemon_tiers_end=st1["tiers"], recovery_rate=dd.get("recovery_rate"),
                   daemon_errors=dd.get("load_failures", 0) + dd.get("checksum_failures", 0) + dd.get("io_errors", 0))
    log(f"{name}: {res['ok']}/{res['requests']} ok, p50 TTFT {res['ttft_p50_ms'] or 0:.1f} ms, "
        f"p90 {res['ttft_p90_ms'] or 0:.1f} ms, reused {res['reused_tokens']}, kv_source {res['kv_source']}")
    return res


def calibrate(ctx: Context) -> dict:
    """The recompute-only engine's service time (prefill + answer) for a last-round prompt, best of two,
    after a warm-up request per engine (which also seeds each engine's prefill-speed estimate)."""
    s = ctx.shape
    n = s.prompt_len(s.rounds - 1)
    threads = [threading.Thread(target=complete, args=(e.url, rand_tokens(f"warm-{k}", n, ctx.vocab), s.answer, 600),
                                daemon=True) for k, e in ctx.engines.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    times = []
    for i in range(2):
        rep = complete(ctx.engines["R"].url, rand_tokens(f"cal-{i}", n, ctx.vocab), s.answer, 600)
        if not rep.ok:
            raise RuntimeError(f"calibration request failed: {rep.error}")
        times.append((rep.total_ms / 1e3, rep.ttft_ms / 1e3))
    service, ttft = min(times)
    return {"prompt_tokens": n, "service_s": service, "ttft_s": ttft}


def run_no_reuse(ctx: Context) -> dict:
    cfg = CONFIGS["no_reuse"]
    alone, withd = (ctx.engines[k] for k in cfg.engines)
    d = ctx.daemons[cfg.daemon]
    s = ctx.shape
    n_len = ctx.args.no_reuse_tokens
    seq = iter(range(10**9))
    lock = threading.Lock()

    def closed_loop(e: Any, n: int) -> dict:
        recs: list[dict] = []
        todo = [n]

        def worker() -> None:
            while True:
                with lock:
                    if todo[0] <= 0:
                        return
                    todo[0] -= 1
                    i = next(seq)
                prompt = rand_tokens(f"nr-{i}", n_len, ctx.vocab)
                t_send = time.monotonic()
                rep = complete(e.url, prompt, s.answer, 600)
                with lock:
                    recs.append(rep.record(t_send=t_send - t0))
        t0 = time.monotonic()
        ts = [threading.Thread(target=worker, daemon=True) for _ in range(ctx.args.no_reuse_clients)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(900)
        return {"recs": recs, "t0": t0, "t1": time.monotonic()}

    empty_daemon(d)
    # Warm-up: enough requests to fill each engine's GPU tier, so that the timed halves run with a full
    # tier (evictions, offloads) as a long-running engine does.
    gpu_tokens = ctx.settings[cfg.setting].gpu_blocks * TPB
    n_warm = ctx.args.no_reuse_warmup or max(2 * ctx.args.no_reuse_clients, gpu_tokens // n_len + 2)
    warm = closed_loop(alone, n_warm)
    closed_loop(withd, n_warm)
    per_req = (warm["t1"] - warm["t0"]) / max(1, len(warm["recs"]))
    n_half = max(2 * ctx.args.no_reuse_clients, int(ctx.args.no_reuse_half_seconds / max(per_req, 1e-3)))
    d.settle(30)
    st0 = stats_dict(d.stats())
    mt0 = {key: engine_metrics(e) for key, e in (("alone", alone), ("service", withd))}
    halves = []
    order = [("alone", alone), ("service", withd), ("service", withd), ("alone", alone)] * ctx.args.no_reuse_cycles
    for key, e in order:
        if key == "alone":
            d.settle(30)  # the service's spills of the previous half do not run into the engine-alone half
        halves.append((key, closed_loop(e, n_half)))
    out: dict[str, Any] = {"label": cfg.label, "prompt_tokens": n_len, "max_tokens": s.answer,
                           "clients": ctx.args.no_reuse_clients, "requests_per_half": n_half,
                           "order": [k for k, _ in halves]}
    for key in ("alone", "service"):
        recs = [r for k, h in halves if k == key for r in h["recs"]]
        dur = sum(h["t1"] - h["t0"] for k, h in halves if k == key)
        sm = summarize_requests(recs, dur)
        out[key] = {k: sm[k] for k in ("requests", "ok", "errors", "duration_s", "req_per_s", "total_tok_per_s",
                                       "prompt_tok_per_s", "ttft_p50_ms", "ttft_p90_ms", "kv_source")}
        out[key]["halves_req_per_s"] = [sum(1 for r in h["recs"] if r["ok"]) / max(1e-6, h["t1"] - h["t0"])
                                        for k, h in halves if k == key]
        out[key]["engine_metrics"] = metrics_delta(engine_metrics(alone if key == "alone" else withd), mt0[key])
    # every request of every half, in order: where a gap between the engines comes from
    out["requests"] = [{"half": i, "engine": k, **r} for i, (k, h) in enumerate(halves) for r in h["recs"]]
    a, b = out["alone"]["total_tok_per_s"], out["service"]["total_tok_per_s"]
    out["throughput_ratio"] = b / a if a and b else None
    out["daemon"] = counter_delta(stats_dict(d.settle(5)), st0)
    out["engine_metrics"] = out["service"]["engine_metrics"]
    if ctx.args.miss_probe:
        out["miss_probe"] = miss_probe(ctx, alone, withd, d, ctx.args.miss_probe)
    log(f"no_reuse: alone {a or 0:.0f} tok/s, with the service {b or 0:.0f} tok/s, ratio {out['throughput_ratio']}")
    return out


def miss_probe(ctx: Context, alone: Any, withd: Any, d: Any, n: int) -> dict:
    """Round-0 requests one at a time: unique prompts of the multi-round workload's round-0 length (pure
    misses: nothing to reuse, every prefill written through), the two engines alternating request by
    request (alone first on even i, service first on odd), nothing else running. The daemon is idle
    before every engine-alone request (its spills of the service's previous prefill do not slow the
    engine alone); a service request pays whatever its own daemon is still doing. TTFT here is the
    price a miss pays for the service, without the closed loop's queueing (which makes TTFT bimodal)."""
    s = ctx.shape
    n_len = s.prompt_len(0)
    recs: dict[str, list[dict]] = {"alone": [], "service": []}
    pair = (("alone", alone), ("service", withd))
    for i in range(n):
        for key, e in (pair if i % 2 == 0 else pair[::-1]):
            if key == "alone":
                d.settle(30)
            rep = complete(e.url, rand_tokens(f"probe-{i}-{key}", n_len, ctx.vocab), s.answer, 600)
            recs[key].append(rep.record(i=i))
    out: dict[str, Any] = {"prompt_tokens": n_len, "requests_each": n}
    for key, rs in recs.items():
        ok = [r for r in rs if r["ok"]]
        out[key] = {"ok": len(ok), "errors": len(rs) - len(ok), "ttft_p50_ms": pct([r["ttft_ms"] for r in ok], 50),
                    "engine_ttft_p50_ms": pct([r["engine_ttft_ms"] for r in ok], 50), "requests": rs}
    a, b = out["alone"]["ttft_p50_ms"], out["service"]["ttft_p50_ms"]
    out["ttft_ratio"] = b / a if a and b else None
    log(f"miss probe: p50 TTFT alone {a or 0:.1f} ms, with the service {b or 0:.1f} ms, ratio {out['ttft_ratio']}")
    return out


def run_lmbenchmark(ctx: Context, name: str) -> dict:
    """LMBenchmark's synthetic multi-round-qa.py as its authors run it (long input, short output), scaled
    down; USE_CHAT_COMPLETIONS picks its chat mode. Needs --lmbenchmark DIR (a copy of its
    synthetic-multi-round-qa folder) and pandas + openai where it runs."""
    cfg = CONFIGS[name]
    e = ctx.engines[cfg.engines[0]]
    a = ctx.args
    csv_path = ctx.out / f"{name}.csv"
    argv = [sys.executable, str(Path(a.lmbenchmark).resolve() / "multi-round-qa.py"),
            "--num-users", str(a.lmb_users), "--num-rounds", str(a.lmb_rounds), "--qps", str(a.lmb_qps),
            "--shared-system-prompt", str(a.lmb_system_prompt), "--user-history-prompt", str(a.lmb_history),
            "--answer-len", str(a.lmb_answer), "--model", a.served_name, "--base-url", e.url,
            "--time", str(a.lmb_seconds), "--output", str(csv_path), "--log-interval", "1000"]
    env = {**os.environ, "USE_CHAT_COMPLETIONS": "True" if name.endswith("chat") else "False"}
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=str(Path(a.lmbenchmark)),
                          timeout=a.lmb_seconds + 240)
    (ctx.out / f"{name}.log").write_text(proc.stdout + "\n--- stderr\n" + proc.stderr)
    rows = list(csv.DictReader(csv_path.open())) if csv_path.exists() else []
    ttft = [float(r["ttft"]) * 1e3 for r in rows]
    errors = sum(1 for line in proc.stderr.splitlines() if "Error in _async_launch_request" in line)
    res = {"label": cfg.label, "argv": argv, "returncode": proc.returncode, "wall_s": time.monotonic() - t0,
           "requests": len(rows), "errors_logged": errors, "zero_ttft": sum(1 for x in ttft if x <= 0),
           "ttft_p50_ms": pct(ttft, 50), "ttft_p90_ms": pct(ttft, 90),
           "prompt_tokens_mean": (sum(float(r["prompt_tokens"]) for r in rows) / len(rows)) if rows else None,
           "generation_tokens_mean": (sum(float(r["generation_tokens"]) for r in rows) / len(rows)) if rows else None,
           "stdout_tail": proc.stdout[-1500:]}
    log(f"{name}: rc {proc.returncode}, {len(rows)} requests, {errors} errors, {res['zero_ttft']} with TTFT 0, "
        f"p50 TTFT {res['ttft_p50_ms']}")
    return res
