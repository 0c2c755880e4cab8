#!/usr/bin/env python3
"""End-to-end benchmark: model runners over HTTP, with and without a kvservice daemon.

    python bench/e2e_multiround.py --out DIR [--model 8b --device cuda] [--lmbenchmark DIR]
    python bench/e2e_multiround.py --model tiny --device cpu --out /tmp/e2e        # smoke test, CPU

One command, one host. It starts two daemons (`python -m kvservice serve`, harness.daemon) -- H, the
host-tier setting, and D, the host + disk setting (bench/e2e/configs.py) -- and four model runners
(`python -m model_runner`, harness.runner) at once: R (no service), H (daemon H), P4 and P0 (daemon
D, prefetch 4 and 0). It measures the recompute-only runner's service time for a last-round prompt,
sets the arrival rate to --load-factor / that, then runs, one after another:

1. Multi-round QA (bench/e2e/workload.py: LMBenchmark's long-input / short-output shape) against
   R, H, P4 and P0: the same prompt lengths at the same times, each configuration with its own token
   ids; the daemon emptied before each. The disk setting runs at --disk-rate-factor x the rate.
2. No reuse: unique prompts in a closed loop, R alone against P4 with its daemon (write-through).
3. With --lmbenchmark DIR (a copy of LMBenchmark's synthetic-multi-round-qa folder, run unmodified):
   its multi-round-qa.py against runner H, completions mode and chat mode.

After every configuration --out gets results.json, results.md (tables, targets with PASS / MISS)
and the PNG plots (bench/e2e/plots.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e import cpus, plots  # noqa: E402
from e2e.configs import CONFIGS, DAEMON_SETTING, ENGINES, RUN_ORDER, tier_settings  # noqa: E402
from e2e.report import compute_targets, render_md  # noqa: E402
from e2e.runs import Context, calibrate, log, run_lmbenchmark, run_multiround, run_no_reuse  # noqa: E402
from e2e.workload import TPB, Shape, default_shape  # noqa: E402
from harness.daemon import Daemon  # noqa: E402
from harness.runner import ModelRunner  # noqa: E402
from model_runner.config import PRESETS  # noqa: E402  # no torch behind this import

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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="/tmp/kvservice-e2e", help="results.json, results.md, PNGs and logs go here")
    p.add_argument("--model", default="8b", choices=sorted(PRESETS))
    p.add_argument("--device", default="cuda", help="cpu | cuda | cuda:N (every runner on this device)")
    p.add_argument("--dtype", default="", help="[bfloat16 on CUDA, float32 on CPU]")
    p.add_argument("--load-policy", default="auto", choices=["auto", "always", "never"])
    p.add_argument("--load-factor", type=float, default=0.8,
                   help="arrival rate x the recompute-only runner's service time of a last-round prompt")
    p.add_argument("--disk-rate-factor", type=float, default=CONFIGS["disk_p4"].rate_factor,
                   help="the disk setting's arrival rate / the common one (prefetch helps queued requests)")
    for flag, field in (("--users", "users"), ("--rounds", "rounds"), ("--system-prompt", "sys_len"),
                        ("--history", "hist_len"), ("--question", "q_len"), ("--answer", "answer")):
        p.add_argument(flag, type=int, default=0, dest=field, help=f"workload {field} [model default]")
    p.add_argument("--configs", default="", help=f"comma list, subset of {','.join(RUN_ORDER)} [all]")
    p.add_argument("--config-timeout", type=float, default=240.0, help="seconds per multi-round configuration")
    p.add_argument("--no-reuse-tokens", type=int, default=0, help="prompt tokens of a no-reuse request [4096]")
    p.add_argument("--no-reuse-clients", type=int, default=2)
    p.add_argument("--no-reuse-warmup", type=int, default=0, help="warm-up requests per engine [fill the GPU tier]")
    p.add_argument("--no-reuse-half-seconds", type=float, default=0.0, help="[8 on CUDA, 3 on CPU]")
    p.add_argument("--pin-cpus", action="store_true",
                   help="each engine on whole physical cores of its own; daemons and this client on the rest")
    p.add_argument("--disk-arrivals", choices=("poisson", "uniform"), default="poisson",
                   help="the disk setting's arrivals: a seeded Poisson process (the same schedule for both prefetch "
                        "depths; requests queue now and then, which is when prefetch can stage) or evenly spaced")
    p.add_argument("--miss-probe", type=int, default=-1,
                   help="after the no-reuse halves: this many round-0-length misses per engine, one at a time, "
                        "engines alternating [12 on CUDA, 4 on CPU; 0: none]")
    p.add_argument("--no-reuse-cycles", type=int, default=1,
                   help="repeat the halves alone / service / service / alone this many times (more samples, drift cancels)")
    p.add_argument("--io-backend", default="auto")
    p.add_argument("--max-prefill-tokens", type=int, default=16384,
                   help="every runner's per-step prefill budget (model_runner --max-prefill-tokens; 0: none)")
    p.add_argument("--disk-round0-rate-factor", type=float, default=1.0,
                   help="the disk setting's round 0 (every prompt a miss, written through and spilled) arrives at "
                        "this x its rate: a warm-up that fills the disk tier no faster than it writes")
    p.add_argument("--disk-host-prompts", type=float, default=2.0,
                   help="daemon D's host tier, in last-round prompts")
    p.add_argument("--prefetch-share", type=float, default=0.0,
                   help="daemon D's prefetch_share (host-tier fraction one session's prefetch leases may pin) "
                        "[the daemon's default]")
    p.add_argument("--disk-format", default="", help="daemon D's disk_format (files | segments) [the daemon's default]")
    p.add_argument("--cold-disk", action=argparse.BooleanOptionalAction, default=True,
                   help="posix_fadvise(DONTNEED) daemon D's block files twice a second, so that disk hits read "
                        "the device rather than the page cache (a disk tier much larger than RAM)")
    p.add_argument("--served-name", default="", help="model name the runners serve [the preset's]")
    p.add_argument("--lmbenchmark", default="", help="folder holding LMBenchmark's multi-round-qa.py and utils.py")
    p.add_argument("--lmb-users", type=int, default=4)
    p.add_argument("--lmb-rounds", type=int, default=3)
    p.add_argument("--lmb-qps", type=float, default=1.0)
    p.add_argument("--lmb-system-prompt", type=int, default=0,
                   help="LMBenchmark 'tokens' (words 'hi') [300; 40 for the tiny preset, whose pool holds 1440 tokens]")
    p.add_argument("--lmb-history", type=int, default=0, help="[1500; 120 for the tiny preset]")
    p.add_argument("--lmb-answer", type=int, default=16)
    p.add_argument("--lmb-seconds", type=int, default=25)
    p.add_argument("--engine-start-timeout", type=float, default=240.0)
    a = p.parse_args(argv)
    a.dtype = a.dtype or ("float32" if a.device == "cpu" else "bfloat16")
    a.served_name = a.served_name or a.model
    a.no_reuse_tokens = a.no_reuse_tokens or (200 if a.model == "tiny" else 4096)
    a.lmb_system_prompt = a.lmb_system_prompt or (40 if a.model == "tiny" else 300)
    a.lmb_history = a.lmb_history or (120 if a.model == "tiny" else 1500)
    a.no_reuse_half_seconds = a.no_reuse_half_seconds or (3.0 if a.device == "cpu" else 8.0)
    if a.miss_probe < 0:
        a.miss_probe = 4 if a.device == "cpu" else 12
    if a.configs:
        bad = set(a.configs.split(",")) - set(CONFIGS)
        if bad:
            p.error(f"unknown configs {sorted(bad)}")
    return a


def shape_of(a: argparse.Namespace) -> Shape:
    d = default_shape(a.model).as_dict()
    d.update({k: getattr(a, k) for k in d if getattr(a, k)})
    return Shape(**d)


SOURCE_PACKAGES = ("kvservice", "kvwire", "engine_client", "model_runner", "bench")


def source_digest(root: Path = ROOT) -> str:
    """sha256 (12 hex digits) over the .py files of the packages that run, path and bytes: which code ran,
    where a device's copy of the tree has no .git or a stale one (its `git rev-parse` then names an older
    commit). `python3 bench/e2e_multiround.py --source-digest` prints it for a checkout to compare."""
    h = hashlib.sha256()
    for pkg in SOURCE_PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            if "__pycache__" in f.parts:
                continue
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def meta(a: argparse.Namespace) -> dict:
    def run(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:  # noqa: BLE001
            return "-"

    gpu = run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]) \
        if shutil.which("nvidia-smi") else "-"
    # A `git archive` of a commit has no .git of its own (git would answer for an enclosing checkout): its
    # REV file, when present, names the tree that runs.
    rev = ROOT / "REV"
    commit = (rev.read_text().strip() if rev.is_file() and not (ROOT / ".git").exists() else
              run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]) or "-")
    try:
        import importlib.metadata
        torch_v = importlib.metadata.version("torch")
    except Exception:  # noqa: BLE001
        torch_v = "-"
    return {"command": " ".join([os.path.basename(sys.executable), *sys.argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "host": platform.node(), "nproc": os.cpu_count(), "gpu": gpu, "torch": torch_v, "commit": commit,
            "source_digest": source_digest(),
            "args": vars(a)}


def save(ctx: Context, t0: float) -> None:
    r = ctx.results
    r["targets"] = compute_targets(r)
    r["elapsed_s"] = time.monotonic() - t0
    try:
        r["plots"] = plots.plot(r, ctx.out)
    except Exception as e:  # noqa: BLE001  # matplotlib missing or a plotting problem: data first
        r["plots"] = [f"not drawn: {type(e).__name__}: {e}"]
    tmp = ctx.out / "results.json.tmp"
    tmp.write_text(json.dumps(r, indent=1, default=str))
    tmp.replace(ctx.out / "results.json")
    (ctx.out / "results.md").write_text(render_md(r))


def main(argv: list[str] | None = None) -> int:
    if (argv if argv is not None else sys.argv[1:]) == ["--source-digest"]:
        print(source_digest())
        return 0
    a = parse_args(argv)
    t0 = time.monotonic()
    shape = shape_of(a)
    settings = tier_settings(shape, a.disk_host_prompts)
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[a.dtype]
    bb = PRESETS[a.model].kv_bytes_per_token(dtype_bytes) * TPB
    names = [n for n in (a.configs.split(",") if a.configs else RUN_ORDER)  # --configs: in the order given
             if CONFIGS[n].kind != "lmb" or a.lmbenchmark]
    for n in ("disk_p4", "disk_p0"):
        CONFIGS[n] = dataclasses.replace(CONFIGS[n], rate_factor=a.disk_rate_factor)
    out = Path(a.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    ctx = Context(args=a, shape=shape, settings=settings, vocab=PRESETS[a.model].vocab, out=out)
    ctx.results = {"meta": meta(a), "shape": shape.as_dict(), "block_bytes": bb,
                   "settings": {k: dataclasses.asdict(s) for k, s in settings.items()},
                   "working_set_blocks": -(-shape.working_set_tokens() // TPB),
                   "prompt_lens": [shape.prompt_len(r) for r in range(shape.rounds)],
                   "disk_rate_factor": a.disk_rate_factor, "configs": {}, "lmbenchmark": {}, "skipped": []}
    engines = sorted({k for n in names for k in CONFIGS[n].engines} | {"R"})
    daemon_keys = sorted({ENGINES[k].daemon for k in engines if ENGINES[k].daemon})
    work = Path(tempfile.mkdtemp(prefix="kve2e-", dir="/tmp"))
    cold = None
    rc = 0
    placement: dict[str, set[int]] = {}
    rest: set[int] | None = None
    if a.pin_cpus:
        placement, rest = cpus.plan(engines)
        ctx.results["cpus"] = {**{k: sorted(v) for k, v in placement.items()}, "daemons and client": sorted(rest)}
        os.sched_setaffinity(0, rest)
        log(f"CPU placement: {ctx.results['cpus']}")
    try:
        for key in daemon_keys:
            st = settings[DAEMON_SETTING[key]]
            denv = {}
            if key == "D" and a.prefetch_share:
                denv["KVSERVICE_PREFETCH_SHARE"] = str(a.prefetch_share)
                denv["KVSERVICE_PREFETCH_TOTAL_SHARE"] = str(max(a.prefetch_share, 0.5))
            if key == "D" and a.disk_format:
                denv["KVSERVICE_DISK_FORMAT"] = a.disk_format
            d = Daemon(work, tag=key, host_capacity=st.host_blocks * bb, disk_capacity=st.disk_blocks * bb,
                       io_backend=a.io_backend, lease_seconds=None, log_level="warning", env=denv or None, cpus=rest)
            d.log_path = out / "logs" / f"daemon-{key}.log"
            ctx.daemons[key] = d.start(timeout=180)
            log(f"daemon {key}: host {st.host_blocks * bb >> 20} MiB, disk {st.disk_blocks * bb >> 20} MiB, "
                f"started in {d.start_seconds:.1f} s")
        if a.cold_disk and "D" in ctx.daemons:
            cold = subprocess.Popen([sys.executable, "-c", _COLD_DISK_LOOP, ctx.daemons["D"].disk_path, "0.5"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} if a.device != "cpu" else {}
        for key in engines:
            spec = ENGINES[key]
            st = settings["disk" if spec.daemon == "D" else "host"]
            service = ctx.daemons[spec.daemon].target if spec.daemon else ""
            ctx.engines[key] = ModelRunner(
                ["--service", service, "--model", a.model, "--device", a.device, "--dtype", a.dtype,
                 "--tokens-per-block", str(TPB), "--gpu-blocks", str(st.gpu_blocks),
                 "--prefetch-reqs", str(spec.prefetch), "--load-policy", a.load_policy,
                 "--max-prefill-tokens", str(a.max_prefill_tokens),
                 "--client-name", f"e2e-{key}", "--log-level", "warning",
                 "--served-model-name", a.served_name, f"{a.served_name}-alias"],
                log_path=out / "logs" / f"engine-{key}.log", env=env, cpus=placement.get(key))
        for key, e in ctx.engines.items():
            log(f"engine {key} ready after {e.wait_ready(a.engine_start_timeout):.1f} s")
        cal = calibrate(ctx)
        ctx.results["calibration"] = cal
        ctx.rate = a.load_factor / cal["service_s"]
        ctx.results["rate"] = ctx.rate
        log(f"calibration: a {cal['prompt_tokens']}-token prompt takes {cal['service_s']:.3f} s on R "
            f"(TTFT {cal['ttft_s']:.3f} s): {ctx.rate:.3f} req/s; configurations {names}")
        save(ctx, t0)
        for n in names:
            t = time.monotonic()
            try:
                kind = CONFIGS[n].kind
                if kind == "mr":
                    ctx.results["configs"][n] = run_multiround(ctx, n)
                elif kind == "nr":
                    ctx.results["no_reuse"] = run_no_reuse(ctx)
                else:
                    ctx.results["lmbenchmark"][n] = run_lmbenchmark(ctx, n)
            except Exception as ex:  # noqa: BLE001  # one failed configuration must not lose the others
                log(f"{n} failed: {type(ex).__name__}: {ex}")
                ctx.results["skipped"].append({"config": n, "reason": f"failed: {type(ex).__name__}: {ex}"})
            log(f"{n}: {time.monotonic() - t:.1f} s; {time.monotonic() - t0:.0f} s so far")
            save(ctx, t0)
    except BaseException as ex:  # noqa: BLE001  # Ctrl-C or a failed start: keep what was measured
        log(f"stopped: {type(ex).__name__}: {ex}")
        ctx.results["error"] = f"{type(ex).__name__}: {ex}"
        rc = 1
    finally:
        save(ctx, t0)
        for e in ctx.engines.values():
            try:
                e.stop(timeout=20)
            except Exception:  # noqa: BLE001
                e.kill()
        if cold is not None:
            cold.kill()
            cold.wait(5)
        for d in ctx.daemons.values():
            try:
                d.stop(timeout=30)
            except Exception:  # noqa: BLE001
                pass
            d.close()
        shutil.rmtree(work, ignore_errors=True)
    print((out / "results.md").read_text())
    return rc


if __name__ == "__main__":
    sys.exit(main())
