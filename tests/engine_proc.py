"""A stand-in engine process for cross-process tests: owns a shared-memory KV pool, talks to a
real daemon through engine_client, and obeys JSON commands, one per stdin line:

  {"op": "store", "numbers": [0, 1], "ttl": 0}      -> {"status": [..StoreStatus..], "deadline": [...]}
  {"op": "load", "numbers": [0, 1]}                 -> {"status": [...], "tier": [...], "exact": [true, ...]}
  {"op": "lookup", "numbers": [0, 1]}               -> {"prefix": n, "tiers": [...]}
  {"op": "prefetch", "numbers": [...]}              -> {"status": [...]}
  {"op": "retain", "numbers": [...], "ttl": 60}     -> {"deadline": [...]}
  {"op": "state"}                                   -> {"attached": bool, "session": str, "reattachments": n}
  {"op": "read", "blocks": [32]}                    -> {"sha256": [hex digest of pool block 32's bytes]}
  {"op": "exit"}
Block number i has content tests.corekit.content(i) and hash tests.corekit.h(i), so any two
engine processes agree on what block i is. Loads land in the upper half of the pool, zeroed
first, and "exact" says whether the bytes match.
    python tests/engine_proc.py TARGET [--model m] [--rank 0] [--tp 1] [--blocks 64] [--block-bytes 4096]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine_client import KVClient, Namespace, ShmKVPool  # noqa: E402
from engine_client.errors import KVClientError  # noqa: E402
from tests.corekit import content, h  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("target")
    p.add_argument("--model", default="m")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--salt", default="")
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--block-bytes", type=int, default=4096)
    p.add_argument("--canary-salt", default="", help="hash the canary differently (a mis-built engine)")
    a = p.parse_args()
    if a.canary_salt:  # as if built against another engine_client version that hashes differently
        import engine_client.hashing
        engine_client.hashing.ROOT_DOMAIN = a.canary_salt.encode() + b"/root"
    ns = Namespace(a.model, "float32", 16, "block-contiguous", a.rank, a.tp, a.salt)
    pool = ShmKVPool(a.blocks, a.block_bytes)
    client = KVClient(a.target, ns, pool, client_name=f"engine_proc pid {os.getpid()}", timeout=10.0)
    try:
        client.connect(required=True)
        reply({"ready": True, "pid": os.getpid(), "session": client.session_id, "namespace": client.namespace_id})
    except KVClientError as e:
        reply({"ready": False, "code": e.code.name, "message": e.message})
        return
    half = a.blocks // 2
    for line in sys.stdin:
        cmd = json.loads(line)
        op, nums = cmd["op"], cmd.get("numbers", [])
        try:
            if op == "store":
                for slot, i in enumerate(nums):
                    pool.write_block(slot, content(i, a.block_bytes))
                rs = client.store([h(i) for i in nums], list(range(len(nums))), cmd.get("ttl", 0.0))
                reply({"status": [r.status for r in rs], "deadline": [r.deadline for r in rs]})
            elif op == "load":
                for k in range(len(nums)):
                    pool.write_block(half + k, bytes(a.block_bytes))
                rs = client.load([h(i) for i in nums], [half + k for k in range(len(nums))])
                exact = [pool.read_block(half + k) == content(i, a.block_bytes) for k, i in enumerate(nums)]
                reply({"status": [r.status for r in rs], "tier": [r.tier for r in rs],
                       "message": [r.message for r in rs], "exact": exact})
            elif op == "lookup":
                n, tiers = client.lookup([h(i) for i in nums])
                reply({"prefix": n, "tiers": list(tiers)})
            elif op == "prefetch":
                reply({"status": list(client.prefetch([h(i) for i in nums]))})
            elif op == "retain":
                reply({"deadline": list(client.retain([h(i) for i in nums], cmd["ttl"]))})
            elif op == "state":
                reply({"attached": client.attached, "session": client.session_id, "reattachments": client.reattachments})
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
    pool.unlink()


def reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
