"""The reference engine end to end: tiny float32 model on CPU, a real kvservice daemon subprocess.

The correctness bar throughout: greedy tokens are the same whether a prefix was computed here,
hit in the GPU tier, or loaded from the daemon's host or disk tier.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvservice.ops.cli import FLAGS
from kvwire.v1 import kvcache_pb2
from model_runner.config import EngineConfig
from model_runner.engine import Engine, GenerationRequest, GenerationResult
from model_runner.prefetcher import Prefetcher
from model_runner.requests import RequestHandle, Seq
from tests.daemon_kit import Daemon

TPB = 16
BLOCK_BYTES = 2 * 2 * TPB * 2 * 16 * 4  # tiny preset: layers * (K, V) * tpb * kv_heads * head_dim * float32


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def wait_until(pred: Callable[[], object], timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def run(engine: Engine, ids: list[int], max_tokens: int = 6, **kw: object) -> GenerationResult:
    return engine.submit(GenerationRequest(list(ids), max_tokens=max_tokens, **kw)).result(timeout=60)


def reference(ids: list[int], max_tokens: int = 6) -> list[int]:
    """Greedy tokens computed from scratch by a fresh engine without a service."""
    with Engine(EngineConfig(num_gpu_blocks=64)) as e:
        r = run(e, ids, max_tokens)
    assert r.kv_source == "none" and r.cached_tokens == 0
    return r.output_ids


@pytest.fixture
def engines() -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(service: str = "", **kw: object) -> Engine:
        e = Engine(EngineConfig(service=service, **kw))  # type: ignore[arg-type]
        e.start()
        made.append(e)
        return e

    yield make
    for e in made:
        e.stop()


@pytest.fixture
def daemon(request: pytest.FixtureRequest) -> Iterator[Daemon]:
    """A daemon; tests pass Daemon kwargs with @pytest.mark.parametrize(..., indirect) or use the default."""
    d = Daemon(**getattr(request, "param", {})).start()
    yield d
    d.close()


@pytest.fixture(scope="module")
def shared() -> Iterator[Daemon]:
    """One default daemon for the tests that need nothing special (starting one costs a second or two).
    Their prompts are distinct and their counter checks are deltas, so they do not see each other."""
    d = Daemon(host_capacity="4MiB", disk_capacity="8MiB").start()
    yield d
    d.close()


def pushed_to_disk(daemon: Daemon, engines: Callable[..., Engine], ids: list[int], filler: list[int], spills: int,
                   max_tokens: int = 6) -> None:
    """ids written through by one engine, then pushed out of the host tier by the `filler` prompt; returns
    once the daemon has counted `spills` spills."""
    a = engines(daemon.target)
    run(a, ids, max_tokens=max_tokens)
    written_through(a, ids)
    run(a, filler, max_tokens=2)
    written_through(a, filler)
    a.stop()
    wait_until(lambda: daemon.stats().counters.spills >= spills, timeout=60, what="spills to disk")


def written_through(e: Engine, *prompts: list[int]) -> None:
    """Wait until the daemon holds every full block of prompts. The write-through Store is still in flight
    when run() returns: a test that pushes one prompt out with the next must wait for it first, or on a
    loaded box the two Stores overlap and the second finds the first's blocks still reserved (not
    evictable) and is refused in part (CI saw 10 of 12 spills); stop() would also cut a late Store short."""
    assert e.client is not None
    for prompt in prompts:
        hashes = e.sched.hasher.hash_blocks(prompt[: len(prompt) // TPB * TPB])
        wait_until(lambda: e.client.lookup(hashes)[0] == len(hashes), timeout=60, what="the write-through Stores")


def stored_blocks(d: Daemon) -> int:
    return d.stats().counters.stores


# --- (1) same tokens whatever tier the prefix came from


def test_gpu_tier_hit_gives_the_same_tokens(engines: Callable[..., Engine]) -> None:
    """Scenario: no service. The same prompt twice: the second request reuses the prompt's full blocks
    from the GPU radix tree (all but the last partial block) and produces the same greedy tokens."""
    ids = tokens(1, 5 * TPB + 7)
    e = engines(num_gpu_blocks=32)
    first, second = run(e, ids), run(e, ids)
    assert first.kv_source == "none" and first.cached_tokens == 0
    assert second.kv_source == "gpu" and second.cached_by_tier == {"gpu": 5 * TPB, "host": 0, "disk": 0}
    assert second.cached_tokens == 5 * TPB and second.prompt_tokens == len(ids)
    assert first.output_ids == second.output_ids == reference(ids)
    assert 0 < second.ttft_s <= second.total_s


def test_prompt_of_whole_blocks_still_computes_its_last_token(engines: Callable[..., Engine]) -> None:
    """Scenario: a prompt of exactly 4 blocks, twice. The last block is never reused (its last token's
    logits give the first output token), so the hit is 3 blocks and the tokens match."""
    ids = tokens(2, 4 * TPB)
    e = engines(num_gpu_blocks=32)
    run(e, ids)
    again = run(e, ids)
    assert again.cached_tokens == 3 * TPB
    assert again.output_ids == reference(ids)


def test_host_tier_load_gives_the_same_tokens(shared: Daemon, engines: Callable[..., Engine]) -> None:
    """Scenario: engine A computes a prompt and writes it through; a fresh engine B on the same daemon
    loads the prefix from the host tier and produces the same tokens as a from-scratch run."""
    ids = tokens(3, 6 * TPB + 3)
    a = engines(shared.target)
    assert run(a, ids).kv_source == "none"
    a.stop()  # flushes write-through
    b = engines(shared.target, load_policy="always")
    r = run(b, ids)
    assert r.kv_source == "loaded"
    assert r.cached_by_tier == {"gpu": 0, "host": 6 * TPB, "disk": 0}
    assert r.output_ids == reference(ids)


@pytest.mark.parametrize("daemon", [{"host_capacity": "64KiB"}], indirect=True)
def test_disk_tier_load_gives_the_same_tokens(daemon: Daemon, engines: Callable[..., Engine]) -> None:
    """Scenario: the daemon's host tier holds 8 blocks. Engine A writes through a 7-block prompt, then an
    8-block one that pushes the first to disk; engine B loads the first from disk: same tokens."""
    ids = tokens(4, 7 * TPB + 9)
    pushed_to_disk(daemon, engines, ids, tokens(40, 8 * TPB + 3), spills=7)
    b = engines(daemon.target, load_policy="always", prefetch_reqs=0)  # a prefetch job could stage it first
    r = run(b, ids)
    assert r.kv_source == "loaded" and r.cached_tokens == 7 * TPB
    assert r.cached_by_tier["disk"] > 0 and r.cached_by_tier["gpu"] == 0
    assert r.output_ids == reference(ids)
    # Where its time went: admitted, parked on a Load of the 7 stored blocks planned from disk, then run.
    t = r.timings
    assert t["plan"] == "load" and t["load_disk"] + t["load_host"] == 7 and t["load_disk"] > 0
    assert t["queued"] >= 0 and t["loading"] > 0 and t["to_first"] > 0
    assert t["queued"] + t["loading"] + t["to_first"] == pytest.approx(r.ttft_s * 1e3, abs=0.1)


def test_policy_never_recomputes_with_the_same_tokens(shared: Daemon, engines: Callable[..., Engine]) -> None:
    """Scenario: the daemon holds the prefix, but engine B has load_policy="never": it recomputes,
    reuses nothing, and produces the same tokens."""
    ids = tokens(5, 4 * TPB + 1)
    a = engines(shared.target)
    run(a, ids)
    a.stop()
    b = engines(shared.target, load_policy="never")
    r = run(b, ids)
    assert r.kv_source == "none" and r.cached_tokens == 0
    assert r.output_ids == reference(ids)


# --- (2) two engines, one namespace


def test_second_engine_reuses_the_first_engines_system_prompt(shared: Daemon,
                                                               engines: Callable[..., Engine]) -> None:
    """Scenario: two live engines of one model share a shared. A serves system prompt + user 1; B then
    serves system prompt + user 2 and loads the system prompt's blocks instead of computing them."""
    system = tokens(6, 5 * TPB)
    u1, u2 = system + tokens(7, 20), system + tokens(8, 25)
    a, b = engines(shared.target), engines(shared.target)
    assert a.namespace == b.namespace
    base = stored_blocks(shared)
    run(a, u1)
    wait_until(lambda: stored_blocks(shared) >= base + 5, what="A's write-through")
    wait_until(lambda: a.registry.get_sample_value(  # A's metric counts each block's answer (counted per reply)
        "model_runner_stored_blocks_total", {"reason": "prefill", "status": "STORED"}) == len(u1) // TPB,
        what="A's store metric")
    r = run(b, u2)
    assert r.kv_source == "loaded" and r.cached_tokens == 5 * TPB
    assert r.output_ids == reference(u2)
    assert b.registry.get_sample_value("model_runner_loaded_blocks_total", {"tier": "host"}) == 5


