"""LlamaModel: a Llama-style decoder with deterministic random weights over a paged KV pool.

Per layer: RMSNorm -> grouped-query attention with RoPE -> residual -> RMSNorm -> SwiGLU MLP ->
residual; then a final RMSNorm and an (untied) LM head. `forward` runs one sequence's new tokens
on top of its prefix already cached in the pool (see kv_pool.py for the layout): it writes the new
tokens' K (after RoPE) and V into their slots, then attends over the whole context read back from
the pool, so a prefix computed here and a prefix loaded into other blocks give the same result.

Attention is scaled_dot_product_attention on 4-D tensors with GQA through enable_gqa (no repeated
K/V). On a GPU in bf16/fp16 it is causal by is_causal (a whole prompt) or by a bottom-right causal
bias (new tokens after a cached prefix), both served by the flash kernel; on CPU and in float32 one
masked call for every shape, which keeps the CPU tests exact.

Weights: each part (embedding, layer i, head) draws from its own generator, seeded from
(seed, part name), in float32, scaled by 1/sqrt(fan_in), then cast to `dtype`. The generator
lives on the model's device: on CPU the weights are a function of the seed alone; on a GPU they
are generated there, part by part (an 8B model would take minutes on a CPU), and are
deterministic for a given GPU model and torch version only (CUDA's RNG output depends on the
launch grid). `weights_id` fingerprints the weights actually in use, for the KV namespace.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from model_runner.config import ModelConfig


@dataclass(slots=True)
class _Layer:
    attn_norm: torch.Tensor  # [hidden]
    wqkv: torch.Tensor  # [(n_heads + 2 * n_kv_heads) * head_dim, hidden]
    wo: torch.Tensor  # [hidden, n_heads * head_dim]
    mlp_norm: torch.Tensor  # [hidden]
    w_gate_up: torch.Tensor  # [2 * ffn, hidden]
    w_down: torch.Tensor  # [hidden, ffn]


class LlamaModel:
    def __init__(
        self, cfg: ModelConfig, *, dtype: torch.dtype | str = torch.float32, device: str = "cpu", seed: int = 0
    ) -> None:
        if cfg.n_heads % cfg.n_kv_heads or cfg.head_dim % 2:
            raise ValueError(f"{cfg.name}: n_heads must be a multiple of n_kv_heads and head_dim even")
        self.cfg = cfg
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.device = resolve_device(device)
        self.seed = seed
        c = cfg
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        self.embed = self._randn("embed", [(c.vocab, c.hidden, 1.0)])[0]
        self.layers: list[_Layer] = []
        for i in range(c.n_layers):
            wqkv, wo, w_gate_up, w_down = self._randn(f"layer{i}", [
                (q_dim + 2 * kv_dim, c.hidden, c.hidden),
                (c.hidden, q_dim, q_dim),
                (2 * c.ffn, c.hidden, c.hidden),
                (c.hidden, c.ffn, c.ffn),
            ])
            self.layers.append(_Layer(self._ones(c.hidden), wqkv, wo, self._ones(c.hidden), w_gate_up, w_down))
        self.final_norm = self._ones(c.hidden)
        self.lm_head = self._randn("head", [(c.vocab, c.hidden, c.hidden)])[0]
        half = torch.arange(0, c.head_dim, 2, dtype=torch.float32, device=self.device) / c.head_dim
        self._inv_freq = 1.0 / (c.rope_theta**half)
        self._weights_id: str | None = None

    # --- weights
    def _randn(self, part: str, shapes: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """(rows, cols, fan_in) -> N(0, 1/fan_in) tensors in dtype on device, from the part's own generator."""
        digest = hashlib.blake2b(f"{self.seed}/{part}".encode(), digest_size=8).digest()
        gen = torch.Generator(device=self.device).manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
        out = []
        for rows, cols, fan_in in shapes:
            w = torch.randn(rows, cols, generator=gen, dtype=torch.float32, device=self.device)
            out.append(w.mul_(fan_in**-0.5).to(self.dtype))
        return out

    def _ones(self, n: int) -> torch.Tensor:
        return torch.ones(n, dtype=self.dtype, device=self.device)

    @property
    def weights_id(self) -> str:
        """'<preset>-s<seed>-<16 hex>': a fingerprint of the first values of every weight tensor."""
        if self._weights_id is None:
            h = hashlib.blake2b(digest_size=8)
            tensors = [self.embed, self.lm_head] + [w for lay in self.layers for w in (lay.wqkv, lay.wo, lay.w_down)]
            for t in tensors:
                h.update(t.reshape(-1)[:64].float().cpu().numpy().tobytes())
            self._weights_id = f"{self.cfg.name}-s{self.seed}-{h.hexdigest()}"
        return self._weights_id

    # --- compute
    @torch.inference_mode()
    def forward(
        self,
        tokens: Sequence[int] | torch.Tensor,
        start_pos: int,
        block_table: Sequence[int],
        kv: torch.Tensor,
        *,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Run `tokens` at positions [start_pos, start_pos + T) of one sequence; float32 logits [T, vocab].

        Positions [0, start_pos) must already be in `kv` ([num_blocks, L, 2, tpb, kvh, hd]), position p
        in block block_table[p // tpb], slot p % tpb; the new tokens' K/V are written the same way, so
        block_table must cover start_pos + T. last_only: logits of the last token only, [1, vocab].
        """
        c = self.cfg
        ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1).to(self.device)
        n, end = ids.numel(), start_pos + ids.numel()
        tpb = self._check_kv(kv)
        n_blocks = -(-end // tpb)
        if n < 1 or start_pos < 0:
            raise ValueError(f"need at least one token at start_pos >= 0, got {n} at {start_pos}")
        if len(block_table) < n_blocks:
            raise ValueError(f"block_table has {len(block_table)} blocks, positions 0..{end - 1} need {n_blocks}")
        table = [int(b) for b in block_table[:n_blocks]]
        if not all(0 <= b < kv.shape[0] for b in table):
            raise IndexError(f"block_table {table} has ids outside the pool's 0..{kv.shape[0] - 1}")

        bt = torch.tensor(table, dtype=torch.long, device=self.device)
        pos = torch.arange(start_pos, end, device=self.device)
        slot_block, slot = bt[pos // tpb], pos % tpb
        cos, sin = self._rope(pos)
        mask = self._mask(pos, n, end)

        x = self.embed[ids]
        for i, lay in enumerate(self.layers):
            h = self._rms_norm(x, lay.attn_norm)
            q, k, v = F.linear(h, lay.wqkv).split(
                [c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim], dim=-1)
            q = _apply_rope(q.view(n, c.n_heads, c.head_dim), cos, sin)
            kv[:, i, 0][slot_block, slot] = _apply_rope(k.view(n, c.n_kv_heads, c.head_dim), cos, sin)
            kv[:, i, 1][slot_block, slot] = v.view(n, c.n_kv_heads, c.head_dim)
            # Read the whole context back from the pool (new tokens included): a sequence attends to the
            # same stored bytes whether its prefix was computed in this call, an earlier one, or loaded.
            ctx = kv[bt, i].transpose(0, 1).reshape(2, n_blocks * tpb, c.n_kv_heads, c.head_dim)[:, :end]
            attn = self._attend(q.transpose(0, 1)[None], ctx[0].transpose(0, 1)[None],
                                ctx[1].transpose(0, 1)[None], mask)
            x = x + F.linear(attn[0].transpose(0, 1).reshape(n, -1), lay.wo)
            gate, up = F.linear(self._rms_norm(x, lay.mlp_norm), lay.w_gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, lay.w_down)
        if last_only:
            x = x[-1:]
        return F.linear(self._rms_norm(x, self.final_norm), self.lm_head).float()

    __call__ = forward

    @torch.inference_mode()
    def decode_padded(self, ids: torch.Tensor, pos: torch.Tensor, table: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """One decode token of one sequence with static shapes, for a CUDA graph; float32 logits [1, vocab].

        ids, pos: one-element long tensors on the device (the token, its position); table: a long tensor
        of block ids padded to a fixed length (its entries past the sequence's blocks are any valid block
        ids: the positions they hold are masked). Writes the token's K/V into its slot as forward() does
        and attends over positions 0..pos of the padded context. Attention is two batched matmuls per KV
        head group (no repeated K/V) with a float32 softmax: the same result for the same (context,
        padding) on every call, close to forward()'s kernel but not its bit pattern.
        """
        c = self.cfg
        tpb = kv.shape[3]
        ctx = table.numel() * tpb
        group = c.n_heads // c.n_kv_heads
        slot_block, slot = table[pos // tpb], pos % tpb
        cos, sin = self._rope(pos)
        keep = torch.arange(ctx, device=self.device) <= pos
        bias = torch.zeros(ctx, dtype=torch.float32, device=self.device).masked_fill(~keep, float("-inf"))
        scale = c.head_dim**-0.5
        x = self.embed[ids]
        for i, lay in enumerate(self.layers):
            h = self._rms_norm(x, lay.attn_norm)
            q, k, v = F.linear(h, lay.wqkv).split(
                [c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim], dim=-1)
            q = _apply_rope(q.view(1, c.n_heads, c.head_dim), cos, sin)
            kv[:, i, 0][slot_block, slot] = _apply_rope(k.view(1, c.n_kv_heads, c.head_dim), cos, sin)
            kv[:, i, 1][slot_block, slot] = v.view(1, c.n_kv_heads, c.head_dim)
            keys = kv[table, i, 0].view(ctx, c.n_kv_heads, c.head_dim)  # gathered: [ctx, H_kv, D]
            values = kv[table, i, 1].view(ctx, c.n_kv_heads, c.head_dim)
            scores = torch.matmul(q.view(c.n_kv_heads, group, c.head_dim), keys.permute(1, 2, 0))
            probs = torch.softmax(scores.float() * scale + bias, dim=-1).to(x.dtype)  # [H_kv, group, ctx]
            attn = torch.matmul(probs, values.permute(1, 0, 2))  # [H_kv, group, D]
            x = x + F.linear(attn.reshape(1, -1), lay.wo)
            gate, up = F.linear(self._rms_norm(x, lay.mlp_norm), lay.w_gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, lay.w_down)
        return F.linear(self._rms_norm(x, self.final_norm), self.lm_head).float()

    @staticmethod
    def sample(logits_row: torch.Tensor, temperature: float, generator: torch.Generator | None = None) -> int:
        """Greedy (argmax) at temperature 0, else a draw from softmax(logits / temperature)."""
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if temperature == 0:
            return int(torch.argmax(logits_row))
        probs = torch.softmax(logits_row.float() / temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator))

    def prefill_flops(self, n_tokens: int, ctx: int = 0) -> float:
        """FLOPs to compute n_tokens on top of ctx cached tokens: matmuls, causal attention, one LM-head row."""
        c = self.cfg
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        linear = 2.0 * n_tokens * c.n_layers * (c.hidden * (2 * q_dim + 2 * kv_dim) + 3 * c.hidden * c.ffn)
        attended = n_tokens * ctx + n_tokens * (n_tokens + 1) / 2  # sum of context lengths of the new tokens
        attention = 4.0 * c.n_layers * q_dim * attended  # QK^T and PV
        return linear + attention + 2.0 * c.hidden * c.vocab

    # --- attention
    def _fused(self) -> bool:
        """The fused (flash) kernel path: CUDA in half precision. Elsewhere one exact path, the same
        masked kernel for every call, so a prefix computed and a prefix loaded give the same floats."""
        return self.device.type == "cuda" and self.dtype in (torch.bfloat16, torch.float16)

    def _mask(self, pos: torch.Tensor, n: int, end: int) -> object:
        """The causal mask of n new tokens at the end of `end` positions, in the form _attend takes."""
        if self._fused():
            if n == 1:
                return None  # one new token attends to everything
            if n == end:
                return "causal"
            return causal_lower_right(n, end)  # dispatches to flash's bottom-right causal kernel
        return torch.arange(end, device=self.device)[None, :] <= pos[:, None]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: object) -> torch.Tensor:
        """q [1, H, n, D], k and v [1, H_kv, ctx, D] -> [1, H, n, D]. GQA by enable_gqa: K/V are never
        repeated per query head, so the flash kernel reads each KV head once."""
        if isinstance(mask, str):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # type: ignore[arg-type]

    # --- helpers
    def _check_kv(self, kv: torch.Tensor) -> int:
        c = self.cfg
        if kv.dim() != 6 or kv.shape[1:3] != (c.n_layers, 2) or kv.shape[4:] != (c.n_kv_heads, c.head_dim):
            raise ValueError(f"kv shape {tuple(kv.shape)} is not [blocks, {c.n_layers}, 2, tpb, "
                             f"{c.n_kv_heads}, {c.head_dim}]")
        if kv.dtype != self.dtype or kv.device != self.device:
            raise ValueError(f"kv is {kv.dtype} on {kv.device}, the model is {self.dtype} on {self.device}")
        return kv.shape[3]

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps)
        return (xf * weight.float()).to(x.dtype)

    def _rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] in float32 (rotate-half convention, as in HF Llama)."""
        freqs = pos.float()[:, None] * self._inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
        return emb.cos(), emb.sin()


def resolve_device(device: str | torch.device) -> torch.device:
    """"cuda" -> "cuda:<current>", so it compares equal to the device of the tensors made there."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)
