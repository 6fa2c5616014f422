"""kernels.kv_compact: the Triton kernel (interpreted on CPU) equals the torch reference on
random caches and random accepted paths, ragged rows and no-op rows included."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.kv_compact import compact_reference
from kernels.triton_support import HAVE_TRITON


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_equals_reference(dtype):
    from kernels.kv_compact import compact_triton

    rng = random.Random(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layers, n_slots, slot_len, heads, head_dim = 2, 4, 24, 2, 8
    for _ in range(4):
        k = torch.randn(layers, n_slots, slot_len, heads, head_dim, device=device).to(dtype)
        v = torch.randn_like(k)
        b = rng.randint(1, 3)
        slots = torch.tensor(rng.sample(range(n_slots), b), device=device)
        width = rng.randint(1, 5)
        src = torch.zeros(b, width, dtype=torch.long)
        dst = torch.zeros(b, width, dtype=torch.long)
        for i in range(b):
            start = rng.randint(0, 8)
            path = sorted(rng.sample(range(1, 12), rng.randint(0, width - 1)))
            nodes = [0, *path]
            for j in range(width):  # pad with no-op moves
                src[i, j] = start + (nodes[j] if j < len(nodes) else 0)
                dst[i, j] = start + (j if j < len(nodes) else 0)
        src, dst = src.to(device), dst.to(device)
        k_ref, v_ref = k.clone(), v.clone()
        compact_reference(k_ref, v_ref, slots, src, dst)
        compact_triton(k, v, slots, src, dst)
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