# --- (3) a parked request does not stall the others; load vs recompute by measured cost


def _has_flag(flag: str) -> bool:
    return any(spec[0] == flag for spec in FLAGS.values())


@pytest.mark.skipif(not _has_flag("--disk-read-bytes-per-second"),
                    reason="kvservice serve has no --disk-read-bytes-per-second yet")
@pytest.mark.parametrize("daemon", [{"host_capacity": "128KiB",
                                     "extra": ["--disk-read-bytes-per-second", "96KiB"]}], indirect=True)
def test_parked_request_does_not_stall_others(daemon: Daemon, engines: Callable[..., Engine]) -> None:
    """Scenario: disk reads at 96 KiB/s. A long prompt's 12 blocks sit on disk; engine B parks it
    while they load (about a second) and meanwhile serves a short request to the end. A first load is
    a warm-up the cost model does not trust alone, so B loads a second disk-resident prefix too; having
    measured that disk twice, it recomputes a third one instead of loading it ("recomputed:cheaper")."""
    long_ids, other_ids, short_ids = tokens(9, 12 * TPB + 5), tokens(10, 12 * TPB + 5), tokens(11, 20)
    third_ids = tokens(43, 12 * TPB + 5)
    a = engines(daemon.target)
    filler = tokens(41, 16 * TPB + 3)
    for prompt in (long_ids, other_ids, third_ids, filler):  # the filler fills the 16-block host tier: the rest spill
        run(a, prompt, max_tokens=2)
        written_through(a, prompt)
    a.stop()
    wait_until(lambda: daemon.stats().counters.spills >= 36, timeout=60, what="spills to disk")

    b = engines(daemon.target, prefetch_reqs=0)  # load_policy "auto": nothing measured yet, so it loads
    parked = b.submit(GenerationRequest(long_ids, max_tokens=4))
    wait_until(lambda: b.health()["parked"] == 1, what="the long request to park")
    short = b.submit(GenerationRequest(short_ids, max_tokens=4)).result(timeout=30)
    assert not parked.done() and b.health()["parked"] == 1
    assert short.output_ids == reference(short_ids, 4)

    r = parked.result(timeout=60)
    assert r.kv_source == "loaded" and r.cached_by_tier["disk"] > 0
    assert r.output_ids == reference(long_ids, 4)
    assert r.ttft_s > short.total_s

    again = run(b, other_ids, max_tokens=4)
    assert again.kv_source == "loaded" and again.output_ids == reference(other_ids, 4)
    third = run(b, third_ids, max_tokens=4)
    assert third.kv_source == "recomputed:cheaper" and third.cached_tokens == 0
    assert third.output_ids == reference(third_ids, 4)
    assert b.registry.get_sample_value("model_runner_load_decisions_total", {"decision": "recompute"}) == 1


