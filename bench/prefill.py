#!/usr/bin/env python3
"""Prefill throughput and MFU of model_runner's model against plain PyTorch, same shape, same GPU.

    python bench/prefill.py --model 8b --lengths 2048 4096 8192 16384 --out DIR

Three implementations of one Llama-style prefill (bf16, the preset's shape, prompt from position 0):
- `engine`: model_runner.model.LlamaModel.forward over the paged KV pool (what the engine runs);
- `old`: the same model with the attention of the previous version (SDPA on 3-D tensors, a materialised
  boolean mask, K/V repeated per query head with repeat_interleave: the math kernel);
- `reference`: plain PyTorch with the same weights and no pool: RMSNorm, fused QKV, RoPE, SDPA on 4-D
  tensors with is_causal=True and enable_gqa=True, SwiGLU -- what a stock PyTorch Llama prefill does.
Also `engine+prefix`: the last 512 tokens of the prompt on top of the rest already in the pool (the
bottom-right causal path that a request with a loaded prefix takes).
Each figure is the best of --repeats timed runs after one warm-up. MFU = model FLOPs (prefill_flops:
matmuls, causal attention, one LM-head row) / seconds / the peak bf16 dense figure given (--peak-tflops,
989 for an H200 SXM). Prints a table and writes prefill.json; ratio = engine / reference.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from model_runner.config import PRESETS  # noqa: E402
from model_runner.kv_pool import PagedKVPool  # noqa: E402
from model_runner.model import LlamaModel, _apply_rope  # noqa: E402


class OldAttentionModel(LlamaModel):
    """The previous version's attention: 3-D SDPA, a boolean mask, repeat_interleave for GQA."""

    def _mask(self, pos: torch.Tensor, n: int, end: int) -> object:
        return torch.arange(end, device=self.device)[None, :] <= pos[:, None]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: object) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(q[0], k[0].repeat_interleave(group, dim=0),
                                             v[0].repeat_interleave(group, dim=0), attn_mask=mask)
        return out[None]


@torch.inference_mode()
def reference_prefill(m: LlamaModel, ids: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch over m's weights: no pool, SDPA 4-D is_causal + enable_gqa; last-token logits."""
    c = m.cfg
    n = ids.numel()
    pos = torch.arange(n, device=m.device)
    cos, sin = m._rope(pos)
    x = m.embed[ids]
    for lay in m.layers:
        h = m._rms_norm(x, lay.attn_norm)
        q, k, v = F.linear(h, lay.wqkv).split(
            [c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim], dim=-1)
        q = _apply_rope(q.view(n, c.n_heads, c.head_dim), cos, sin).transpose(0, 1)[None]
        k = _apply_rope(k.view(n, c.n_kv_heads, c.head_dim), cos, sin).transpose(0, 1)[None]
        v = v.view(n, c.n_kv_heads, c.head_dim).transpose(0, 1)[None]
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + F.linear(a[0].transpose(0, 1).reshape(n, -1), lay.wo)
        gate, up = F.linear(m._rms_norm(x, lay.mlp_norm), lay.w_gate_up).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, lay.w_down)
    return F.linear(m._rms_norm(x[-1:], m.final_norm), m.lm_head).float()


def timed(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="8b", choices=sorted(PRESETS))
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--old-max-len", type=int, default=16384, help="skip the old path above this length")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    cfg = PRESETS[args.model]
    tpb = 16
    dtype = torch.bfloat16
    m = LlamaModel(cfg, dtype=dtype, device="cuda", seed=0)
    old = OldAttentionModel.__new__(OldAttentionModel)
    old.__dict__.update(m.__dict__)  # the same weights, the old attention
    max_len = max(args.lengths)
    blocks = -(-max_len // tpb) + 1
    pool = PagedKVPool(cfg, blocks, tpb, dtype, "cuda")
    table = list(range(blocks))
    rows = []
    print(f"{'tokens':>7} {'impl':>14} {'ms':>9} {'tok/s':>9} {'TFLOP/s':>8} {'MFU':>6}", flush=True)
    for n in args.lengths:
        ids = torch.randint(0, 256, (n,), device="cuda")
        flops = m.prefill_flops(n, 0)
        impls = {
            "reference": lambda: reference_prefill(m, ids),
            "engine": lambda: m.forward(ids, 0, table, pool.kv, last_only=True),
        }
        if n <= args.old_max_len:
            impls["old"] = lambda: old.forward(ids, 0, table, pool.kv, last_only=True)
        tail = min(512, n // 4)
        results = {}
        for name, fn in impls.items():
            try:
                s = timed(fn, 1 if name == "old" else args.repeats)
            except torch.OutOfMemoryError as e:
                print(f"{n:>7} {name:>14} out of memory: {e}", flush=True)
                torch.cuda.empty_cache()
                continue
            results[name] = s
            rows.append({"tokens": n, "impl": name, "seconds": s, "tokens_per_s": n / s,
                         "tflops": flops / s / 1e12, "mfu": flops / s / (args.peak_tflops * 1e12)})
            r = rows[-1]
            print(f"{n:>7} {name:>14} {s * 1e3:9.1f} {r['tokens_per_s']:9.0f} {r['tflops']:8.1f} {r['mfu']:6.1%}",
                  flush=True)
        # A prefix in the pool (from the engine run above), the tail on top: the bottom-right causal path.
        m.forward(ids[: n - tail], 0, table, pool.kv)
        s = timed(lambda: m.forward(ids[n - tail:], n - tail, table, pool.kv, last_only=True), args.repeats)
        f_tail = m.prefill_flops(tail, n - tail)
        rows.append({"tokens": n, "impl": f"engine+prefix (last {tail})", "seconds": s, "tokens_per_s": tail / s,
                     "tflops": f_tail / s / 1e12, "mfu": f_tail / s / (args.peak_tflops * 1e12)})
        print(f"{n:>7} {'+prefix ' + str(tail):>14} {s * 1e3:9.1f} {tail / s:9.0f} {f_tail / s / 1e12:8.1f} "
              f"{f_tail / s / (args.peak_tflops * 1e12):6.1%}", flush=True)
        # The engine's logits against the reference's, same weights: the same model, not just as fast.
        a = m.forward(ids, 0, table, pool.kv, last_only=True)
        b = reference_prefill(m, ids)
        agree = int(a.argmax()) == int(b.argmax())
        err = float((a - b).abs().max() / b.abs().max())
        if "reference" in results and "engine" in results:
            ratio = results["reference"] / results["engine"]
            print(f"{n:>7} engine/reference throughput {ratio:.3f}  argmax agree {agree}  max rel logit diff {err:.2e}",
                  flush=True)
            rows.append({"tokens": n, "impl": "ratio", "engine_over_reference": ratio,
                         "old_over_reference": (results["reference"] / results["old"]) if "old" in results else None,
                         "argmax_agree": agree, "max_rel_logit_diff": err})
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0),
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "model": args.model,
           "peak_tflops": args.peak_tflops}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "prefill.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    print(json.dumps(env))
    pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
