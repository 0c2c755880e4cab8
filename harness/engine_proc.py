"""A stand-in engine process for cross-process tests and benchmarks: owns a KV pool (POSIX shared
memory, or a CUDA IPC pool with --pool cuda), talks to a real daemon through engine_client, and
obeys JSON commands, one per stdin line:

  {"op": "store", "numbers": [0, 1], "ttl": 0, "slots": [...], "delay_cycles": 0}
        -> {"status": [..StoreStatus..], "deadline": [...], "message": [...]}
        (cuda: writes content(i) behind a GPU sleep of delay_cycles on the engine's stream and
        records the store event before storing at once: the daemon must wait for the writes)
  {"op": "load", "numbers": [0, 1], "slots": [...]}  -> {"status", "tier", "message", "exact", "untouched"}
  {"op": "lookup", "numbers": [0, 1]}               -> {"prefix": n, "tiers": [...]}
  {"op": "prefetch", "numbers": [...]}              -> {"status": [...]}
  {"op": "retain", "numbers": [...], "ttl": 60}     -> {"deadline": [...]}
  {"op": "state"}                                   -> {"attached": bool, "session": str, "reattachments": n}
  {"op": "read", "blocks": [32]}                    -> {"sha256": [hex digest of pool block 32's bytes]}
  {"op": "exit"}
Block number i has content harness.blocks.content(i) and hash harness.blocks.h(i), so any two
engine processes agree on what block i is. Stores write block i into pool slot k (the k-th number)
unless "slots" says otherwise; loads land in the upper half of the pool unless "slots" says
otherwise, filled with the fill byte first (0 for shm, 0xAB for cuda): "exact" says whether the
bytes match, "untouched" whether the slot still holds only the fill byte.
    python -m harness.engine_proc TARGET [--pool shm|cuda] [--model m] [--rank 0] [--tp 1] [--blocks 64]
                                          [--block-bytes 4096] [--layout L] [--layers N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine_client import KVClient, Namespace  # noqa: E402
from engine_client.errors import KVClientError  # noqa: E402
from harness.blocks import content, h  # noqa: E402

POISON = 0xAB


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("target")
    p.add_argument("--pool", choices=["shm", "cuda"], default="shm")
    p.add_argument("--model", default="")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--salt", default="")
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--block-bytes", type=int, default=0, help="default 4096 (shm), 64 KiB (cuda)")
    p.add_argument("--layout", default="block-contiguous")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--canary-salt", default="", help="hash the canary differently (a mis-built engine)")
    a = p.parse_args()
    cuda = a.pool == "cuda"
    bb = a.block_bytes or (64 << 10 if cuda else 4096)
    if a.canary_salt:  # as if built against another engine_client version that hashes differently
        import engine_client.hashing
        engine_client.hashing.ROOT_DOMAIN = a.canary_salt.encode() + b"/root"
    if cuda:
        import torch

        from engine_client import CudaKVPool
        pool = CudaKVPool(a.blocks, bb, a.layout, a.layers, device=0)
        ns = Namespace(a.model or "gpu-m", "bfloat16", 16, a.layout, a.rank, a.tp, a.salt)
        fill = POISON
    else:
        from engine_client import ShmKVPool
        pool = ShmKVPool(a.blocks, bb)
        ns = Namespace(a.model or "m", "float32", 16, "block-contiguous", a.rank, a.tp, a.salt)
        fill = 0
    name = f"engine_proc pid {os.getpid()}"
    client = KVClient(a.target, ns, pool, client_name=name, timeout=60.0 if cuda else 10.0)
    try:
        client.connect(required=True)
        reply({"ready": True, "pid": os.getpid(), "session": client.session_id, "label": client.session_label,
               "namespace": client.namespace_id,
               "runtime": getattr(pool, "runtime", "shm")})
    except KVClientError as e:
        reply({"ready": False, "code": e.code.name, "message": e.message})
        return
    half = a.blocks // 2
    blank = bytes([fill]) * bb
    for line in sys.stdin:
        cmd = json.loads(line)
        op, nums = cmd["op"], cmd.get("numbers", [])
        try:
            if op == "store":
                slots = cmd.get("slots") or list(range(len(nums)))
                if cuda:
                    srcs = [torch.frombuffer(bytearray(content(i, bb)), dtype=torch.uint8).to(pool.device) for i in nums]
                    torch.cuda.synchronize()
                    if cmd.get("delay_cycles"):
                        torch.cuda._sleep(int(cmd["delay_cycles"]))  # the writes below queue behind this
                    for s, src in zip(slots, srcs):
                        pool.write_block(s, src)
                    pool.record_ready()
                else:
                    for s, i in zip(slots, nums):
                        pool.write_block(s, content(i, bb))
                rs = client.store([h(i) for i in nums], slots, cmd.get("ttl", 0.0))
                reply({"status": [r.status for r in rs], "deadline": [r.deadline for r in rs],
                       "message": [r.message for r in rs]})
            elif op == "load":
                slots = cmd.get("slots") or [half + k for k in range(len(nums))]
                for s in slots:
                    pool.write_block(s, blank)
                if cuda:
                    torch.cuda.synchronize()
                rs = client.load([h(i) for i in nums], slots)
                got = [pool.read_block(s) for s in slots]
                reply({"status": [r.status for r in rs], "tier": [r.tier for r in rs],
                       "message": [r.message for r in rs],
                       "exact": [g == content(i, bb) for g, i in zip(got, nums)],
                       "untouched": [g == blank for g in got]})
            elif op == "lookup":
                n, tiers = client.lookup([h(i) for i in nums])
                reply({"prefix": n, "tiers": list(tiers)})
            elif op == "prefetch":
                reply({"status": list(client.prefetch([h(i) for i in nums]))})
            elif op == "retain":
                reply({"deadline": list(client.retain([h(i) for i in nums], cmd["ttl"]))})
            elif op == "state":
                reply({"attached": client.attached, "session": client.session_id, "label": client.session_label,
                       "reattachments": client.reattachments})
            elif op == "read":  # what the pool holds now, e.g. a load target after a failed load
                reply({"sha256": [hashlib.sha256(pool.read_block(b)).hexdigest() for b in cmd["blocks"]]})
            elif op == "exit":
                break
            else:
                reply({"error": f"unknown op {op}"})
        except KVClientError as e:
            reply({"error": e.code.name, "message": e.message})
    client.close()
    pool.close()
    if not cuda:
        pool.unlink()


def reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
