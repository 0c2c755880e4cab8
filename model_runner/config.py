"""Model shapes and engine settings of the reference engine.

Presets: `tiny` (CPU tests, float32), and the shapes of a 1B and an 8B Llama-style model
(bf16 on a GPU). Weights are deterministic random numbers from a seed: the point is real KV
of the right shape and a real compute cost, not meaningful text.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.n_layers * 2 * self.n_kv_heads * self.head_dim * dtype_bytes


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig("tiny", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn=128, vocab=512),
    "1b": ModelConfig("1b", n_layers=16, hidden=2048, n_heads=32, n_kv_heads=8, head_dim=64, ffn=8192, vocab=128256),
    "8b": ModelConfig("8b", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8, head_dim=128, ffn=14336, vocab=128256),
}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "tiny"  # a PRESETS key
    seed: int = 0  # weights seed; part of the KV namespace
    dtype: str = "float32"  # "float32" | "bfloat16" | "float16"
    device: str = "cpu"  # "cpu" | "cuda" | "cuda:N"
    tokens_per_block: int = 16
    num_gpu_blocks: int = 256  # GPU-tier KV pool size, in blocks
    max_running: int = 8  # requests decoding at once
    max_prefill_tokens: int = 0  # prompt tokens one step admits for computing (>= 1 request); 0: no limit
    prefetch_reqs: int = 4  # queued requests to prefetch for; 0 disables
    write_through: bool = True  # store finished prefills to the service right away
    load_policy: str = "auto"  # "auto": load or recompute by measured cost | "always" | "never"
    cuda_graphs: bool = True  # decode steps from CUDA graphs (CUDA, bf16/fp16 only); False: eager, as --enforce-eager
    service: str = ""  # e.g. "unix:///run/kvservice/kvservice.sock"; empty: no service
