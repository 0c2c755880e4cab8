"""Summaries, targets and results.md of the end-to-end benchmark: pure functions of the results
dict (results.md can be rebuilt from a results.json: cd bench && python -m e2e.report RESULTS.json)."""

from __future__ import annotations

import json
import math
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from e2e.workload import TPB

MiB, GiB = 1 << 20, 1 << 30
KV_SOURCES = ["none", "gpu", "loaded", "recomputed:cheaper", "recomputed:unstaged", "recomputed:load-failed", "recomputed:service-down"]
MR_ORDER = ["recompute", "host", "disk_p4", "disk_p0"]


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def fmt(x: Any, nd: int = 1) -> str:
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return "-"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def hb(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


# --- daemon and engine deltas


def stats_dict(r: Any) -> dict:
    """An Admin.Stats reply as plain numbers (every Counters field, whatever this daemon version has)."""
    c = r.counters
    return {"counters": {f.name: getattr(c, f.name) for f in c.DESCRIPTOR.fields},
            "latencies": {h.name: {"count": h.count, "sum": h.sum} for h in r.latencies},
            "tiers": {t.name: {"capacity_bytes": t.capacity_bytes, "used_bytes": t.used_bytes, "blocks": t.blocks}
                      for t in r.tiers},
            "io_backend": r.io_backend}


def counter_delta(after: dict, before: dict) -> dict:
    a, b = after["counters"], before["counters"]
    d: dict[str, Any] = {k: a[k] - b.get(k, 0) for k in a if k != "recovery_rate"}
    off, back = d.get("blocks_offloaded"), d.get("blocks_loaded_back")
    d["recovery_rate"] = back / off if off else None
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
        if "_total" in k:
            if v - before.get(k, 0.0):
                out[k] = v - before.get(k, 0.0)
        elif k.startswith(("model_runner_load_bandwidth", "model_runner_prefill_tokens_per_second")):
            out[k] = v
        elif k.startswith(("model_runner_lookup", "model_runner_forward")) and k.split("{")[0].endswith(("_sum", "_count")):
            out[k] = v - before.get(k, 0.0)  # Lookup round trips and the head's waits for them
    return out


def summarize_requests(recs: list[dict], duration: float) -> dict:
    ok = [r for r in recs if r["ok"]]
    ttft = [r["ttft_ms"] for r in ok]
    prompt_toks = sum(r["prompt_tokens"] for r in ok)
    out_toks = sum(r["output_tokens"] for r in ok)
    tiers = {t: sum(r["by_tier"].get(t, 0) for r in ok) for t in ("gpu", "host", "disk")}
    src: dict[str, int] = {}
    for r in ok:
        src[r["kv_source"]] = src.get(r["kv_source"], 0) + 1
    return {
        "requests": len(recs), "ok": len(ok), "errors": len(recs) - len(ok), "duration_s": duration,
        "ttft_p50_ms": pct(ttft, 50), "ttft_p90_ms": pct(ttft, 90),
        "ttft_p50_round0_ms": pct([r["ttft_ms"] for r in ok if r.get("round") == 0], 50),
        "ttft_p50_rounds1plus_ms": pct([r["ttft_ms"] for r in ok if r.get("round", 1) >= 1], 50),
        "engine_ttft_p50_ms": pct([r["engine_ttft_ms"] for r in ok if r.get("engine_ttft_ms") is not None], 50),
        "req_per_s": len(ok) / duration if duration > 0 else None,
        "total_tok_per_s": (prompt_toks + out_toks) / duration if duration > 0 else None,
        "prompt_tok_per_s": prompt_toks / duration if duration > 0 else None,
        "prompt_tokens": prompt_toks, "output_tokens": out_toks, "reused_tokens": tiers,
        "reused_fraction": sum(tiers.values()) / prompt_toks if prompt_toks else None, "kv_source": src,
    }


# --- targets


def disk_regime_keys(res0: dict) -> set[tuple[int, int]]:
    """(user, round) of the requests that needed the disk tier in the prefetch-0 run: disk hits, or less
    reused than was stored before them (the rest of the prefix was on disk and recomputed)."""
    keys = set()
    for r in res0.get("requests_detail", []):
        if not r.get("ok") or r["round"] == 0:
            continue
        reused = sum(r["by_tier"].get(t, 0) for t in ("gpu", "host", "disk"))
        if r["by_tier"].get("disk", 0) > 0 or reused + TPB < r["reusable_tokens"]:
            keys.add((r["user"], r["round"]))
    return keys


def p50_of(res: dict, keys: set[tuple[int, int]]) -> tuple[float | None, int]:
    xs = [r["ttft_ms"] for r in res.get("requests_detail", []) if r.get("ok") and (r["user"], r["round"]) in keys]
    return pct(xs, 50), len(xs)


def compute_targets(results: dict) -> list[dict]:
    cfg = results.get("configs", {})
    out: list[dict] = []

    def add(figure: str, target: str, measured: str, value: float | None, ok: bool | None) -> None:
        out.append({"figure": figure, "target": target, "measured": measured, "value": value,
                    "verdict": "n/a" if ok is None else ("PASS" if ok else "MISS")})

    rc, host = cfg.get("recompute"), cfg.get("host")
    f = "host tier: p50 TTFT recompute-only / with the service, zero errors"
    if rc and host and rc.get("ttft_p50_ms") and host.get("ttft_p50_ms"):
        v = rc["ttft_p50_ms"] / host["ttft_p50_ms"]
        errs = rc["errors"] + host["errors"]
        add(f, ">= 5x", f"{rc['ttft_p50_ms']:.1f} / {host['ttft_p50_ms']:.1f} ms, {errs} errors", v,
            v >= 5.0 and errs == 0)
    else:
        add(f, ">= 5x", "not measured", None, None)
    p4, p0 = cfg.get("disk_p4"), cfg.get("disk_p0")
    f = "disk setting: p50 TTFT of requests with disk hits, prefetch 4 vs 0, zero errors"
    if p4 and p0:
        keys = disk_regime_keys(p0)
        a, na = p50_of(p0, keys)
        b, _ = p50_of(p4, keys)
        errs = p4["errors"] + p0["errors"]
        if a and b:
            v = 1.0 - b / a
            add(f, ">= 25% lower", f"{b:.1f} vs {a:.1f} ms ({na} requests), {errs} errors", v, v >= 0.25 and errs == 0)
        else:
            add(f, ">= 25% lower", f"no disk-tier requests in the prefetch-0 run ({len(keys)})", None, None)
    else:
        add(f, ">= 25% lower", "not measured", None, None)
    nr = results.get("no_reuse")
    f = "no reuse: token throughput with the service / engine alone"
    if nr and nr.get("throughput_ratio"):
        v = nr["throughput_ratio"]
        add(f, ">= 0.97", f"{nr['service']['total_tok_per_s']:.0f} / {nr['alone']['total_tok_per_s']:.0f} tok/s", v,
            v >= 0.97)
    else:
        add(f, ">= 0.97", "not measured", None, None)
    probe = (nr or {}).get("miss_probe")
    f = "round 0 (misses, one at a time, engines alternating): p50 TTFT with the service / engine alone"
    if probe and probe.get("ttft_ratio"):
        v = probe["ttft_ratio"]
        errs = probe["alone"]["errors"] + probe["service"]["errors"]
        add(f, "<= 1.05", f"{probe['service']['ttft_p50_ms']:.1f} / {probe['alone']['ttft_p50_ms']:.1f} ms "
            f"({probe['requests_each']} requests each, {probe['prompt_tokens']} tokens), {errs} errors", v,
            v <= 1.05 and errs == 0)
    else:
        add(f, "<= 1.05", "not measured", None, None)
    f = "round 0 of the multi-round runs (configs run one after another): p50 TTFT with the service / engine alone"
    if rc and host and rc.get("ttft_p50_round0_ms") and host.get("ttft_p50_round0_ms"):
        v = host["ttft_p50_round0_ms"] / rc["ttft_p50_round0_ms"]
        add(f, "<= 1.05", f"{host['ttft_p50_round0_ms']:.1f} / {rc['ttft_p50_round0_ms']:.1f} ms", v, v <= 1.05)
    else:
        add(f, "<= 1.05", "not measured", None, None)
    for name in ("lmb_completions", "lmb_chat"):
        lm = results.get("lmbenchmark", {}).get(name)
        f = f"LMBenchmark multi-round-qa.py ({name.split('_')[1]} mode): runs unmodified, every TTFT > 0"
        if lm:
            ok = lm["returncode"] == 0 and lm["requests"] > 0 and lm["errors_logged"] == 0 and lm["zero_ttft"] == 0
            add(f, "0 errors, 0 zero TTFTs", f"{lm['requests']} requests, {lm['errors_logged']} errors, "
                f"{lm['zero_ttft']} TTFT 0, p50 TTFT {fmt(lm['ttft_p50_ms'])} ms", None, ok)
        else:
            add(f, "0 errors, 0 zero TTFTs", "not run", None, None)
    return out


# --- results.md


def render_md(results: dict) -> str:
    meta, shape, settings = results.get("meta", {}), results.get("shape", {}), results.get("settings", {})
    L: list[str] = ["# kvservice end-to-end benchmark (bench/e2e_multiround.py)\n"]
    L.append(f"- Command: `{meta.get('command', '')}`")
    L.append(f"- Date: {meta.get('date', '-')}; commit {meta.get('commit', '-')} (source digest "
             f"{meta.get('source_digest', '-')}); elapsed {fmt(results.get('elapsed_s'), 0)} s")
    L.append(f"- Hardware: GPU {meta.get('gpu', '-')}; {meta.get('nproc', '-')} CPUs; torch {meta.get('torch', '-')}")
    bb = results.get("block_bytes", 0)
    if shape:
        L.append(f"- Workload (LMBenchmark multi-round QA shape): {shape['users']} users x {shape['rounds']} rounds; "
                 f"shared system prompt {shape['sys_len']} tokens, per-user history {shape['hist_len']}, question "
                 f"{shape['q_len']}, answer {shape['answer']} tokens (ignore_eos); prompts "
                 f"{results.get('prompt_lens', ['-'])[0]} .. {results.get('prompt_lens', ['-'])[-1]} tokens; arrivals at "
                 f"{fmt(results.get('rate'), 3)} req/s = {meta.get('args', {}).get('load_factor')} / the recompute-only "
                 f"engine's service time of a last-round prompt ({fmt(results.get('calibration', {}).get('service_s'), 3)} s)"
                 f"; disk setting x{results.get('disk_rate_factor', '-')}")
    for name, st in settings.items():
        L.append(f"- Tier setting `{name}`: GPU tier {st['gpu_blocks']} blocks ({hb(st['gpu_blocks'] * bb)}) per engine, "
                 f"host tier {hb(st['host_blocks'] * bb)}, disk tier {hb(st['disk_blocks'] * bb) if st['disk_blocks'] else 'none'}"
                 f"; working set {hb(results.get('working_set_blocks', 0) * bb)}")
    for sk in results.get("skipped", []):
        L.append(f"- Skipped `{sk['config']}`: {sk['reason']}")
    if results.get("error"):
        L.append(f"- **Stopped early:** {results['error']}")
    L.append("\n## Targets\n")
    L.append("| figure | target | measured | value | verdict |")
    L.append("| --- | --- | --- | ---: | --- |")
    for t in results.get("targets") or compute_targets(results):
        v = t["value"]
        vs = "-" if v is None else (f"{v * 100:.0f}% lower" if "%" in t["target"] else f"{v:.2f}")
        L.append(f"| {t['figure']} | {t['target']} | {t['measured']} | {vs} | {t['verdict']} |")
    cfg = results.get("configs", {})
    names = [n for n in MR_ORDER if n in cfg]
    if names:
        L.append("\n## Multi-round QA\n")
        L.append("Client TTFT: request sent -> first streamed text. Reused tokens by the tier they came from.\n")
        L.append("| configuration | ok / sent | p50 TTFT ms | p90 | p50 round 0 | p50 rounds >= 1 | engine-side p50 | "
                 "req/s | reused gpu / host / disk | kv_source | daemon loads host / disk, spills, prefetch staged / "
                 "used | load decisions |")
        L.append("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- | --- |")
        for n in names:
            r = cfg[n]
            rt, dd, em = r["reused_tokens"], r.get("daemon") or {}, r.get("engine_metrics", {})
            dec = ", ".join(f"{_label(k)}: {int(v)}" for k, v in sorted(em.items()) if "load_decisions_total" in k)
            dcol = (f"{dd.get('loads_host')} / {dd.get('loads_disk')}, {dd.get('spills')}, "
                    f"{dd.get('prefetch_staged')} / {dd.get('prefetch_used')}") if dd else "-"
            src = ", ".join(f"{k}: {v}" for k, v in sorted(r["kv_source"].items()))
            L.append(f"| {r['label']} | {r['ok']} / {r['requests']} | {fmt(r['ttft_p50_ms'])} | {fmt(r['ttft_p90_ms'])} | "
                     f"{fmt(r['ttft_p50_round0_ms'])} | {fmt(r['ttft_p50_rounds1plus_ms'])} | "
                     f"{fmt(r['engine_ttft_p50_ms'])} | {fmt(r['req_per_s'], 2)} | {rt['gpu']} / {rt['host']} / "
                     f"{rt['disk']} | {src} | {dcol} | {dec or '-'} |")
        L.append("\nLookups as the engine sees them (sent at enqueue -> answer; the queue head's waits for one):\n")
        L.append("| configuration | Lookups | mean round trip ms | head waits | mean wait ms |")
        L.append("| --- | ---: | ---: | ---: | ---: |")
        for n in names:
            em = cfg[n].get("engine_metrics", {})
            k, s = em.get("model_runner_lookup_seconds_count", 0), em.get("model_runner_lookup_seconds_sum", 0)
            kw, sw = em.get("model_runner_lookup_wait_seconds_count", 0), em.get("model_runner_lookup_wait_seconds_sum", 0)
            L.append(f"| {cfg[n]['label']} | {int(k)} | {fmt(s / k * 1e3 if k else None)} | {int(kw)} | "
                     f"{fmt(sw / kw * 1e3 if kw else None)} |")
        rounds = max((r["round"] for n in names for r in cfg[n]["requests_detail"]), default=-1) + 1
        L.append("\np50 TTFT (ms) by round:\n")
        L.append("| configuration | " + " | ".join(f"r{i}" for i in range(rounds)) + " |")
        L.append("| --- | " + " | ".join("---:" for _ in range(rounds)) + " |")
        for n in names:
            det = cfg[n]["requests_detail"]
            L.append(f"| {cfg[n]['label']} | " + " | ".join(
                fmt(pct([r["ttft_ms"] for r in det if r.get("ok") and r["round"] == i], 50), 0)
                for i in range(rounds)) + " |")
        if "disk_p0" in cfg:
            keys = disk_regime_keys(cfg["disk_p0"])
            L.append(f"\nDisk-tier requests: {len(keys)} (user, round) pairs that in the prefetch-0 run had disk hits "
                     "or reused less than was stored before them; p50 TTFT of the same pairs: " + ", ".join(
                         f"{cfg[n]['label']} {fmt(p50_of(cfg[n], keys)[0])} ms" for n in ("disk_p4", "disk_p0")
                         if n in cfg))
            L.append("\nThe same pairs, where their reusable prefix came from (tokens summed over the pairs; "
                     "recomputed = reusable - reused), and what the engine and daemon saw over the whole run:\n")
            L.append("| configuration | pairs | p50 / p90 TTFT ms | reusable | gpu / host / disk | recomputed | "
                     "kv_source | prefetch staged / used / wasted (daemon) | engine: disk GB/s, prefill tok/s |")
            L.append("| --- | ---: | --- | ---: | --- | ---: | --- | --- | --- |")
            pairs = {n: [x for x in cfg[n]["requests_detail"] if x.get("ok") and (x["user"], x["round"]) in keys]
                     for n in ("disk_p4", "disk_p0") if n in cfg}
            for n, det in pairs.items():
                r = cfg[n]
                tt = [x["ttft_ms"] for x in det]
                by = {t: sum(x["by_tier"].get(t, 0) for x in det) for t in ("gpu", "host", "disk")}
                reusable = sum(x["reusable_tokens"] for x in det)
                src = Counter(x["kv_source"] for x in det)
                dd, em = r.get("daemon") or {}, r.get("engine_metrics", {})
                bw = em.get('model_runner_load_bandwidth_bytes_per_second{tier="disk"}')
                L.append(f"| {r['label']} | {len(det)} | {fmt(pct(tt, 50), 0)} / {fmt(pct(tt, 90), 0)} | {reusable} | "
                         f"{by['gpu']} / {by['host']} / {by['disk']} | {max(0, reusable - sum(by.values()))} | "
                         + ", ".join(f"{k}: {v}" for k, v in sorted(src.items())) + " | "
                         f"{dd.get('prefetch_staged', '-')} / {dd.get('prefetch_used', '-')} / "
                         f"{dd.get('prefetch_wasted', '-')} | {fmt(bw / 1e9 if bw else None, 2)}, "
                         f"{fmt(em.get('model_runner_prefill_tokens_per_second'), 0)} |")
            L.append("\nThe same pairs inside the engine (means; ms from kv_cache.timings): queued until admitted, "
                     "admitted until its Load landed, then to the first token; blocks admission planned to load "
                     "by tier, and staged by its prefetch by then; of the pairs with a prefetch job: mean ms from "
                     "the job's submit to its first Prefetch (behind the jobs before it), paused after room "
                     "refusals, and from its first Prefetch to the first answer (of the jobs answered by "
                     "admission); jobs with no answer by admission; blocks read from disk (summed). The daemon's "
                     "Prefetch calls: mean ms of a call and of its disk read:\n")
            L.append("| configuration | queued | loading | to first token | planned host / disk blocks | staged | plans "
                     "| prefetch jobs stopped by (whole run) | jobs: waited / paused / first answer ms, unanswered by admission, read |")
            L.append("| --- | ---: | ---: | ---: | --- | ---: | --- | --- | --- |")
            for n, recs in pairs.items():
                det = [x["timings"] for x in recs if x.get("timings")]
                if not det:
                    continue

                def mean(k: str) -> float:
                    return sum(float(t.get(k, 0)) for t in det) / len(det)

                plans = Counter(str(t.get("plan") or "none") for t in det)
                L.append(f"| {cfg[n]['label']} | {mean('queued'):.0f} | {mean('loading'):.0f} | {mean('to_first'):.0f} | "
                         f"{sum(int(t.get('load_host', 0)) for t in det)} / {sum(int(t.get('load_disk', 0)) for t in det)} | "
                         f"{sum(int(t.get('staged', 0)) for t in det)} | "
                         + ", ".join(f"{k}: {v}" for k, v in sorted(plans.items())) + " | "
                         + (", ".join(f"{_label(k)}: {int(v)}" for k, v in sorted(cfg[n].get("engine_metrics", {}).items())
                                      if k.startswith("model_runner_prefetch_stops_total")) or "-") + " | "
                         + _job_cell([t for t in det if "prefetch_wait" in t]) + " |")
            calls = []
            for n in pairs:
                lat = (cfg[n].get("daemon") or {}).get("latencies", {})
                pf, rd = lat.get("prefetch") or {}, lat.get("prefetch_read") or {}
                if pf.get("count"):
                    calls.append(f"{cfg[n]['label']}: {pf['count']} calls, {fmt(pf.get('mean_ms'), 1)} ms; "
                                 f"{rd.get('count', 0)} with a disk read, {fmt(rd.get('mean_ms'), 1)} ms")
            if calls:
                L.append("\nThe daemon's Prefetch calls (whole run): " + "; ".join(calls))
        cpu_rows = []
        for n in names:
            em = cfg[n].get("engine_metrics", {})
            th = {k.split('thread="')[1].rstrip('"}'): v for k, v in em.items()
                  if k.startswith("model_runner_thread_cpu_seconds_total")}
            if th:
                cpu_rows.append(f"{cfg[n]['label']}: " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                                   sorted(th.items(), key=lambda kv: -kv[1])))
        if cpu_rows:
            L.append("\nEngine process CPU seconds by thread over each run (model_runner_thread_cpu_seconds_total):\n")
            L += [f"- {r}" for r in cpu_rows]
    nr = results.get("no_reuse")
    if nr:
        L.append("\n## No reuse\n")
        L.append(f"Unique prompts of {nr['prompt_tokens']} tokens, {nr['max_tokens']} output tokens, {nr['clients']} "
                 f"clients in a closed loop, {nr['requests_per_half']} requests per half, halves "
                 f"{' / '.join(nr['order'])}; with the service every prefill is written through (host + disk).\n")
        L.append("| engine | ok | req/s (per half) | total tok/s | p50 TTFT ms | p90 TTFT ms |")
        L.append("| --- | ---: | --- | ---: | ---: | ---: |")
        for key in ("alone", "service"):
            r = nr[key]
            L.append(f"| {key} | {r['ok']} | {fmt(r['req_per_s'], 2)} ({', '.join(f'{x:.2f}' for x in r['halves_req_per_s'])})"
                     f" | {fmt(r['total_tok_per_s'], 0)} | {fmt(r['ttft_p50_ms'])} | {fmt(r['ttft_p90_ms'])} |")
        L.append(f"\nThroughput ratio {fmt(nr.get('throughput_ratio'), 3)}.")
        ems = {k: nr[k].get("engine_metrics", {}) for k in ("alone", "service")}
        if all(ems.values()):
            L.append("\nThe engines' own time over the timed halves (engine loop thread, seconds): where a gap comes from.\n")
            L.append("| engine | prefill forwards | decode forwards | scheduling | idle (incl. the other engine's halves) "
                     "| process CPU s |")
            L.append("| --- | --- | --- | ---: | ---: | ---: |")
            for k, em in ems.items():
                def fw(ph: str, em: dict = em) -> str:
                    n, t = em.get(f'model_runner_forward_seconds_count{{phase="{ph}"}}'), \
                        em.get(f'model_runner_forward_seconds_sum{{phase="{ph}"}}')
                    return f"{fmt(t, 2)} ({int(n or 0)}, {fmt(t / n * 1e3 if n else None)} ms each)"
                sched, idle = (em.get(f'model_runner_loop_seconds_total{{activity="{a}"}}') for a in ("schedule", "idle"))
                L.append(f"| {k} | {fw('prefill')} | {fw('decode')} | {fmt(sched, 2)} | {fmt(idle, 2)} | "
                         f"{fmt(em.get('process_cpu_seconds_total'), 1)} |")
        probe = nr.get("miss_probe")
        if probe:
            L.append(f"\nRound-0 misses one at a time ({probe['requests_each']} per engine, {probe['prompt_tokens']}-token "
                     "unique prompts, engines alternating, daemon idle before each engine-alone request):\n")
            L.append("| engine | ok | p50 TTFT ms (client) | p50 TTFT ms (engine) | TTFTs ms in order |")
            L.append("| --- | ---: | ---: | ---: | --- |")
            for k in ("alone", "service"):
                r = probe[k]
                L.append(f"| {k} | {r['ok']} | {fmt(r['ttft_p50_ms'])} | {fmt(r['engine_ttft_p50_ms'])} | "
                         + ", ".join(f"{x['ttft_ms']:.0f}" for x in r["requests"]) + " |")
            L.append(f"\nRatio service / alone: {fmt(probe.get('ttft_ratio'), 3)}.")
    lmb = results.get("lmbenchmark", {})
    if lmb:
        L.append("\n## LMBenchmark's multi-round-qa.py, unmodified\n")
        L.append("| mode | rc | requests | errors | TTFT 0 | p50 TTFT ms | p90 TTFT ms | prompt tokens (mean) | "
                 "generated (mean) |")
        L.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for n, r in lmb.items():
            L.append(f"| {n} | {r['returncode']} | {r['requests']} | {r['errors_logged']} | {r['zero_ttft']} | "
                     f"{fmt(r['ttft_p50_ms'])} | {fmt(r['ttft_p90_ms'])} | {fmt(r['prompt_tokens_mean'], 0)} | "
                     f"{fmt(r['generation_tokens_mean'], 1)} |")
        first = next(iter(lmb.values()))
        L.append(f"\nCommand (chat mode: USE_CHAT_COMPLETIONS=True): `{' '.join(first['argv'])}`")
    plots = [p for p in results.get("plots", []) if isinstance(p, str) and p.endswith(".png")]
    if plots:
        L.append("\n## Plots\n")
        L += [f"![{p}]({p})" for p in plots]
    return "\n".join(L) + "\n"


def _job_cell(jobs: list[dict]) -> str:
    """The prefetch-job columns of the pairs that had a job (timings prefetch_wait/paused/read)."""
    if not jobs:
        return "-"
    wait = sum(float(t["prefetch_wait"]) for t in jobs) / len(jobs)
    paused = sum(float(t.get("prefetch_paused", 0)) for t in jobs) / len(jobs)
    firsts = [float(t["prefetch_first"]) for t in jobs if float(t.get("prefetch_first", -1)) >= 0]
    first = f"{sum(firsts) / len(firsts):.0f}" if firsts else "-"
    unanswered = sum(1 for t in jobs if float(t.get("prefetch_first", 0)) < 0)
    return (f"{len(jobs)} jobs: {wait:.0f} / {paused:.0f} / {first}, {unanswered} unanswered, "
            f"{sum(int(t.get('prefetch_read', 0)) for t in jobs)}")


def _label(metric: str) -> str:
    """'model_runner_load_decisions_total{decision="load"}' -> 'load'."""
    return metric.split("=", 1)[-1].strip('}"')


if __name__ == "__main__":
    path = Path(sys.argv[1])
    print(render_md(json.loads(path.read_text())))
