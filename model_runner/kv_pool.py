"""PagedKVPool: the engine's paged KV cache, allocated so the kvservice daemon can map it.

The bytes live in an engine_client pool (ShmKVPool on CPU, CudaKVPool on a GPU) whose
`.description()` is what the engine registers with the daemon. Layout is block-contiguous: block b
is one row of block_bytes, and inside it the elements are [n_layers, 2 (K, V), tokens_per_block,
n_kv_heads, head_dim] of the KV dtype (K after RoPE). `kv` is that typed, zero-copy view:

    kv[block, layer, 0 (K) | 1 (V), slot, kv_head, :]

so a block moved byte for byte by the daemon means the same KV wherever it lands.
"""

from __future__ import annotations

from typing import Any

import torch

from engine_client.namespace import Namespace
from engine_client.shm_pool import ShmKVPool
from model_runner.config import ModelConfig
from model_runner.model import resolve_device

# The namespace layout string: block-contiguous rows of [L, 2, T, H_kv, D] (dims in that order).
LAYOUT = "block-contiguous:L2THD"


def dtype_name(dtype: torch.dtype) -> str:
    """"float32", "bfloat16", ...: the KV dtype as the namespace spells it."""
    return str(dtype).removeprefix("torch.")


class PagedKVPool:
    def __init__(
        self, cfg: ModelConfig, num_blocks: int, tokens_per_block: int, dtype: torch.dtype, device: str = "cpu"
    ) -> None:
        if num_blocks < 1 or tokens_per_block < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and tokens_per_block ({tokens_per_block}) must be >= 1")
        self.cfg = cfg
        self.dtype = dtype
        self.device = resolve_device(device)
        self._num_blocks = num_blocks
        self._tokens_per_block = tokens_per_block
        elem = torch.empty((), dtype=dtype).element_size()
        self._block_shape = (cfg.n_layers, 2, tokens_per_block, cfg.n_kv_heads, cfg.head_dim)
        self._block_bytes = cfg.n_layers * 2 * tokens_per_block * cfg.n_kv_heads * cfg.head_dim * elem
        self._raw: Any = _allocate(num_blocks, self._block_bytes, cfg.n_layers, self.device)
        nbytes = num_blocks * self._block_bytes
        buf = self._raw.buffer[:nbytes]  # the segment may be rounded up past the pool
        if buf.data_ptr() % elem:
            raise ValueError(f"pool buffer at {buf.data_ptr():#x} is not {elem}-byte aligned for {dtype}")
        if self.device.type == "cuda":
            # cudaMalloc hands back whatever an earlier allocation left (a shm segment starts zeroed):
            # bit patterns that read as NaN or Inf in half precision. Slots no request wrote are read
            # anyway where attention masks them by adding -inf (the padded CUDA-graph decode,
            # LlamaModel.decode_padded), and NaN + -inf is NaN: one such slot turns a decode step's
            # logits to garbage (H100, an engine started after another in the same process).
            # Finished before any daemon copy can land in the pool (registration comes after).
            buf.zero_()
            torch.cuda.synchronize(self.device)
        self._bytes: torch.Tensor | None = buf.view(num_blocks, self._block_bytes)
        self._kv: torch.Tensor | None = buf.view(dtype).view(num_blocks, *self._block_shape)

    # --- shape
    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def tokens_per_block(self) -> int:
        return self._tokens_per_block

    @property
    def block_bytes(self) -> int:
        """n_layers * 2 * tokens_per_block * n_kv_heads * head_dim * element size."""
        return self._block_bytes

    @property
    def kv(self) -> torch.Tensor:
        """[num_blocks, n_layers, 2, tokens_per_block, n_kv_heads, head_dim], aliasing the pool's bytes."""
        if self._kv is None:
            raise ValueError("PagedKVPool is closed")
        return self._kv

    @property
    def raw(self) -> Any:
        """The engine_client pool (ShmKVPool or CudaKVPool); register `raw.description()` with the daemon."""
        return self._raw

    def namespace(self, model_id: str, salt: str = "") -> Namespace:
        """The namespace of these KV bytes; model_id must pin the weights (see LlamaModel.weights_id)."""
        return Namespace(
            model_id=model_id,
            kv_dtype=dtype_name(self.dtype),
            tokens_per_block=self._tokens_per_block,
            layout=LAYOUT,
            tp_rank=0,
            tp_size=1,
            cache_salt=salt,
        )

    def block_bytes_of(self, block_id: int) -> bytes:
        """A copy of one block's bytes (for tests and debugging; syncs with the device)."""
        if self._bytes is None:
            raise ValueError("PagedKVPool is closed")
        if not 0 <= block_id < self._num_blocks:
            raise IndexError(f"block id {block_id} is out of range: the pool has blocks 0..{self._num_blocks - 1}")
        return self._bytes[block_id].cpu().numpy().tobytes()

    # --- lifetime
    def close(self) -> None:
        """Drop the views and release the pool (unlinks the shm segment we created). Idempotent."""
        if self._kv is None:
            return
        self._kv = self._bytes = None
        if isinstance(self._raw, ShmKVPool):
            self._raw.close()
            if self._raw.owner:
                self._raw.unlink()
        elif hasattr(self._raw, "close"):
            self._raw.close()

    def __enter__(self) -> PagedKVPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _allocate(num_blocks: int, block_bytes: int, n_layers: int, device: torch.device) -> Any:
    if device.type == "cpu":
        return ShmKVPool(num_blocks, block_bytes, layout="block-contiguous", num_layers=n_layers)
    if device.type != "cuda":
        raise ValueError(f"unsupported KV pool device {device}; expected cpu or cuda[:N]")
    try:
        from engine_client.cuda_pool import CudaKVPool  # lazy: CPU hosts never need CUDA IPC
    except ImportError as exc:
        raise RuntimeError(
            f"a KV pool on {device} needs engine_client.cuda_pool.CudaKVPool, which failed to import: {exc}"
        ) from exc
    return CudaKVPool(num_blocks, block_bytes, device=str(device))