# --- prefetch for queued requests


@pytest.mark.parametrize("daemon", [{"host_capacity": "64KiB"}], indirect=True)
def test_queued_request_is_prefetched(daemon: Daemon, engines: Callable[..., Engine]) -> None:
    """Scenario: max_running=1, so a request whose prefix sits on disk queues behind a long decode;
    the engine prefetches its blocks into the host tier while it waits, then loads them."""
    ids = tokens(12, 6 * TPB + 3)
    pushed_to_disk(daemon, engines, ids, tokens(42, 8 * TPB + 3), spills=6)
    b = engines(daemon.target, max_running=1, load_policy="always")
    busy = b.submit(GenerationRequest(tokens(13, 30), max_tokens=60))
    queued = b.submit(GenerationRequest(ids, max_tokens=6))
    r = queued.result(timeout=60)
    busy.result(timeout=60)
    assert b.registry.get_sample_value("model_runner_prefetches_total") == 1
    assert daemon.stats().counters.prefetch_staged > 0
    assert r.kv_source == "loaded" and r.cached_tokens == 6 * TPB
    assert r.output_ids == reference(ids)


# --- (4) the daemon dies mid-run


def test_engine_survives_daemon_crash_and_reattaches(daemon: Daemon, engines: Callable[..., Engine]) -> None:
    """Scenario: kill -9 the daemon under a running engine. New prompts are recomputed
    ("recomputed:service-down", same tokens), GPU-tier hits keep working; after a restart on the same
    directory the engine re-attaches by itself and write-through reaches the daemon again."""
    p1, p2, p3 = tokens(14, 3 * TPB + 2), tokens(15, 4 * TPB + 2), tokens(16, 3 * TPB + 5)
    e = engines(daemon.target)
    assert run(e, p1).kv_source == "none" and e.health()["service_attached"]
    daemon.kill9()
    r2 = run(e, p2)
    assert r2.kv_source == "recomputed:service-down" and r2.output_ids == reference(p2)
    assert not e.health()["service_attached"]
    assert run(e, p1).kv_source == "gpu"

    daemon.start()
    wait_until(lambda: e.health()["service_attached"], timeout=20, what="re-attach")
    run(e, p3)
    e.stop()
    fresh = engines(daemon.target, load_policy="always")
    r3 = run(fresh, p3)
    assert r3.kv_source == "loaded" and r3.cached_tokens == 3 * TPB
    assert r3.output_ids == reference(p3)


