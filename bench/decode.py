#!/usr/bin/env python3
"""Decode step of model_runner's model: eager vs CUDA graphs, against the memory-bandwidth floor.

    python bench/decode.py --model 8b --contexts 512 2048 8192 16384 --out DIR

One decode token of one sequence over a prefix of `context` tokens in the paged pool (bf16, the preset's
shape), as the engine runs it, including the greedy sample's sync:
- `eager`: LlamaModel.forward of the one token (every kernel launched from Python);
- `graph`: DecodeGraphs.decode (one CUDA graph replay per step, the engine's default on a GPU);
- with --gil, each also beside a busy Python thread in the same process (`+gil`: what the engine's KVClient and
  prefetch threads can cost a loop thread that needs the GIL for every launch).
The floor is the time to read the bytes a step must read once (the weights, and K/V of the context)
at the device's copy bandwidth measured in the same run (best of a sweep of device-to-device copy sizes).
Each figure is the median of --steps timed steps after warm-up. Prints a table; writes decode.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from model_runner.config import PRESETS  # noqa: E402
from model_runner.decode_graphs import DecodeGraphs  # noqa: E402
from model_runner.kv_pool import PagedKVPool  # noqa: E402
from model_runner.model import LlamaModel  # noqa: E402


def copy_bandwidth(dev: torch.device) -> float:
    """Best device-to-device copy rate (bytes/s, read + write counted once each) over a sweep of sizes."""
    best = 0.0
    for mib in (256, 1024, 4096):
        src = torch.empty(mib << 20, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        for _ in range(2):
            dst.copy_(src)
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(5):
            dst.copy_(src)
        torch.cuda.synchronize(dev)
        best = max(best, 2 * 5 * src.numel() / (time.perf_counter() - t0))
        del src, dst
    return best


def step_times(step, steps: int) -> float:
    for _ in range(3):
        step()
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


class BusyThread:
    """A Python thread spinning on bytecode (holds the GIL whenever the interpreter lets it)."""

    def __enter__(self) -> BusyThread:
        self._stop = False
        self._t = threading.Thread(target=self._spin, daemon=True)
        self._t.start()
        return self

    def _spin(self) -> None:
        n = 0
        while not self._stop:
            n += 1

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._t.join()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="8b", choices=sorted(PRESETS))
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192, 16384])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tokens-per-block", type=int, default=16)
    ap.add_argument("--gil", action="store_true", help="also time each path beside a busy Python thread")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    def progress(what: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f} s] {what}", file=sys.stderr, flush=True)

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    cfg = PRESETS[args.model]
    tpb = args.tokens_per_block
    n_blocks = -(-max(args.contexts) // tpb) + 2
    model = LlamaModel(cfg, dtype=torch.bfloat16, device="cuda")
    progress("model built")
    dev = model.device
    rows = []
    with PagedKVPool(cfg, n_blocks, tpb, torch.bfloat16, "cuda") as pool:
        kv = pool.kv
        kv.normal_()
        t0 = time.perf_counter()
        graphs = DecodeGraphs(model, kv, n_blocks)
        capture_s = time.perf_counter() - t0
        progress(f"{len(graphs.buckets)} graphs captured")
        bw = copy_bandwidth(dev)
        progress(f"copy bandwidth {bw / 1e9:.0f} GB/s")
        weight_bytes = sum(t.numel() * t.element_size() for t in
                           [model.lm_head] + [w for lay in model.layers
                                              for w in (lay.wqkv, lay.wo, lay.w_gate_up, lay.w_down)])
        table = list(range(n_blocks))
        for ctx in args.contexts:
            def eager() -> None:
                int(torch.argmax(model.forward([7], ctx, table, kv, last_only=True)[-1]))

            def graph() -> None:
                int(torch.argmax(graphs.decode(7, ctx, table)[-1]))

            kv_bytes = (ctx + 1) * cfg.kv_bytes_per_token(2)
            floor = (weight_bytes + kv_bytes) / bw
            row = {"context": ctx, "bucket_blocks": graphs.bucket(ctx // tpb + 1), "floor_ms": floor * 1e3}
            for name, fn in (("eager", eager), ("graph", graph)):
                row[f"{name}_ms"] = step_times(fn, args.steps) * 1e3
                progress(f"context {ctx}: {name} {row[f'{name}_ms']:.2f} ms")
                if args.gil:
                    with BusyThread():
                        row[f"{name}_gil_ms"] = step_times(fn, min(args.steps, 10)) * 1e3
                    progress(f"context {ctx}: {name} beside a busy thread {row[f'{name}_gil_ms']:.2f} ms")
            got = graphs.decode(7, ctx, table).clone()
            ref = model.forward([7], ctx, table, kv, last_only=True)
            row["max_abs_diff_vs_eager"] = float((got - ref).abs().max())
            row["logit_std"] = float(ref.std())
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{args.model} decode, 1 sequence, bf16, {torch.cuda.get_device_name(dev)}; copy bandwidth "
          f"{bw / 1e9:.0f} GB/s (best of the sweep); weights {weight_bytes / 2**30:.1f} GiB; "
          f"{len(graphs.buckets)} graphs captured in {capture_s:.1f} s\n")
    print("| context | bucket (blocks) | floor ms | eager ms | graph ms | floor / graph | eager / graph "
          "| eager +gil ms | graph +gil ms | max |logit diff| (logit std) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        print(f"| {r['context']} | {r['bucket_blocks']} | {r['floor_ms']:.2f} | {r['eager_ms']:.2f} | "
              f"{r['graph_ms']:.2f} | {r['floor_ms'] / r['graph_ms']:.2f} | {r['eager_ms'] / r['graph_ms']:.1f} | "
              f"{r.get('eager_gil_ms', float('nan')):.2f} | {r.get('graph_gil_ms', float('nan')):.2f} | "
              f"{r['max_abs_diff_vs_eager']:.3f} "
              f"({r['logit_std']:.2f}) |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "decode.json").write_text(json.dumps({"copy_bandwidth": bw, "capture_s": capture_s,
                                                          "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
