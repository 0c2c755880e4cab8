"""The reference engine's model, paged KV pool and tokenizer (CPU, tiny preset, float32)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine_client import ShmKVPool
from model_runner.config import PRESETS
from model_runner.kv_pool import LAYOUT, PagedKVPool
from model_runner.model import LlamaModel
from model_runner.tokenizer import ByteTokenizer

CFG = PRESETS["tiny"]
TPB = 4
PROMPT = ByteTokenizer().encode("The quick brown fox jumps", add_bos=True)  # 26 tokens
DECODE_STEPS = 20
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return LlamaModel(CFG, seed=0)


@pytest.fixture
def pool():
    with PagedKVPool(CFG, num_blocks=64, tokens_per_block=TPB, dtype=torch.float32, device="cpu") as p:
        yield p


def blocks_for(n_tokens: int) -> int:
    return -(-n_tokens // TPB)


def greedy(model: LlamaModel, kv: torch.Tensor, table: list[int], logits: torch.Tensor, pos: int) -> list[int]:
    """DECODE_STEPS greedy tokens, starting from the logits of the token at pos - 1."""
    out = []
    for _ in range(DECODE_STEPS):
        tok = model.sample(logits[-1], 0.0)
        out.append(tok)
        logits = model.forward([tok], pos, table, kv)
        pos += 1
    return out


def full_prefill(model: LlamaModel, kv: torch.Tensor, table: list[int]) -> tuple[torch.Tensor, list[int]]:
    logits = model.forward(PROMPT, 0, table, kv)
    return logits, greedy(model, kv, table, logits, len(PROMPT))


@pytest.mark.parametrize("split", [8, 11], ids=["block-aligned", "mid-block"])
def test_prefill_on_cached_prefix_matches_full_prefill(model: LlamaModel, pool: PagedKVPool, split: int) -> None:
    """Scenario: a prompt prefilled in one call, and the same prompt prefilled as a prefix and then the
    rest on top of the cached prefix (at a block boundary or mid-block), give the same logits for the
    rest and the same 20 greedy tokens; the blocks are scattered, not in order."""
    n_blocks = blocks_for(len(PROMPT) + DECODE_STEPS)
    table_full = list(range(0, 2 * n_blocks, 2))
    table_split = list(range(2 * n_blocks + 1, 1, -2))[:n_blocks]
    assert not set(table_full) & set(table_split)

    logits_full, tokens_full = full_prefill(model, pool.kv, table_full)
    assert logits_full.shape == (len(PROMPT), CFG.vocab) and logits_full.dtype == torch.float32

    model.forward(PROMPT[:split], 0, table_split, pool.kv)
    logits_rest = model.forward(PROMPT[split:], split, table_split, pool.kv)
    torch.testing.assert_close(logits_rest, logits_full[split:], atol=1e-5, rtol=0)
    assert greedy(model, pool.kv, table_split, logits_rest, len(PROMPT)) == tokens_full

    # The cached prefix really is attended to: the same rest on a different prefix gives other logits.
    other = list(range(40, 40 + n_blocks))
    model.forward([t ^ 1 for t in PROMPT[:split]], 0, other, pool.kv)
    assert not torch.allclose(model.forward(PROMPT[split:], split, other, pool.kv), logits_rest, atol=1e-3)


def test_prefix_blocks_moved_to_other_block_ids_continue_identically(model: LlamaModel, pool: PagedKVPool) -> None:
    """Scenario: the prompt's full prefix blocks are copied byte for byte to other block ids through a second
    mapping of the shared segment (as the daemon loads them into different blocks) and the originals are
    zeroed; the rest of the prompt and 20 greedy tokens computed on the moved blocks match a from-scratch run."""
    n_blocks = blocks_for(len(PROMPT) + DECODE_STEPS)
    logits_ref, tokens_ref = full_prefill(model, pool.kv, list(range(n_blocks)))

    prefix_blocks = len(PROMPT) // TPB
    cached = len(PROMPT) - len(PROMPT) % TPB
    src = [30 + 3 * i for i in range(prefix_blocks)]
    model.forward(PROMPT[:cached], 0, src, pool.kv)

    dst = [63 - i for i in range(prefix_blocks)]
    daemon = ShmKVPool.attach(pool.raw.name, pool.num_blocks, pool.block_bytes)
    try:
        zeros = bytes(pool.block_bytes)
        for s, d in zip(src, dst):
            daemon.write_block(d, daemon.read_block(s))
            daemon.write_block(s, zeros)
    finally:
        daemon.close()
    assert pool.block_bytes_of(src[0]) == zeros and pool.block_bytes_of(dst[0]) != zeros

    table = dst + list(range(n_blocks, 2 * n_blocks - prefix_blocks))
    logits = model.forward(PROMPT[cached:], cached, table, pool.kv)
    torch.testing.assert_close(logits, logits_ref[cached:], atol=1e-5, rtol=0)
    assert greedy(model, pool.kv, table, logits, len(PROMPT)) == tokens_ref


@pytest.mark.parametrize("pad", [0, 5], ids=["exact-table", "padded-table"])
def test_static_shape_decode_matches_forward_and_writes_the_same_kv(model: LlamaModel, pool: PagedKVPool,
                                                                   pad: int) -> None:
    """Scenario: the prompt is prefilled, then 20 greedy tokens are decoded twice from the same prefix: with
    forward() and with decode_padded (the CUDA-graph body: one-element tensors, a block table padded with
    ids of other blocks). The logits agree to float32 rounding, the greedy tokens are the same, and so do the
    decoded tokens' K/V written into the pool (to rounding: the attention's reduction order differs)."""
    n_blocks = blocks_for(len(PROMPT) + DECODE_STEPS)
    ref_table, table = list(range(n_blocks)), list(range(n_blocks, 2 * n_blocks))
    tokens = []
    for tb in (ref_table, table):
        logits = model.forward(PROMPT, 0, tb, pool.kv)
        tokens.append([model.sample(logits[-1], 0.0)])
    padded = torch.tensor(table + [0] * pad + [63] * pad, dtype=torch.long)
    pos = len(PROMPT)
    for _ in range(DECODE_STEPS - 1):
        ref = model.forward([tokens[0][-1]], pos, ref_table, pool.kv)
        got = model.decode_padded(torch.tensor([tokens[1][-1]]), torch.tensor([pos]), padded, pool.kv)
        assert got.shape == (1, CFG.vocab)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        tokens[0].append(model.sample(ref[-1], 0.0))
        tokens[1].append(model.sample(got[-1], 0.0))
        pos += 1
    assert tokens[0] == tokens[1]
    full = (pos // TPB) * TPB  # blocks fully written by now
    for i in range(full // TPB):
        torch.testing.assert_close(pool.kv[table[i]], pool.kv[ref_table[i]], atol=1e-5, rtol=1e-5)


def test_same_seed_gives_bit_identical_logits_and_another_seed_does_not(model: LlamaModel, pool: PagedKVPool) -> None:
    """Scenario: a second model built with the same seed gives bit-identical logits and the same weights_id;
    a model with another seed gives different logits and a different weights_id."""
    table = list(range(blocks_for(len(PROMPT))))
    ref = model.forward(PROMPT, 0, table, pool.kv)
    twin, other = LlamaModel(CFG, seed=0), LlamaModel(CFG, seed=1)
    assert torch.equal(twin.forward(PROMPT, 0, table, pool.kv), ref)
    assert twin.weights_id == model.weights_id
    assert not torch.allclose(other.forward(PROMPT, 0, table, pool.kv), ref, atol=1e-2)
    assert other.weights_id != model.weights_id


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_layout_namespace_and_a_second_process_sees_kv_writes(dtype: torch.dtype) -> None:
    """Scenario: the pool's typed view has the block-contiguous [L, 2, T, H_kv, D] layout, its namespace
    describes it, and another process that attaches the segment by name reads the bytes written through
    `kv`; closing the pool removes the segment."""
    pool = PagedKVPool(CFG, num_blocks=8, tokens_per_block=TPB, dtype=dtype, device="cpu")
    elem = torch.empty((), dtype=dtype).element_size()
    assert pool.block_bytes == CFG.n_layers * 2 * TPB * CFG.n_kv_heads * CFG.head_dim * elem
    assert pool.kv.shape == (8, CFG.n_layers, 2, TPB, CFG.n_kv_heads, CFG.head_dim) and pool.kv.dtype == dtype
    assert pool.raw.description().num_blocks == 8
    assert pool.raw.description().regions[0].block_bytes == pool.block_bytes

    ns = pool.namespace("tiny-s0", salt="tenant-a")
    assert (ns.model_id, ns.kv_dtype, ns.tokens_per_block, ns.layout) == ("tiny-s0", str(dtype)[6:], TPB, LAYOUT)
    assert (ns.tp_rank, ns.tp_size, ns.cache_salt) == (0, 1, "tenant-a")

    # Layer 1's V at slot 2 of block 5 is where the block-contiguous layout says it is.
    pool.kv[5, 1, 1, 2] = torch.arange(CFG.n_kv_heads * CFG.head_dim, dtype=dtype).view(CFG.n_kv_heads, -1)
    offset = ((1 * 2 + 1) * TPB + 2) * CFG.n_kv_heads * CFG.head_dim * elem
    row = pool.block_bytes_of(5)
    written = pool.kv[5, 1, 1, 2].view(torch.uint8).numpy().tobytes()  # numpy has no bfloat16
    assert row[offset : offset + len(written)] == written

    script = (
        "import hashlib, sys\n"
        "from engine_client import ShmKVPool\n"
        "p = ShmKVPool.attach(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))\n"
        "print(hashlib.sha256(p.read_block(5)).hexdigest())\n"
        "p.close()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", script, pool.raw.name, "8", str(pool.block_bytes)],
                         env=env, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == hashlib.sha256(row).hexdigest()

    name = pool.raw.name
    pool.close()
    with pytest.raises(ValueError):
        pool.kv
    with pytest.raises(FileNotFoundError):
        ShmKVPool.attach(name, 8, pool.block_bytes)


def test_forward_rejects_a_block_table_that_does_not_cover_the_tokens(model: LlamaModel, pool: PagedKVPool) -> None:
    """Scenario: 9 tokens at 4 tokens per block need 3 blocks; a table of 2 is refused before anything is written."""
    with pytest.raises(ValueError, match="block_table"):
        model.forward(list(range(9)), 0, [0, 1], pool.kv)
    with pytest.raises(IndexError):
        model.forward(list(range(4)), 0, [64], pool.kv)


def test_sampling_and_flops_estimate(model: LlamaModel) -> None:
    """Scenario: temperature 0 is argmax; a seeded generator makes sampling reproducible; the prefill cost
    estimate grows with the cached context the new tokens attend to."""
    row = torch.tensor([0.1, 2.0, -1.0, 1.9])
    assert model.sample(row, 0.0) == 1
    draws = [[model.sample(row, 1.0, g) for _ in range(20)] for g in (torch.Generator().manual_seed(7),
                                                                      torch.Generator().manual_seed(7))]
    assert draws[0] == draws[1] and len(set(draws[0])) > 1
    assert model.prefill_flops(16, ctx=1000) > model.prefill_flops(16, ctx=0) > 0


def test_byte_tokenizer_round_trips_text() -> None:
    """Scenario: ASCII and multi-byte UTF-8 text round-trip; BOS, EOS and ids past the byte range are dropped
    on decode; a cut multi-byte character decodes to U+FFFD; the vocab fits every preset."""
    tok = ByteTokenizer()
    text = "héllo wörld — 日本語 🎉"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.encode(text, add_bos=True)[0] == tok.BOS
    assert tok.decode([tok.BOS, *ids, tok.EOS, 300, 511]) == text
    assert tok.decode(tok.encode("日")[:2]) == "\ufffd"
    assert all(tok.vocab_size <= cfg.vocab for cfg in PRESETS.values())
