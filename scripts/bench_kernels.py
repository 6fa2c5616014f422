"""Verification hot-path kernels on the GPU: each Triton kernel against its torch reference
(correctness on fresh random inputs, then median time), at batch 1, 16, 64 and tree sizes 7 and
16, with Llama-3.1-8B shapes (vocabulary 128256; 32 layers, 8 KV heads of 128, bf16 KV cache).
Also tree attention: torch SDPA with our boolean tree mask against SDPA with no mask over the
same keys (the floor any fused tree-attention kernel would have to beat).

    python scripts/bench_kernels.py            (needs CUDA and Triton)
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.greedy_accept import greedy_accept_reference, greedy_accept_triton  # noqa: E402
from kernels.kv_compact import compact_reference, compact_triton  # noqa: E402
from kernels.spec_sampling import spec_sample_reference, spec_sample_triton  # noqa: E402
from specdec.model.batch import ForwardBatch  # noqa: E402
from specdec.tree import DraftTree, pack_proposals, pack_trees  # noqa: E402

VOCAB, LAYERS, KV_HEADS, HEADS, HEAD_DIM = 128256, 32, 8, 32, 128
DEV = torch.device("cuda")


def trees(batch: int, size: int, rng: random.Random) -> list[DraftTree]:
    """EAGLE-like trees of `size` nodes: topk-2 branching, random tokens."""
    out = []
    for _ in range(batch):
        parents = [0] + [rng.randrange(0, i) if i > 1 else 0 for i in range(1, size)]
        out.append(DraftTree([rng.randrange(VOCAB) for _ in range(size)], parents[:size]))
    return out


def ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_greedy(batch, size, rng):
    p = pack_trees([rng.randrange(VOCAB) for _ in range(batch)], trees(batch, size, rng), DEV)
    am = torch.where(torch.rand_like(p.tokens, dtype=torch.float) < 0.6,
                     p.tokens.roll(-1, 1), torch.randint_like(p.tokens, VOCAB))
    ref = greedy_accept_reference(p.tokens, p.parents, p.depth, p.num_nodes, am)
    got = greedy_accept_triton(p.tokens, p.parents, p.depth, p.ancestors, p.num_nodes, am)
    ok = torch.equal(ref.bonus, got.bonus) and torch.equal(ref.accept_len, got.accept_len)
    return ok, ms(lambda: greedy_accept_reference(p.tokens, p.parents, p.depth, p.num_nodes, am)), \
        ms(lambda: greedy_accept_triton(p.tokens, p.parents, p.depth, p.ancestors, p.num_nodes, am))


def bench_sampling(batch, size, rng):
    drafts = trees(batch, size, rng)
    p = pack_trees([rng.randrange(VOCAB) for _ in range(batch)], drafts, DEV)
    n = p.tokens.shape[1]
    q = pack_proposals(drafts, n, DEV)
    logits = torch.randn(batch, n, VOCAB, device=DEV) * 3
    rows, nodes = (p.parents >= 0).nonzero(as_tuple=True)
    logits[rows, p.parents[rows, nodes], p.tokens[rows, nodes]] += 8.0
    probs = torch.softmax(logits, -1)
    u1, u2 = torch.rand(batch, n, device=DEV, dtype=torch.float64), torch.rand(batch, n, device=DEV, dtype=torch.float64)
    args = (probs, p.tokens, p.parents, p.depth, *q, u1, u2)
    ref, got = spec_sample_reference(*args), spec_sample_triton(*args)
    ok = torch.equal(ref.bonus, got.bonus) and torch.equal(ref.accept_len, got.accept_len)
    return ok, ms(lambda: spec_sample_reference(*args)), ms(lambda: spec_sample_triton(*args))


def bench_compact(batch, size, rng):
    slot_len = 2048
    k = torch.randn(LAYERS, batch, slot_len, KV_HEADS, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = torch.arange(batch, device=DEV)
    depth = max(2, size // 2)
    start = torch.randint(0, 1500, (batch, 1), device=DEV)
    steps = torch.sort(torch.randperm(size - 1, device=DEV)[: depth - 1] + 1).values
    src = start + torch.cat([torch.zeros(1, dtype=torch.long, device=DEV), steps])[None].expand(batch, -1)
    dst = start + torch.arange(depth, device=DEV)[None]
    k2, v2 = k.clone(), v.clone()
    compact_reference(k, v, slots, src, dst)
    compact_triton(k2, v2, slots, src, dst)
    ok = torch.equal(k, k2) and torch.equal(v, v2)
    return ok, ms(lambda: compact_reference(k, v, slots, src, dst)), ms(lambda: compact_triton(k2, v2, slots, src, dst))


def bench_tree_attention(batch, size, rng, context=1024):
    p = pack_trees([0] * batch, trees(batch, size - 1, rng), DEV)
    n = p.tokens.shape[1]
    kv_start = torch.full((batch,), context, device=DEV)
    fb = ForwardBatch.build(p.tokens, kv_start[:, None] + p.depth, torch.arange(batch, device=DEV),
                            kv_start[:, None] + torch.arange(n, device=DEV), kv_start, p.ancestors)
    mask = fb.attention_mask()
    q = torch.randn(batch, HEADS, n, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
    kk = torch.randn(batch, KV_HEADS, fb.kv_len, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
    vv = torch.randn_like(kk)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    masked = ms(lambda: sdpa(q, kk, vv, attn_mask=mask, enable_gqa=True))
    plain = ms(lambda: sdpa(q, kk, vv, enable_gqa=True))
    return True, plain, masked


def main() -> None:
    rng = random.Random(0)
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    print("| kernel | batch | tree nodes | same result | reference ms | triton ms | speedup |")
    print("|---|---|---|---|---|---|---|")
    for name, fn in [("greedy tree verify", bench_greedy), ("speculative sampling (V=128256)", bench_sampling),
                     ("KV compaction (32 layers, bf16)", bench_compact)]:
        for batch in (1, 16, 64):
            for size in (7, 16):
                ok, ref_ms, tri_ms = fn(batch, size, rng)
                print(f"| {name} | {batch} | {size} | {ok} | {ref_ms:.3f} | {tri_ms:.3f} | {ref_ms / tri_ms:.1f}x |",
                      flush=True)
    print("\n| tree attention, context 1024 | batch | tree nodes | SDPA no mask ms | SDPA tree mask ms | mask cost |")
    print("|---|---|---|---|---|---|")
    for batch in (1, 16, 64):
        for size in (7, 16):
            _, plain, masked = bench_tree_attention(batch, size, rng)
            print(f"| bf16, 32 q / 8 kv heads | {batch} | {size} | {plain:.3f} | {masked:.3f} | {masked / plain:.2f}x |",
                  flush=True)


if __name__ == "__main__":
    main()
