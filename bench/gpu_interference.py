#!/usr/bin/env python3
"""How much of an engine's GPU compute a Store costs, by where and how its copy runs (CUDA host).

    python bench/gpu_interference.py [--seconds 3] [--period 0.25] [--store-mib 512] [--out results.json]

This process is the engine: it runs a prefill-like loop on its default stream (the MLP GEMMs and
causal GQA attention of one 8B layer over 4096 tokens, bf16) and counts how many loop iterations
each window completes. In each window one other thing moves --store-mib of its KV pool (vLLM's
8B paged layout: 64 regions, 2 MiB blocks, random blocks) to host memory every --period seconds:

  idle              nothing (the reference)
  daemon            Store through KVClient to a real daemon (gather kernel + GPU CRC32C + D2H, in the
                    daemon's own CUDA context), the engine's record_ready() before each Store
  xproc-dma         another process, through the pool's IPC handle: contiguous D2H copies only
  xproc-batch-dma   another process: one cudaMemcpyBatchAsync of the blocks' region pieces (no kernel)
  xproc-gather      another process: index_select gather kernel into staging + D2H (no CRC)
  inproc-dma        this process, a low-priority side stream: contiguous D2H copies
  inproc-gather     this process, a low-priority side stream: gather kernel + D2H

Prints one table: iterations per second of each window and the ratio to idle (idle is measured
first and last; the table uses their mean and shows both). The ratio is what the engine keeps.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from harness.daemon import child_env  # noqa: E402

MiB = 1 << 20
BLOCK = 2 * MiB
LAYERS = 32


def compute_loop(seconds: float) -> float:
    """Prefill-like iterations per second over `seconds` on the default stream."""
    dev = torch.device("cuda")
    t = 4096
    x = torch.randn(t, 4096, device=dev, dtype=torch.bfloat16)
    w1 = torch.randn(4096, 14336, device=dev, dtype=torch.bfloat16) * 0.01
    w2 = torch.randn(14336, 4096, device=dev, dtype=torch.bfloat16) * 0.01
    q = torch.randn(1, 32, t, 128, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(1, 8, t, 128, device=dev, dtype=torch.bfloat16)

    def step() -> None:
        torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        (x @ w1) @ w2

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        n += 10
    return n / (time.perf_counter() - t0)


def pick_blocks(num_blocks: int, n: int, rng: random.Random) -> list[int]:
    return rng.sample(range(num_blocks), n)


def helper_role(args) -> None:
    """Another process with the pool's IPC handle: copy --store-mib every --period until stdin closes."""
    from engine_client.shm_pool import _regions
    from kvservice.core.sessions_api import PoolRegion, PoolSpec
    from kvservice.memory.cuda_memory import CudaEngineMemory, _rt
    from kvservice.memory.host_arena import HostArena
    from kvwire.v1 import kvcache_pb2

    desc = kvcache_pb2.PoolDescription.FromString(bytes.fromhex(sys.stdin.readline().strip()))
    nb = desc.cuda.size // BLOCK
    n = args.store_mib * MiB // BLOCK
    regs = _regions(nb, BLOCK, "layer-first", LAYERS)
    spec = PoolSpec("cuda", nb, tuple(PoolRegion(r.offset, r.block_stride, r.block_bytes) for r in regs),
                    desc.cuda.size, cuda_handle=desc.cuda.handle, cuda_device_index=desc.cuda.device_index,
                    cuda_device_uuid=desc.cuda.device_uuid)
    mem = CudaEngineMemory(spec)  # maps the pool (and warms the kernels)
    arena = HostArena(n * BLOCK, pin=True)
    offs = arena.alloc(BLOCK, n)
    rng = random.Random(1)
    stream = torch.cuda.Stream()
    base = mem._base
    host = arena.base
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    print("ready", flush=True)
    copies = 0
    while not stop.is_set():
        t0 = time.perf_counter()
        ids = pick_blocks(nb, n, rng)
        if args.mode == "xproc-dma":
            with torch.cuda.stream(stream):
                for lo in range(0, n * BLOCK, 32 * MiB):
                    host[lo:lo + 32 * MiB].copy_(base[lo:lo + 32 * MiB], non_blocking=True)
        elif args.mode == "xproc-batch-dma":
            dsts, srcs, sizes = [], [], []
            for i, b in enumerate(ids):
                pos = host.data_ptr() + offs[i]
                for r in regs:
                    dsts.append(pos)
                    srcs.append(base.data_ptr() + r.offset + b * r.block_stride)
                    sizes.append(r.block_bytes)
                    pos += r.block_bytes
            _rt().memcpy_batch(dsts, srcs, sizes, stream.cuda_stream)
        else:  # xproc-gather: the daemon's copy path without the CRC
            mem._gather_to(host, ids, offs, False)
        stream.synchronize()
        copies += 1
        stop.wait(max(0.0, args.period - (time.perf_counter() - t0)))
    print(json.dumps({"copies": copies}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--period", type=float, default=0.25)
    ap.add_argument("--store-mib", type=int, default=512)
    ap.add_argument("--pool-mib", type=int, default=8192)
    ap.add_argument("--modes", default="idle,daemon,xproc-dma,xproc-batch-dma,xproc-gather,"
                                       "inproc-dma,inproc-gather,idle")
    ap.add_argument("--out", default="")
    ap.add_argument("--role", default="engine")
    ap.add_argument("--mode", default="")
    args = ap.parse_args()
    if args.role == "helper":
        return helper_role(args)
    from engine_client import CudaKVPool, KVClient, Namespace
    from harness.daemon import Daemon

    nb = args.pool_mib * MiB // BLOCK
    n = args.store_mib * MiB // BLOCK
    pool = CudaKVPool(nb, BLOCK, layout="layer-first", num_layers=LAYERS)
    pool.buffer.random_(0, 256)
    torch.cuda.synchronize()
    rng = random.Random(0)
    work = Path(tempfile.mkdtemp(prefix="kvintf", dir="/tmp"))
    rows = []

    def paced(move) -> tuple[float, int]:
        """compute_loop's rate while another thread calls move() every --period: (it/s, moves done)."""
        stop = threading.Event()
        moved = [0]

        def mover() -> None:
            while not stop.is_set():
                t0 = time.perf_counter()
                move()
                moved[0] += 1
                stop.wait(max(0.0, args.period - (time.perf_counter() - t0)))
        th = threading.Thread(target=mover, daemon=True)
        th.start()
        try:
            return compute_loop(args.seconds), moved[0]
        finally:
            stop.set()
            th.join()

    def with_mover(mode: str) -> tuple[float, int]:
        if mode == "idle":
            return compute_loop(args.seconds), 0
        if mode.startswith("inproc"):
            side = torch.cuda.Stream(priority=0)  # lowest priority (torch: 0 is low, negative is high)
            host = torch.empty(n * BLOCK, dtype=torch.uint8, pin_memory=True)
            staging = torch.empty(n * BLOCK, dtype=torch.uint8, device="cuda")
            view3 = pool.buffer.as_strided((2 * LAYERS, nb, BLOCK // (2 * LAYERS)),
                                           (pool.regions[1].offset - pool.regions[0].offset,
                                            pool.regions[0].block_stride, 1), pool.regions[0].offset)

            def move_inproc() -> None:
                with torch.cuda.stream(side):
                    if mode == "inproc-dma":
                        for lo in range(0, n * BLOCK, 32 * MiB):
                            host[lo:lo + 32 * MiB].copy_(pool.buffer[lo:lo + 32 * MiB], non_blocking=True)
                    else:
                        idx = torch.tensor(pick_blocks(nb, n, rng), device="cuda")
                        torch.index_select(view3.permute(1, 0, 2), 0, idx, out=staging.view(n, 2 * LAYERS, -1))
                        host.copy_(staging, non_blocking=True)
                side.synchronize()
            return paced(move_inproc)
        if mode.startswith("xproc"):
            p = subprocess.Popen([sys.executable, __file__, "--role", "helper", "--mode", mode, "--period",
                                  str(args.period), "--store-mib", str(args.store_mib)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, env=child_env())
            p.stdin.write(pool.description().SerializeToString().hex() + "\n")
            p.stdin.flush()
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"{mode} helper did not start")
            r = compute_loop(args.seconds)
            p.stdin.close()
            out = json.loads(p.stdout.readline())
            p.wait(30)
            return r, out["copies"]
        with Daemon(work, tag=mode, host_capacity=4 * args.store_mib * MiB, disk_capacity=0, io_backend="auto",
                    lease_seconds=None, extra=["--max-batch-blocks", "65536"]) as d:
            ns = Namespace(f"intf-{mode}", "bfloat16", 16, "layer-first")
            c = KVClient(d.target, ns, pool, client_name="bench/gpu_interference.py", timeout=600.0)
            c.connect(required=True)
            try:
                c.store([os.urandom(32) for _ in range(n)], pick_blocks(nb, n, rng))  # warm

                def move_store() -> None:
                    pool.record_ready()
                    rs = c.store([os.urandom(32) for _ in range(n)], pick_blocks(nb, n, rng))
                    if rs.statuses.count(1) != n:
                        raise RuntimeError(f"store: {rs.statuses.count(1)} of {n} stored")
                return paced(move_store)
            finally:
                c.close()

    for mode in args.modes.split(","):
        ips, moved = with_mover(mode)
        rows.append({"mode": mode, "it_per_s": ips, "copies": moved})
        print(f"{mode:16s} {ips:8.2f} it/s  copies {moved}", flush=True)
    idles = [r["it_per_s"] for r in rows if r["mode"] == "idle"]
    ref = sum(idles) / len(idles)
    print(f"\n{args.store_mib} MiB every {args.period} s, windows of {args.seconds} s; idle windows: "
          + ", ".join(f"{x:.2f}" for x in idles) + " it/s\n")
    print("| mode | it/s | copies | kept (vs idle mean) | GB/s moved |\n| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['mode']} | {r['it_per_s']:.2f} | {r['copies']} | {r['it_per_s'] / ref:.3f} | "
              f"{r['copies'] * args.store_mib * MiB / args.seconds / 1e9:.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "args": vars(args),
                                              "device": torch.cuda.get_device_name(0)}, indent=1))


if __name__ == "__main__":
    main()
