"""kernels.tree_attention: the Triton kernel (interpreted on CPU) equals the SDPA reference on
random caches, ragged prefixes and random tree / chain masks, with grouped KV heads -- in one
pass, split-K, and the batch-invariant kernel (kernels/invariant_attention.py)."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.tree_attention import tree_attention_reference
from kernels.triton_support import HAVE_TRITON
from specdec.tree import DraftTree, pack_trees


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
@pytest.mark.parametrize("split", [False, True, "invariant"], ids=["one-pass", "split-k", "invariant"])
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (2, 2)])
def test_triton_equals_reference(heads, kv_heads, split):
    from kernels.invariant_attention import invariant_attention_triton
    from kernels.tree_attention import tree_attention_triton

    rng = random.Random(heads)
    torch.manual_seed(heads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layers, n_slots, slot_len, d = 2, 4, 600, 16  # chunks: split-k 64 keys, invariant 256 keys
    k = torch.randn(layers, n_slots, slot_len, kv_heads, d, device=device)
    v = torch.randn_like(k)
    for _ in range(3):
        b = rng.randint(1, 3)
        drafts = []
        for _ in range(b):
            size = rng.randint(0, 6)
            drafts.append(DraftTree([1] * size, [rng.randrange(0, i) for i in range(1, size + 1)]))
        packed = pack_trees([0] * b, drafts, device)
        n = packed.tokens.shape[1]
        q = torch.randn(b, n, heads, d, device=device)
        slots = torch.tensor(rng.sample(range(n_slots), b), device=device)
        prefix = torch.tensor([rng.randint(0, 580) for _ in range(b)], device=device)
        kv_len = int((prefix + n).max())
        layer = rng.randrange(layers)
        ref = tree_attention_reference(q, k, v, layer, slots, prefix, packed.ancestors, kv_len)
        if split == "invariant":
            got = invariant_attention_triton(q, k, v, layer, slots, prefix, packed.ancestors)
        else:
            got = tree_attention_triton(q, k, v, layer, slots, prefix, packed.ancestors, split=split)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
