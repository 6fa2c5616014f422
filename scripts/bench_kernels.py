"""Verification hot-path kernels on the GPU: each Triton kernel against its torch reference
(correctness on fresh random inputs, then median time), at batch 1, 16, 64 and tree sizes 7 and
16, with Llama-3.1-8B shapes (vocabulary 128256; 32 layers, 8 KV heads of 128, bf16 KV cache).
Tree attention: the Triton kernel reading K/V in place from the cache against the reference
(gather from the cache + SDPA with the boolean tree mask); SDPA alone with and without the mask
over pre-gathered keys for scale.

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
from kernels.tree_attention import tree_attention_reference, tree_attention_triton  # noqa: E402
from specdec.model.batch import visibility_mask  # noqa: E402
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
    prefix = torch.full((batch,), context, device=DEV)
    kv_len = context + n
    k = torch.randn(1, batch, kv_len + 64, KV_HEADS, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch, n, HEADS, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
    slots = torch.arange(batch, device=DEV)
    mask = visibility_mask(prefix, p.ancestors, kv_len)
    ref = tree_attention_reference(q, k, v, 0, slots, prefix, p.ancestors, kv_len, mask)
    got = tree_attention_triton(q, k, v, 0, slots, prefix, p.ancestors)
    ok = bool(((got.float() - ref.float()).norm() / ref.float().norm()) < 1e-2)
    keys, values = k[0, slots, :kv_len].transpose(1, 2), v[0, slots, :kv_len].transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    qt = q.transpose(1, 2)
    return (ok, ms(lambda: tree_attention_reference(q, k, v, 0, slots, prefix, p.ancestors, kv_len, mask)),
            ms(lambda: tree_attention_triton(q, k, v, 0, slots, prefix, p.ancestors)),
            ms(lambda: sdpa(qt, keys, values, attn_mask=mask, enable_gqa=True)),
            ms(lambda: sdpa(qt, keys, values, enable_gqa=True)))


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
    print("\n| tree attention, bf16, 32 q / 8 KV heads, context 1024 | batch | tree nodes | same result "
          "| reference (gather + SDPA mask) ms | triton (in-cache) ms | speedup | SDPA mask only ms | SDPA no mask ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for batch in (1, 16, 64):
        for size in (7, 16):
            ok, ref_ms, tri_ms, masked, plain = bench_tree_attention(batch, size, rng)
            print(f"| | {batch} | {size} | {ok} | {ref_ms:.3f} | {tri_ms:.3f} | {ref_ms / tri_ms:.1f}x | "
                  f"{masked:.3f} | {plain:.3f} |", flush=True)


if __name__ == "__main__":
    main()