# --- (5) GPU-tier eviction offloads to the daemon


def test_evicted_gpu_blocks_come_back_from_the_daemon(shared: Daemon, engines: Callable[..., Engine]) -> None:
    """Scenario: an 8-block GPU tier and no write-through. A (6 blocks reserved, 5 cached after) then B
    (another 6) forces 3 of A's blocks out: they are offloaded to the daemon before reuse. A again
    hits its first 2 blocks in the GPU tier and loads the other 3 back: same tokens."""
    pa, pb = tokens(17, 5 * TPB + 10), tokens(18, 5 * TPB + 10)
    e = engines(shared.target, num_gpu_blocks=8, write_through=False, load_policy="always")
    base = stored_blocks(shared)
    first = run(e, pa, max_tokens=4)
    assert stored_blocks(shared) == base
    run(e, pb, max_tokens=4)
    assert e.registry.get_sample_value("model_runner_gpu_evictions_total") >= 3
    wait_until(lambda: stored_blocks(shared) >= base + 3, what="offload")
    again = run(e, pa, max_tokens=4)
    assert again.kv_source == "loaded"
    assert again.cached_by_tier == {"gpu": 2 * TPB, "host": 3 * TPB, "disk": 0}
    assert again.output_ids == first.output_ids == reference(pa, 4)


# --- (6) per-request TTL reaches the daemon


@pytest.mark.parametrize("write_through", [True, False])
def test_request_ttl_retains_its_blocks(shared: Daemon, engines: Callable[..., Engine], write_through: bool) -> None:
    """Scenario: a request with kv_cache_ttl_seconds=3600 gets its 4 full blocks retained by the daemon
    (even without write-through); a request without a TTL retains nothing."""

    def retained() -> int:
        return sum(n.retained_bytes for n in shared.stats().namespaces)

    base = retained()
    e = engines(shared.target, write_through=write_through)
    run(e, tokens(19 + 2 * write_through, 4 * TPB + 6), max_tokens=4)
    run(e, tokens(20 + 2 * write_through, 4 * TPB + 6), max_tokens=4, kv_cache_ttl_seconds=3600.0)
    wait_until(lambda: retained() >= base + 4 * BLOCK_BYTES, what="retention")
    e.stop()  # flushes every store: nothing more is retained after this
    assert retained() == base + 4 * BLOCK_BYTES


# --- many requests at once


def test_concurrent_requests_over_shared_prefixes_with_a_tiny_gpu_tier(shared: Daemon,
                                                                       engines: Callable[..., Engine]) -> None:
    """Scenario: 32 requests over 4 shared prefixes, split between two engines with 8-block GPU tiers
    and up to 4 requests in flight each: GPU hits, evictions with offload, loads of the other engine's
    blocks and TTL stores all interleave. Every output equals its from-scratch reference, and once idle
    every GPU block is either free or cached, with no reference left."""
    rng = random.Random(5)
    prefixes = [tokens(100 + i, rng.randrange(1, 5) * TPB) for i in range(4)]
    work = [(rng.choice(prefixes) + tokens(200 + i % 10, rng.randrange(0, 40)), rng.randrange(1, 12))
            for i in range(32)]
    pair = [engines(shared.target, num_gpu_blocks=8, max_running=4, load_policy=policy)
            for policy in ("always", "auto")]
    handles = [pair[i % 2].submit(GenerationRequest(list(p), max_tokens=m, kv_cache_ttl_seconds=60.0 * (i % 3 == 0)))
               for i, (p, m) in enumerate(work)]
    results = [h.result(timeout=60) for h in handles]
    expected: dict[tuple[tuple[int, ...], int], list[int]] = {}
    for (p, m), r in zip(work, results):
        assert r.output_ids == expected.setdefault((tuple(p), m), reference(p, m))
    assert {r.kv_source for r in results} >= {"gpu", "loaded"}
    for e in pair:
        s = e.sched
        wait_until(lambda: not s.pending_stores(), what="stores to land")
        wait_until(lambda: s.alloc.free_count + len(s.radix) == e.cfg.num_gpu_blocks, what="every block back")
        assert s.radix.referenced_count == 0
        assert e.health() == {"service_attached": True, "running": 0, "waiting": 0, "parked": 0}


