"""DecodeGraphs: one decode step of one sequence replayed from a CUDA graph, per context bucket.

An eager decode step of the 8B shape is ~1,600 small kernels, each launched from Python: ~30 ms of the
loop thread's CPU for ~4 ms of GPU work, and slower still whenever another thread or process wants the
same core (the GIL, a shared vCPU). A production engine captures its decode step in CUDA graphs
(vLLM, SGLang); so does this one. LlamaModel.decode_padded has static shapes -- the token, its
position and a block table padded to a bucket length, all in fixed device buffers -- so one graph per
bucket replays it with one launch. Buckets: powers of two up to 256 blocks, then every 256 blocks, to
the pool's size (a sequence cannot hold more blocks than the pool): the padding costs at most 2x the
gather of a short context and 1/8 of a long one.

A sequence's step always runs in the bucket its context length picks, so its tokens do not depend on
what else the engine runs (no cross-request batching). The graphs share one memory pool (they never
replay concurrently) and are captured from the largest bucket down, so the pool is the largest
bucket's intermediates (for the 8B shape at 4k blocks: its gathered K and V of one layer, 512 MiB).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence

import torch

from model_runner.model import LlamaModel

log = logging.getLogger(__name__)

_POW2_UNTIL = 256  # blocks: buckets double up to here, then grow by this many


def decode_buckets(max_blocks: int) -> list[int]:
    """Ascending padded table lengths (in blocks), the last >= max_blocks."""
    if max_blocks < 1:
        raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
    out, nb = [], 1
    while True:
        out.append(nb)
        if nb >= max_blocks:
            return out
        nb = nb * 2 if nb < _POW2_UNTIL else nb + _POW2_UNTIL


class DecodeGraphs:
    def __init__(self, model: LlamaModel, kv: torch.Tensor, max_blocks: int) -> None:
        """Capture one graph per bucket (a few seconds for the 8B shape: call it at start-up). Block 0
        of kv is written as scratch during capture (as the engine's warm-up does)."""
        if model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model, this one is on {model.device}")
        self._model, self._kv = model, kv
        self._tpb = kv.shape[3]
        self.buckets = decode_buckets(max_blocks)
        dev = model.device
        self._inputs = torch.zeros(2 + self.buckets[-1], dtype=torch.long, device=dev)  # token, pos, table...
        self._ids, self._pos, self._table = self._inputs[0:1], self._inputs[1:2], self._inputs[2:]
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up off the capture (lazy init, cuBLAS workspaces)
            for nb in (self.buckets[-1], self.buckets[0]):
                model.decode_padded(self._ids, self._pos, self._table[:nb], kv)
        torch.cuda.current_stream(dev).wait_stream(side)
        torch.cuda.synchronize(dev)
        for nb in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[nb] = model.decode_padded(self._ids, self._pos, self._table[:nb], kv)
            self._graphs[nb] = graph
        torch.cuda.synchronize(dev)
        self.capture_seconds = time.perf_counter() - t0
        log.info("captured %d decode graphs (up to %d blocks) in %.1f s", len(self.buckets), self.buckets[-1],
                 self.capture_seconds)

    def bucket(self, n_blocks: int) -> int:
        """The padded length a context of n_blocks blocks runs at."""
        i = bisect.bisect_left(self.buckets, n_blocks)
        if i == len(self.buckets):
            raise ValueError(f"a context of {n_blocks} blocks is past the largest graph ({self.buckets[-1]})")
        return self.buckets[i]

    def decode(self, token: int, pos: int, block_table: Sequence[int]) -> torch.Tensor:
        """The logits [1, vocab] (float32, valid until the next call) of `token` at position `pos` of
        the sequence whose blocks are block_table (covering pos), its K/V written into the pool."""
        need = pos // self._tpb + 1
        if pos < 0 or len(block_table) < need:
            raise ValueError(f"block_table has {len(block_table)} blocks, position {pos} needs {need}")
        nb = self.bucket(need)
        host = torch.tensor([token, pos, *block_table[:need]], dtype=torch.long)
        if need and not 0 <= int(host[2:].min()) <= int(host[2:].max()) < self._kv.shape[0]:
            raise IndexError(f"block_table has ids outside the pool's 0..{self._kv.shape[0] - 1}")
        self._inputs[: 2 + need].copy_(host)  # blocks past `need` keep old (valid) ids: masked
        self._graphs[nb].replay()
        return self._logits[nb]
