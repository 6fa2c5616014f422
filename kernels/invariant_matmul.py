"""Batch-invariant matmul: y = x @ W^T (+ b) where a row's result does not depend on how many
rows the call has.

cuBLAS picks its kernel, tile shape and split-K factor by problem size, so the same token's
projection can round differently when it is verified alone, with four draft tokens, or beside
fifteen other sequences -- and greedy decoding in bf16 then flips near-ties between modes. This
kernel always uses one tile shape and walks K in one fixed order, with no split-K: every output
element is the same sequence of fused multiply-adds whatever M is. Used by `--batch-invariant`
(its cost is measured in BENCHMARKS.md).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from kernels.triton_support import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

# One configuration for every shape: 64-row tiles (Hopper's wgmma height), 32 output columns
# (so a 4096-wide projection still spreads over 128 programs at batch 1), 128-deep K steps.
BLOCK_M, BLOCK_N, BLOCK_K = 64, 32, 128


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K], weight [N, K], bias [N] or None -> [..., N]."""
    if use_triton(x) and x.dtype != torch.float64:
        return invariant_linear_triton(x, weight, bias)
    return F.linear(x, weight, bias)  # the reference: invariance is a GPU property here


if HAVE_TRITON:

    @triton.jit(do_not_specialize=["M"])
    def _matmul_kernel(x, w, bias, y, M, N: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FP32: tl.constexpr):
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        row_ok = rows < M
        col_ok = cols < N
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            k_ok = k0 + ks < K
            a = tl.load(x + rows[:, None].to(tl.int64) * K + k0 + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            b = tl.load(w + cols[None, :].to(tl.int64) * K + k0 + ks[:, None], mask=col_ok[None, :] & k_ok[:, None],
                        other=0.0)
            if FP32:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            acc += tl.load(bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(y.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])

    def invariant_linear_triton(x, weight, bias):
        n, k = weight.shape
        flat = x.reshape(-1, k).contiguous()
        m = flat.shape[0]
        y = flat.new_empty(m, n)
        if m:
            grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
            _matmul_kernel[grid](flat, weight, bias if bias is not None else weight, y, m, N=n, K=k,
                                 HAS_BIAS=bias is not None, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
                                 FP32=x.dtype == torch.float32, num_warps=4, num_stages=4)
        return y.reshape(*x.shape[:-1], n)
