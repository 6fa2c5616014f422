"""Pieces shared by the two attention kernels (tree_attention.py, invariant_attention.py): one
block of the online softmax, the store of a program's result (final, or a split-K partial),
and the kernel that folds split-K partials in chunk order."""

from __future__ import annotations

import torch

from kernels.triton_support import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def online_softmax_block(q_tile, k_tile, v_tile, visible, m_i, l_i, acc, sm_scale, FP32: tl.constexpr):
        """Fold one block of keys into the running (max, sum, weighted values) of each query row.
        visible [BLOCK_M, BLOCK_N]: which keys each row may see (masked ones contribute exact zeros)."""
        if FP32:
            s = tl.dot(q_tile, tl.trans(k_tile), input_precision="ieee")
        else:
            s = tl.dot(q_tile, tl.trans(k_tile))
        s = tl.where(visible, s * sm_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v_tile, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile)
        return m_new, l_i, acc

    @triton.jit
    def store_rows(out, part_m, part_l, part_acc, row_id, row_ok, chunk, n_chunks, m_i, l_i, acc,
                   D: tl.constexpr, SPLIT: tl.constexpr):
        """row_id [BLOCK_M]: (b * n + token) * H + head of each query row. Split: the unnormalised
        partial of this chunk ([rows, n_chunks(, D)]); else the normalised output."""
        dims = tl.arange(0, D)
        if SPLIT:
            part = row_id * n_chunks + chunk
            tl.store(part_m + part, m_i, mask=row_ok)
            tl.store(part_l + part, l_i, mask=row_ok)
            tl.store(part_acc + part[:, None] * D + dims[None, :], acc, mask=row_ok[:, None])
        else:
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out + row_id[:, None] * D + dims[None, :], o.to(out.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit(do_not_specialize=["n", "R", "n_chunks"])
    def fold_chunks_kernel(out, part_m, part_l, part_acc, prefix_len, depths, n, R, n_chunks, H: tl.constexpr,
                           D: tl.constexpr, CHUNK: tl.constexpr, PER_TOKEN: tl.constexpr):
        """One program per query row: fold the partials of the chunks its keys span, in order.
        A row's keys: prefix + R (every region entry), or prefix + depths[token] (PER_TOKEN)."""
        row = tl.program_id(0).to(tl.int64)  # (b * n + token) * H + head
        bt = row // H
        seen = tl.load(prefix_len + bt // n)
        if PER_TOKEN:
            seen += tl.load(depths + bt)
        else:
            seen += R
        dims = tl.arange(0, D)
        m_run = float("-inf")
        l_run = 0.0
        acc = tl.zeros([D], tl.float32)
        for c in range(0, tl.cdiv(seen, CHUNK)):
            m_c = tl.load(part_m + row * n_chunks + c)
            l_c = tl.load(part_l + row * n_chunks + c)
            a_c = tl.load(part_acc + (row * n_chunks + c) * D + dims)
            m_new = tl.maximum(m_run, m_c)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            old, new = tl.exp(m_run - m_safe), tl.exp(m_c - m_safe)
            l_run = l_run * old + l_c * new
            acc = acc * old + a_c * new
            m_run = m_new
        o = acc / tl.where(l_run > 0, l_run, 1.0)
        tl.store(out + row * D + dims, o.to(out.dtype.element_ty))

    def fold_chunks(out, part_m, part_l, part_acc, prefix_len, depths, n: int, r: int, chunk: int) -> None:
        b, _, h, n_chunks = part_m.shape
        fold_chunks_kernel[(b * n * h,)](out, part_m, part_l, part_acc, prefix_len,
                                         depths if depths is not None else prefix_len, n, r, n_chunks, H=h,
                                         D=part_acc.shape[-1], CHUNK=chunk, PER_TOKEN=depths is not None)

    def split_buffers(q: torch.Tensor, n_chunks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split-K partials for q [B, n, H, D]: running max and sum [B, n, H, C], values [B, n, H, C, D]."""
        b, n, h, d = q.shape
        part_m = q.new_empty(b, n, h, n_chunks, dtype=torch.float32)
        return part_m, torch.empty_like(part_m), q.new_empty(b, n, h, n_chunks, d, dtype=torch.float32)