# --- CUDA: the pool is registered by IPC and the daemon copies on its own streams


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_engines_share_blocks_exactly(shared: Daemon, engines: Callable[..., Engine], dtype: str) -> None:
    """Scenario: on a GPU, engine A computes a prompt and writes it through (CUDA IPC, the store event);
    engine B loads the prefix into its own pool and produces A's tokens; a 6-block GPU tier then
    forces eviction offloads, and the evicted prefix comes back from the daemon with the same tokens."""
    ids = tokens(30 + len(dtype), 5 * TPB + 3)
    a = engines(shared.target, device="cuda", dtype=dtype)
    first = run(a, ids)
    a.stop()
    b = engines(shared.target, device="cuda", dtype=dtype, load_policy="always", num_gpu_blocks=8,
                write_through=False)
    r = run(b, ids)
    assert r.kv_source == "loaded" and r.cached_tokens == 5 * TPB
    assert r.output_ids == first.output_ids
    run(b, tokens(31 + len(dtype), 5 * TPB + 3))  # evicts (and offloads) the tail of ids' chain
    assert b.registry.get_sample_value("model_runner_gpu_evictions_total") > 0
    again = run(b, ids)
    assert again.kv_source in ("gpu", "loaded") and again.output_ids == first.output_ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_pool_starts_zeroed_where_freed_memory_held_nan() -> None:
    """Scenario: device memory an earlier pool freed still holds 0xFF bytes (NaN in half precision);
    a new engine pool that cudaMalloc puts in the same place reads as zeros. Unwritten slots are read
    (masked by adding -inf) by the padded CUDA-graph decode, and NaN + -inf is NaN: on an H100 the
    bfloat16 test above generated garbage tokens after the float32 one freed its pool."""
    import gc

    from model_runner.config import PRESETS
    from model_runner.kv_pool import PagedKVPool

    cfg = PRESETS["tiny"]
    old = PagedKVPool(cfg, 64, TPB, torch.bfloat16, "cuda")
    ptr = old.raw.buffer.data_ptr()
    old.raw.buffer.fill_(255)
    torch.cuda.synchronize()
    old.close()
    del old
    gc.collect()
    pool = PagedKVPool(cfg, 64, TPB, torch.bfloat16, "cuda")
    try:
        if pool.raw.buffer.data_ptr() != ptr:
            pytest.skip("cudaMalloc did not hand the freed memory back to the new pool")
        assert not torch.isnan(pool.kv).any() and bool((pool.kv == 0).all())
    finally:
        pool.close()


# --- the request API


def test_stream_stop_ids_and_validation(engines: Callable[..., Engine]) -> None:
    """Scenario: stream() yields the tokens result() reports; a stop id ends the request early without
    being returned; seeded sampling is reproducible; requests the pool can never hold are refused."""
    e = engines(num_gpu_blocks=16)
    ids = tokens(21, 40)
    h = e.submit(GenerationRequest(ids, max_tokens=8))
    streamed = list(h.stream())
    full = h.result(timeout=30)
    assert streamed == full.output_ids and len(streamed) == 8 and full.finish_reason == "length"
    assert full.request_id and h.request_id == full.request_id

    stop = e.submit(GenerationRequest(ids, max_tokens=8, stop_ids=(full.output_ids[3],))).result(timeout=30)
    assert stop.finish_reason == "stop" and stop.output_ids == full.output_ids[:3]

    sampled = [run(e, ids, 8, temperature=1.0, seed=7).output_ids for _ in range(2)]
    assert sampled[0] == sampled[1]

    with pytest.raises(ValueError):
        e.submit(GenerationRequest(ids, max_tokens=16 * TPB))
    with pytest.raises(ValueError):
        e.submit(GenerationRequest([]))
    assert e.health() == {"service_attached": False, "running": 0, "waiting": 0, "parked": 0}


# --- prefetch in chunks, head first; a step's prefill budget


@pytest.mark.parametrize("daemon", [{"host_capacity": "256KiB", "env": {"KVSERVICE_PREFETCH_SHARE": "1"}}],
                         indirect=True)
