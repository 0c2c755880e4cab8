"""Engine: the reference engine's request API and its loop thread.

    engine = Engine(EngineConfig(service="unix:///run/kvservice/kvservice.sock"))
    engine.start()
    handle = engine.submit(GenerationRequest(prompt_ids=[...], max_tokens=16))
    for token in handle.stream(): ...          # as produced
    result = handle.result()                    # GenerationResult: tokens, cache reuse, TTFT
    engine.stop()

submit() is thread-safe and only enqueues; the loop thread owns every piece of engine state
(radix tree, allocator, requests). Each iteration: admit waiting requests, prefetch for the first
queued ones, pick up parked requests whose loads landed (scheduler.py), then one model step: the
whole remaining prompt of each newly runnable request, one token of each decoding one. Requests
run one after another inside a step: this reference engine batches by interleaving, not by
stacking sequences into one kernel. On a GPU in half precision a decode step replays a CUDA graph
(decode_graphs.py; EngineConfig.cuda_graphs=False runs it eagerly).

kv_source of a result: "none" (nothing cached), "gpu" (GPU-tier hit only), "loaded" (blocks
loaded from the service), or "recomputed:<why>" for a prefix the service could not usefully
serve: "cheaper" (recomputing was estimated faster), "unstaged" (a prefetched request's prefix was on disk
past what its prefetch staged: disk blocks reach the GPU through staging only), "load-failed",
"service-down". With
load_policy "never" the service is not consulted for loads at all (so "none" or "gpu").
stop_ids end generation; the stop token itself is not part of output_ids (nor is EOS implied: the
HTTP front adds it). Output tokens are sampled among ByteTokenizer.output_ids() only.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
import uuid

import prometheus_client
import torch

from engine_client.hashing import BlockHasher
from engine_client.sync_client import KVClient
from model_runner.config import PRESETS, EngineConfig
from model_runner.decode_graphs import DecodeGraphs
from model_runner.kv_pool import PagedKVPool
from model_runner.metrics import EngineMetrics
from model_runner.model import LlamaModel
from model_runner.requests import (
    GenerationRequest,
    GenerationResult,
    Listener,
    Phase,
    RequestHandle,
    Seq,
)
from model_runner.scheduler import LOAD_POLICIES, Scheduler
from model_runner.tokenizer import ByteTokenizer

__all__ = ["Engine", "GenerationRequest", "GenerationResult", "RequestHandle", "check_config"]

log = logging.getLogger(__name__)
_IDLE_WAIT_S = 0.5  # safety net only: submits and finished futures wake the loop


def check_config(cfg: EngineConfig) -> None:
    """ValueError naming the first EngineConfig field an engine cannot run with."""
    if cfg.model not in PRESETS:
        raise ValueError(f"model {cfg.model!r} is not a preset: {sorted(PRESETS)}")
    if cfg.dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype {cfg.dtype!r} is not float32, bfloat16 or float16")
    if cfg.load_policy not in LOAD_POLICIES:
        raise ValueError(f"load_policy {cfg.load_policy!r} is not one of {LOAD_POLICIES}")
    for name in ("tokens_per_block", "num_gpu_blocks", "max_running"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.max_prefill_tokens < 0:
        raise ValueError(f"max_prefill_tokens must be >= 0, got {cfg.max_prefill_tokens}")
    if cfg.prefetch_reqs < 0:
        raise ValueError(f"prefetch_reqs must be >= 0, got {cfg.prefetch_reqs}")


class Engine:
    def __init__(self, cfg: EngineConfig, client_name: str = "model_runner") -> None:
        check_config(cfg)
        self.cfg = cfg
        self.model_cfg = PRESETS[cfg.model]
        dtype = getattr(torch, cfg.dtype)
        self.tokenizer = ByteTokenizer()
        self.metrics = EngineMetrics()
        self._fwd_prefill = self.metrics.forward_seconds.labels("prefill")
        self._fwd_decode = self.metrics.forward_seconds.labels("decode")
        self.registry: prometheus_client.CollectorRegistry = self.metrics.registry
        self.model = LlamaModel(self.model_cfg, dtype=dtype, device=cfg.device, seed=cfg.seed)
        self.pool = PagedKVPool(self.model_cfg, cfg.num_gpu_blocks, cfg.tokens_per_block, dtype, cfg.device)
        self.namespace = self.pool.namespace(self.model.weights_id)
        self._output_ids_list = self.tokenizer.output_ids()
        self._output_ids = torch.tensor(self._output_ids_list, dtype=torch.long, device=self.model.device)
        self._warm_up()
        self.decode_graphs: DecodeGraphs | None = None
        if cfg.cuda_graphs and self.model.device.type == "cuda" and self.model._fused():
            self.decode_graphs = DecodeGraphs(self.model, self.pool.kv, cfg.num_gpu_blocks)
        self.client: KVClient | None = None
        if cfg.service:
            self.client = KVClient(cfg.service, self.namespace, self.pool.raw, client_name=client_name)
            try:
                self.client.connect(required=False)  # a missing daemon is a slower engine, not a broken one
            except BaseException:
                self.client.close()
                self.pool.close()
                raise
        self._wake = threading.Event()
        self.sched = Scheduler(cfg, client=self.client, hasher=BlockHasher(self.namespace),
                               block_bytes=self.pool.block_bytes, flops=self.model.prefill_flops, metrics=self.metrics,
                               before_store=getattr(self.pool.raw, "record_ready", lambda: None),
                               wake=self._wake.set)
        self._inbox: collections.deque[Seq] = collections.deque()
        self._lock = threading.Lock()  # orders submit() against stop()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False
        self._error: BaseException | None = None

    def _warm_up(self) -> None:
        """A prefill and a decode step into block 0 before any request: first calls pay for lazy
        initialisation (kernels, thread pools), which would otherwise land in the first request's TTFT
        and in the prefill-speed estimate behind load-or-recompute. Block 0's bytes are scratch: a
        request writes every position before it reads it."""
        tpb = self.cfg.tokens_per_block
        self.model.forward([0] * max(1, tpb - 1), 0, [0], self.pool.kv, last_only=True)
        self.model.forward([0], tpb - 1, [0], self.pool.kv, last_only=True).sum().item()

    # --- lifetime
    def start(self) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("engine is stopped")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        """Stop the loop, fail unfinished requests, flush write-through stores (briefly), close. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        self._fail_all(RuntimeError("engine stopped"))
        self.sched.close()
        concurrent.futures.wait(self.sched.pending_stores(), timeout=5.0)
        if self.client is not None:
            self.client.close()
        self.pool.close()

    def __enter__(self) -> Engine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- requests
    def submit(self, req: GenerationRequest, listener: Listener | None = None) -> RequestHandle:
        """Queue a request (any thread). ValueError for a request this engine can never serve.
        listener: see RequestHandle (called on the loop thread)."""
        vocab = self.model_cfg.vocab
        if not req.prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if any(not 0 <= t < vocab for t in req.prompt_ids):
            raise ValueError(f"prompt_ids must be token ids in [0, {vocab})")
        if req.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {req.max_tokens}")
        if req.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {req.temperature}")
        if req.kv_cache_ttl_seconds < 0:
            raise ValueError(f"kv_cache_ttl_seconds must be >= 0, got {req.kv_cache_ttl_seconds}")
        need = self.sched.blocks_needed(len(req.prompt_ids), req.max_tokens)
        if need > self.cfg.num_gpu_blocks:
            raise ValueError(f"prompt + max_tokens = {len(req.prompt_ids) + req.max_tokens} tokens need {need} KV "
                             f"blocks; the pool has {self.cfg.num_gpu_blocks} of {self.cfg.tokens_per_block} tokens")
        if not req.request_id:
            req.request_id = uuid.uuid4().hex
        handle = RequestHandle(req.request_id, listener)
        prompt = [int(t) for t in req.prompt_ids]
        seq = Seq(req=req, handle=handle, t_submit=time.monotonic(), tokens=prompt, prompt_len=len(prompt))
        with self._lock:
            if self._closed or self._error is not None:
                raise RuntimeError(f"engine is not running: {self._error or 'stopped'}")
            self._inbox.append(seq)
        self._wake.set()
        return handle

    def health(self) -> dict:
        s = self.sched
        return {"service_attached": bool(self.client is not None and self.client.attached),
                "running": len(s.running), "waiting": len(self._inbox) + len(s.waiting), "parked": len(s.parked)}

    # --- the loop
    def _run(self) -> None:
        try:
            loop = self.metrics.loop_seconds
            busy, idle = loop.labels("forward"), loop.labels("idle")
            sched = loop.labels("schedule")
            while not self._stopping:
                self._wake.clear()  # before the work: a wake-up during it makes the wait below return at once
                t0 = time.perf_counter()
                stepped, t_step = self._iteration()
                t1 = time.perf_counter()
                busy.inc(t_step)
                sched.inc(t1 - t0 - t_step)
                if not stepped:
                    wait = _IDLE_WAIT_S
                    deadline = self.sched.next_deadline()
                    if deadline is not None:
                        wait = min(wait, max(0.0, deadline - time.monotonic()))
                    self._wake.wait(wait)
                    idle.inc(time.perf_counter() - t1)
        except BaseException as exc:  # noqa: BLE001  # a broken loop must fail requests, not hang them
            log.exception("engine loop crashed")
            with self._lock:
                self._error = exc
            self._fail_all(RuntimeError(f"engine loop crashed: {exc!r}"))

    def _iteration(self) -> tuple[bool, float]:
        """One round: (whether a model step ran, so the loop should not sleep; seconds in forwards)."""
        s = self.sched
        while self._inbox:
            s.enqueue(self._inbox.popleft())
        s.reclaim()
        s.admit()
        s.prefetch()
        s.poll_parked()
        s.join_landing()
        stepped = bool(s.running)
        t_fwd = 0.0
        for seq in list(s.running):
            t0 = time.perf_counter()
            try:
                if seq.handle.cancelled:
                    self._finish(seq, "abort")
                    continue
                self._advance(seq)
            except Exception as exc:  # noqa: BLE001  # one bad request must not take the others down
                log.exception("request %s failed", seq.req.request_id)
                s.drop(seq)
                self.metrics.failed.inc()
                seq.handle._fail(exc)
            t_fwd += time.perf_counter() - t0
        m = self.metrics
        m.parked.set(len(s.parked))
        m.running.set(len(s.running))
        m.waiting.set(len(s.waiting))
        m.gpu_blocks_free.set(s.alloc.free_count)
        m.gpu_blocks_cached.set(len(s.radix))
        return stepped, t_fwd

    def _advance(self, seq: Seq) -> None:
        """One forward for one request: its remaining prompt (first token), or one decode token."""
        kv = self.pool.kv
        if seq.n_cached < seq.prompt_len:
            ctx, new = seq.n_cached, seq.tokens[seq.n_cached:]
            t0 = time.perf_counter()
            logits = self.model.forward(new, ctx, seq.table, kv, last_only=True)
            token = self._sample(seq, logits[-1])  # int(): waits for the device, so the timing is real
            seq.n_cached = seq.prompt_len
            dt = time.perf_counter() - t0
            self._fwd_prefill.observe(dt)
            self.sched.prefilled(seq, len(new), ctx, dt)
        else:
            t0 = time.perf_counter()
            if self.decode_graphs is not None:
                logits = self.decode_graphs.decode(seq.tokens[-1], seq.n_cached, seq.table)
            else:
                logits = self.model.forward(seq.tokens[-1:], seq.n_cached, seq.table, kv, last_only=True)
            token = self._sample(seq, logits[-1])
            self._fwd_decode.observe(time.perf_counter() - t0)
            seq.n_cached += 1
        self._emit(seq, token)

    def _sample(self, seq: Seq, row: torch.Tensor) -> int:
        t = seq.req.temperature
        if t > 0 and seq.generator is None:
            seq.generator = torch.Generator(device=row.device)
            if seq.req.seed is not None:
                seq.generator.manual_seed(seq.req.seed)
            else:
                seq.generator.seed()
        # Only ids the tokenizer prints (ByteTokenizer.output_ids): a random-weight model's vocabulary is
        # far larger, and an id that decodes to nothing reaches a client as an empty chunk (no TTFT).
        return self._output_ids_list[self.model.sample(row[self._output_ids], t, seq.generator)]

    def _emit(self, seq: Seq, token: int) -> None:
        now = time.monotonic()
        if not seq.t_first:
            seq.t_first = now
            self.metrics.ttft.observe(now - seq.t_submit)
        if token in seq.req.stop_ids:
            self._finish(seq, "stop")
            return
        seq.output.append(token)
        seq.tokens.append(token)
        seq.handle._push(token)
        if len(seq.output) >= seq.req.max_tokens:
            self._finish(seq, "length")

    def _finish(self, seq: Seq, reason: str) -> None:
        self.sched.finish(seq)
        result = GenerationResult(
            request_id=seq.req.request_id, prompt_tokens=seq.prompt_len, output_ids=list(seq.output),
            cached_tokens=seq.reused_blocks * self.cfg.tokens_per_block, cached_by_tier=dict(seq.cached_by_tier),
            ttft_s=seq.t_first - seq.t_submit, total_s=time.monotonic() - seq.t_submit,
            kv_source=seq.kv_source, finish_reason=reason, timings=_timings(seq))
        self.metrics.requests.labels(seq.kv_source, reason).inc()
        seq.handle._finish(result)

    def _fail_all(self, exc: BaseException) -> None:
        s = self.sched
        with self._lock:
            inbox, self._inbox = list(self._inbox), collections.deque()
        for seq in [*inbox, *s.waiting, *s.parked, *s.running]:
            if seq.phase is not Phase.DONE:
                s.drop(seq)
            seq.handle._fail(exc)


def _timings(seq: Seq) -> dict[str, float | int | str]:
    """GenerationResult.timings of a finished request (its keys: requests.GenerationResult.timings)."""
    ms = 1e3
    admit = seq.t_admit or seq.t_run
    out: dict[str, float | int | str] = {}
    if admit:
        out["queued"] = round((admit - seq.t_submit) * ms, 2)
        out["loading"] = round((seq.t_run - admit) * ms, 2) if seq.t_run else 0.0
    if seq.t_first and seq.t_run:
        out["to_first"] = round((seq.t_first - seq.t_run) * ms, 2)
    plan = {"load_host": 0, "load_disk": 0, "staged": 0, "plan": ""}
    plan.update(seq.plan)
    out.update(plan)
    return out

