"""What a request is, on both sides of the engine: the caller's GenerationRequest, RequestHandle and
GenerationResult, and the loop thread's Seq (one request's scheduling state). Engine and Scheduler
both import from here and not from each other.

kv_source of a result: "none" (nothing cached), "gpu" (GPU-tier hit only), "loaded" (blocks
loaded from the service), or "recomputed:<why>" for a prefix the service could not usefully
serve: "cheaper" (recomputing was estimated faster), "unstaged" (disk blocks past what its prefetch staged), "load-failed", "service-down".
"""

from __future__ import annotations

import concurrent.futures
import enum
import queue
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from kvwire.ids import BlockHash
from engine_client.results import LoadResults
from model_runner.prefetcher import PrefetchJob
from model_runner.radix import BlockId, Node

_END = object()  # closes a handle's token stream


@dataclass(slots=True)
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int = 16
    temperature: float = 0.0
    seed: int | None = None
    kv_cache_ttl_seconds: float = 0.0
    stop_ids: tuple[int, ...] = ()  # end generation; the stop token itself is not part of output_ids
    request_id: str = ""  # filled with a uuid when empty


@dataclass(slots=True)
class GenerationResult:
    request_id: str
    prompt_tokens: int
    output_ids: list[int]
    cached_tokens: int  # prompt tokens whose KV was reused, not recomputed
    cached_by_tier: dict[str, int]  # {"gpu": n, "host": n, "disk": n}
    ttft_s: float
    total_s: float
    kv_source: str  # "none" | "gpu" | "loaded" | "recomputed:" + "cheaper" | "unstaged" | "load-failed" | "service-down"
    finish_reason: str  # "length" | "stop" (a stop id) | "abort" (cancelled)
    # Where its time went (ms, from submit): queued (until admitted), loading (admitted -> its Load landed,
    # 0 without one), to_first (admitted or landed -> first token: its prefill and what ran beside it);
    # and what admission planned: load_host / load_disk blocks (by the answer it planned from),
    # staged (blocks its prefetch had staged by then), plan (the cost model's reason, "" if no plan), unstaged
    # (disk blocks past its staged prefix, recomputed), est_load_all_ms / est_recompute_all_ms / disk_fit (what
    # the cost model expected of loading vs recomputing the whole stored prefix); with a prefetch job:
    # prefetch_wait (submit -> its first Prefetch, or -> admission if none was sent: behind other jobs),
    # prefetch_first (its first Prefetch -> the first answer, -1 if none by admission), prefetch_answered
    # (chunks answered by then), prefetch_paused (after room refusals), prefetch_refusals, prefetch_read
    # (blocks it read from disk).
    timings: dict[str, float | int | str] = field(default_factory=dict)


Listener = Callable[[int | None, GenerationResult | None, BaseException | None], None]


class RequestHandle:
    """The caller's side of one request: a token stream and a result, and cancel().

    `listener`, when given, is called on the engine's loop thread with (token, None, None) for each
    output token, then (None, result, None) or (None, None, error): an async server hands these to
    its event loop (call_soon_threadsafe) instead of parking a thread per request on stream()."""

    def __init__(self, request_id: str, listener: Listener | None = None) -> None:
        self.request_id = request_id
        self._listener = listener
        self._tokens: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._result: concurrent.futures.Future[GenerationResult] = concurrent.futures.Future()
        self.cancelled = False

    def cancel(self) -> None:
        """Ask the engine to end the request at its next step (finish_reason "abort"); any thread."""
        self.cancelled = True

    def stream(self) -> Iterator[int]:
        """Output token ids as they are produced; raises the request's error if it failed."""
        while True:
            item = self._tokens.get()
            if item is _END:
                break
            yield item  # type: ignore[misc]
        exc = self._result.exception()
        if exc is not None:
            raise exc

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Blocks until the request finished (TimeoutError after `timeout` seconds)."""
        return self._result.result(timeout)

    def done(self) -> bool:
        return self._result.done()

    # --- loop side
    def _push(self, token: int) -> None:
        self._tokens.put(token)
        if self._listener is not None:
            self._listener(token, None, None)

    def _finish(self, result: GenerationResult) -> None:
        self._tokens.put(_END)
        self._result.set_result(result)
        if self._listener is not None:
            self._listener(None, result, None)

    def _fail(self, exc: BaseException) -> None:
        if not self._result.done():
            self._tokens.put(_END)
            self._result.set_exception(exc)
            if self._listener is not None:
                self._listener(None, None, exc)


class Phase(enum.Enum):
    WAITING = "waiting"  # queued; holds no blocks
    PARKED = "parked"  # blocks allocated, a Load into them in flight
    RUNNING = "running"  # prefilling or decoding
    DONE = "done"  # finished or failed; holds nothing


@dataclass(slots=True)
class PendingLoad:
    future: concurrent.futures.Future[LoadResults]
    tiers: list[int]  # Lookup's tier of each block asked for
    t_start: float
    t_done: float = 0.0  # set by the future's callback, so queueing on the loop thread is not counted
    t_expect: float = 0.0  # when the cost model expects it to land (0: no estimate)


@dataclass(slots=True, eq=False)
class Seq:
    """One request's state, owned by the loop thread."""

    req: GenerationRequest
    handle: RequestHandle
    t_submit: float
    tokens: list[int]  # prompt, then every output token fed back
    prompt_len: int
    prompt_hashes: list[BlockHash] = field(default_factory=list)  # the prompt's full blocks
    phase: Phase = Phase.WAITING
    lookup: concurrent.futures.Future[tuple[int, list[int]]] | None = None  # sent at enqueue, read at admission
    lookup_from: int = 0  # the block the in-flight Lookup starts at
    lookup_sent: float = 0.0  # monotonic time the Lookup was sent (its patience counts from here)
    lookup_wait_since: float = 0.0  # when admission first waited for the answer (0: it did not)
    lookup_prev: tuple[concurrent.futures.Future[tuple[int, list[int]]], int] | None = None  # (answer, from)
    lookup_refreshed: bool = False  # a stale answer was asked again once, when the request reached the head
    table: list[BlockId] = field(default_factory=list)  # block of each position // tpb, whole budget
    held: list[Node] = field(default_factory=list)  # radix nodes this request holds a reference on
    private: set[BlockId] = field(default_factory=set)  # blocks this request frees at the end
    n_cached: int = 0  # leading tokens whose KV is in the pool
    reused_blocks: int = 0  # leading prompt blocks not computed here (GPU hit or loaded)
    cached_by_tier: dict[str, int] = field(default_factory=lambda: {"gpu": 0, "host": 0, "disk": 0})
    kv_source: str = "none"
    load: PendingLoad | None = None
    prefetched: bool = False  # prefetch() decided about this request (once)
    prefetch_job: PrefetchJob | None = None  # staging its disk blocks while it is queued
    prefetch_from: int = 0  # the prompt block the job starts at (its staged blocks follow)
    planned_prefill: int = 0  # prompt tokens admission left to compute (not a GPU hit, not loaded)
    stored_blocks: int = 0  # leading full blocks already written through
    output: list[int] = field(default_factory=list)
    t_first: float = 0.0
    t_admit: float = 0.0  # left the queue (parked or running)
    t_run: float = 0.0  # started running (after its Load landed, if it had one)
    plan: dict[str, int | float | str] = field(default_factory=dict)  # load_host, load_disk, staged, plan, ...
    generator: torch.Generator | None = None