def test_prefetcher_stages_a_chain_head_first_in_chunks_up_to_its_first_gap(
        daemon: Daemon, engines: Callable[..., Engine]) -> None:
    """Scenario: a 10-block prompt pushed to disk by a 34-block one (32-block host tier). A job for its 10 hashes plus 2 the
    daemon never saw, in chunks of 4 (two calls in flight): three Prefetch calls, 10 blocks staged (the head
    chunk in host memory as soon as it is answered), the job stops at the gap; a cancelled job asks nothing."""
    ids = tokens(60, 10 * TPB + 3)
    pushed_to_disk(daemon, engines, ids, tokens(61, 34 * TPB + 3), spills=12, max_tokens=2)
    b = engines(daemon.target, prefetch_reqs=0)
    hashes = b.sched.hasher.hash_blocks(ids[: 10 * TPB])
    assert b.client is not None
    _, tiers = b.client.lookup(hashes)
    assert tiers[0] == kvcache_pb2.TIER_DISK
    chunks: list[list[int]] = []  # tiers of the chain after each chunk
    statuses: list[int] = []
    p = Prefetcher(b.client, chunk_blocks=4, on_statuses=statuses.extend,
                   on_chunk=lambda: chunks.append(b.client.lookup(hashes)[1]))
    try:
        cancelled = p.submit(hashes)
        cancelled.cancel()
        job = p.submit(hashes + [bytes([7]) * 32, bytes([8]) * 32])
        wait_until(lambda: job.done, what="the prefetch job")
        assert cancelled.staged == 0 and cancelled.t_start == 0  # never asked
        assert job.staged == 10 and len(chunks) == 3, (str(statuses), str(chunks))
        assert job.read == statuses[:10].count(kvcache_pb2.STAGED) > 0  # what its request's timings report
        assert job.t_start >= job.t_submit > 0 and job.refusals == 0 and job.paused_s == 0
        assert set(chunks[0][:4]) == {kvcache_pb2.TIER_HOST}  # the head first
        assert set(chunks[-1]) == {kvcache_pb2.TIER_HOST}
        assert daemon.stats().counters.prefetch_staged >= 8
    finally:
        p.close()
    r = run(b, ids, max_tokens=2)
    assert r.kv_source == "loaded" and r.cached_by_tier["host"] == 10 * TPB
    assert r.output_ids == reference(ids, 2)


def head_in_host_rest_on_disk(daemon: Daemon, engines: Callable[..., Engine]) -> list[int]:
    """A 6-block prompt (+3 tokens) whose 2-block head is in the daemon's 8-block host tier and the rest on
    disk: written through by one engine, pushed to disk by an 8-block prompt, its head loaded back."""
    ids = tokens(80, 6 * TPB + 3)
    pushed_to_disk(daemon, engines, ids, tokens(81, 8 * TPB + 3), spills=6)
    # No prefetch: a prefetch job could stage the head before admission (then its Load is a host hit, as the
    # box's timing has it); without one the Load reads it from disk and onboards it into host memory.
    c = engines(daemon.target, load_policy="always", prefetch_reqs=0)
    r = run(c, ids[: 2 * TPB + 3])
    assert r.cached_by_tier["disk"] == 2 * TPB, (r.kv_source, r.cached_by_tier, r.timings)
    assert c.client is not None
    hashes = c.sched.hasher.hash_blocks(ids[: 6 * TPB])
    want = [kvcache_pb2.TIER_HOST] * 2 + [kvcache_pb2.TIER_DISK] * 4
    wait_until(lambda: list(c.client.lookup(hashes)[1]) == want, what="the head onboarded, the rest on disk")
    c.stop()
    return ids


def enqueue_by_hand(e: Engine, ids: list[int]) -> tuple[RequestHandle, Seq]:
    """Submit ids (6 tokens out) to an engine whose loop is not started and enqueue it: its Lookup (and a
    prefetch job) go out; admission is the test's to call."""
    handle = e.submit(GenerationRequest(list(ids), max_tokens=6))
    while e._inbox:
        e.sched.enqueue(e._inbox.popleft())
    return handle, e.sched.waiting[0]


@pytest.mark.parametrize("daemon", [{"host_capacity": "64KiB", "env": {"KVSERVICE_PREFETCH_SHARE": "1",
                                                                      "KVSERVICE_PREFETCH_TOTAL_SHARE": "1"}}],
                         indirect=True)
def test_admission_counts_a_prefetch_jobs_staged_prefix_as_host_without_asking_again(
        daemon: Daemon, engines: Callable[..., Engine]) -> None:
    """Scenario: a request whose 6-block prefix has its 2-block head in host memory and the rest on disk
    is enqueued (loop not started: admission by hand); its Lookup starts a prefetch job over all 6: the
    head is answered ALREADY_IN_HOST (leased, so it stays in host memory while the request queues), the
    rest STAGED. At admission the scheduler plans the Load from what the job staged -- every block from
    the host tier -- without a second Lookup (a round trip on the head's path, slow while prefetch reads
    are in flight); the Load comes from host memory and the tokens are the reference's."""
    ids = head_in_host_rest_on_disk(daemon, engines)
    b = Engine(EngineConfig(service=daemon.target, load_policy="always"))
    try:
        handle, seq = enqueue_by_hand(b, ids)
        s = b.sched
        assert seq.lookup is not None
        _, tiers = seq.lookup.result(timeout=10)
        assert tiers == [kvcache_pb2.TIER_HOST] * 2 + [kvcache_pb2.TIER_DISK] * 4
        wait_until(lambda: seq.prefetch_job is not None and seq.prefetch_job.done, what="the prefetch job")
        assert seq.prefetch_job is not None and seq.prefetch_job.staged == 6
        answered = {status: b.registry.get_sample_value("model_runner_prefetched_blocks_total", {"status": status})
                    for status in ("ALREADY_IN_HOST", "STAGED")}
        assert answered == {"ALREADY_IN_HOST": 2, "STAGED": 4}
        lookups = b.registry.get_sample_value("model_runner_lookup_seconds_count")
        s.admit()
        assert seq.load is not None and seq.load.tiers == [kvcache_pb2.TIER_HOST] * 6
        assert b.registry.get_sample_value("model_runner_lookup_seconds_count") == lookups
        b.start()
        r = handle.result(timeout=60)
        assert r.kv_source == "loaded" and r.cached_by_tier["host"] == 6 * TPB
        assert r.output_ids == reference(ids)
    finally:
        b.stop()


@pytest.mark.parametrize("daemon", [{"host_capacity": "64KiB", "env": {"KVSERVICE_PREFETCH_SHARE": "0.25",
                                                                      "KVSERVICE_PREFETCH_TOTAL_SHARE": "0.25"}}],
                         indirect=True)
def test_a_prefetched_request_loads_only_its_staged_prefix_and_recomputes_the_unstaged_disk_rest(
        daemon: Daemon, engines: Callable[..., Engine]) -> None:
    """Scenario: as above, but the daemon lets one session's prefetch leases pin 2 of the host tier's 8
    blocks: the job leases the 2-block head (ALREADY_IN_HOST) and is refused the next block (lease cap:
    it pauses, to ask again later). At admission (load_policy auto) the request loads the 2 host blocks
    and recomputes the 4 disk blocks past them -- no disk read on its path (SGLang HiCache's best_effort
    prefetch) -- and its timings say so; the tokens are the reference's."""
    ids = head_in_host_rest_on_disk(daemon, engines)
    b = Engine(EngineConfig(service=daemon.target))
    try:
        handle, seq = enqueue_by_hand(b, ids)
        s = b.sched
        assert seq.lookup is not None
        _, tiers = seq.lookup.result(timeout=10)
        assert tiers == [kvcache_pb2.TIER_HOST] * 2 + [kvcache_pb2.TIER_DISK] * 4
        # The job stops at the daemon's refusal, and the engine says why.
        wait_until(lambda: (b.registry.get_sample_value("model_runner_prefetch_stops_total", {"reason": "lease_cap"})
                            or 0) >= 1, what="the lease-cap refusal")
        assert seq.prefetch_job is not None and seq.prefetch_job.staged == 2 and not seq.prefetch_job.done
        s.admit()
        assert seq.load is not None and seq.load.tiers == [kvcache_pb2.TIER_HOST] * 2
        b.start()
        r = handle.result(timeout=60)
        assert r.kv_source == "loaded" and r.cached_by_tier == {"gpu": 0, "host": 2 * TPB, "disk": 0}
        assert r.timings["unstaged"] == 4 and r.timings["staged"] == 2 and r.timings["load_disk"] == 0
        assert r.output_ids == reference(ids)
    finally:
        b.stop()


@pytest.mark.parametrize("daemon", [{"host_capacity": "64KiB", "env": {"KVSERVICE_PREFETCH_SHARE": "0.25",
                                                                      "KVSERVICE_PREFETCH_TOTAL_SHARE": "0.25",
                                                                      "KVSERVICE_PIN_LEASE_SECONDS": "0.5"}}],
                         indirect=True)
def test_a_prefetch_refused_for_its_lease_cap_asks_again_and_stages_the_rest(
        daemon: Daemon, engines: Callable[..., Engine]) -> None:
    """Scenario: as above (2-block lease cap), with prefetch leases that run out after 0.5 s. The job
    leases the head, is refused at block 3 and pauses; once its leases run out it asks again from block 3
    (not the head), two blocks at a time, until the job has staged all 6 while the request queues.
    Admitted then, the request plans all 6 from host memory and loads them (blocks whose leases ran out
    may have left the 8-block host tier for disk again meanwhile: the Load serves them from there); the
    tokens are the reference's."""
    ids = head_in_host_rest_on_disk(daemon, engines)
    b = Engine(EngineConfig(service=daemon.target))
    try:
        handle, seq = enqueue_by_hand(b, ids)
        s = b.sched
        wait_until(lambda: seq.prefetch_job is not None and seq.prefetch_job.staged == 6, timeout=30,
                   what="the paused job to stage the rest")
        refused = b.registry.get_sample_value("model_runner_prefetch_stops_total", {"reason": "lease_cap"})
        assert refused is not None and refused >= 2  # at block 3, then at block 5
        assert daemon.stats().counters.prefetch_staged >= 4
        s.admit()
        assert seq.load is not None and seq.load.tiers == [kvcache_pb2.TIER_HOST] * 6
        b.start()
        r = handle.result(timeout=60)
        assert r.kv_source == "loaded" and r.cached_tokens == 6 * TPB
        assert r.timings["staged"] == 6 and r.timings["load_host"] == 6 and r.timings.get("unstaged", 0) == 0
        # where the staging's time went: refused twice or more, paused meanwhile, the disk part read
        assert r.timings["prefetch_refusals"] >= 2 and r.timings["prefetch_paused"] > 0
        assert r.timings["prefetch_read"] >= 4 and r.timings["prefetch_wait"] >= 0
        assert r.output_ids == reference(ids)
    finally:
        b.stop()


@pytest.mark.parametrize("daemon", [{"host_capacity": "64KiB", "env": {"KVSERVICE_PREFETCH_SHARE": "0.25",
                                                                      "KVSERVICE_PREFETCH_TOTAL_SHARE": "0.25"}}],
                         indirect=True)
def test_an_engine_stopped_while_its_prefetch_job_is_paused_ends_it(
        daemon: Daemon, engines: Callable[..., Engine]) -> None:
    """Scenario: a queued request's prefetch job is paused at its lease cap (its own head leases hold the
    cap for their 10 s) when the engine stops: stop() returns, the prefetch thread has ended, the request
    fails with "engine stopped", and the daemon closes the engine's session (its leases end with it)."""
    ids = head_in_host_rest_on_disk(daemon, engines)
    b = Engine(EngineConfig(service=daemon.target))
    handle, seq = enqueue_by_hand(b, ids)
    wait_until(lambda: (b.registry.get_sample_value("model_runner_prefetch_stops_total", {"reason": "lease_cap"})
                        or 0) >= 1, what="the lease-cap refusal")
    assert seq.prefetch_job is not None and not seq.prefetch_job.done
    sessions = daemon.stats().sessions
    b.stop()
    prefetcher = b.sched.prefetcher
    assert prefetcher is not None and prefetcher._thread is not None and not prefetcher._thread.is_alive()
    with pytest.raises(RuntimeError, match="engine stopped"):
        handle.result(timeout=5)
    wait_until(lambda: daemon.stats().sessions == sessions - 1, what="the session to close")


def test_prefetch_stop_reasons_are_named_from_the_daemons_messages() -> None:
    """Scenario: the refusals the daemon sends for a block a prefetch did not stage map to the labels of
    model_runner_prefetch_stops_total; NOT_FOUND has no message."""
    from model_runner.prefetcher import refusal_reason as prefetch_stop_reason
    failed = kvcache_pb2.PREFETCH_FAILED
    assert prefetch_stop_reason(kvcache_pb2.NOT_FOUND, "") == "not_found"
    assert prefetch_stop_reason(failed, "this session's prefetch leases hold 8 bytes; its cap is 4 "
                                        "(prefetch_share 0.25 of the host tier)") == "lease_cap"
    assert prefetch_stop_reason(failed, "no room in the host tier: it is pinned by loads and prefetches") == "no_room"
    assert prefetch_stop_reason(failed, "disk read failed, block discarded: EIO") == "read_failed"
    assert prefetch_stop_reason(failed, "something new") == "other"


def test_a_step_admits_prompts_up_to_the_prefill_budget() -> None:
    """Scenario: three 33-token prompts at once under a 48-token budget: the first step admits two
    (33 < 48, then 66 >= 48), the third stays queued; all three finish with the reference tokens."""
    prompts = [tokens(70 + i, 2 * TPB + 1) for i in range(3)]
    e = Engine(EngineConfig(max_prefill_tokens=3 * TPB))
    try:
        handles = [e.submit(GenerationRequest(list(p), max_tokens=2)) for p in prompts]
        s = e.sched
        while e._inbox:  # the loop is not started: drive its first admission by hand
            s.enqueue(e._inbox.popleft())
        s.admit()
        assert len(s.running) == 2 and len(s.waiting) == 1
        e.start()
        assert [h.result(timeout=30).output_ids for h in handles] == [reference(p, 2) for p in prompts]
    finally:
        e.stop()
