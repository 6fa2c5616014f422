"""KV compaction after a tree step: copy the accepted path's KV entries to a dense prefix.

Within each slot, entry src[i] moves to dst[i] for every layer, K and V. Paths are increasing
and src[i] >= dst[i], so copying in ascending i never reads an entry that an earlier copy of the
same slot overwrote; the Triton kernel therefore gives each (sequence, layer) one program
that walks the path in order (one launch for K, one for V), moving a row of heads x head_dim per step.
"""

from __future__ import annotations

import torch

from kernels.triton_support import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl


def compact(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """k, v: [L, S, T, H, D] caches; slots [B]; src, dst [B, m] (rows padded with src == dst)."""
    if use_triton(k):
        compact_triton(k, v, slots, src, dst)
    else:
        compact_reference(k, v, slots, src, dst)


def compact_reference(k, v, slots, src, dst) -> None:
    rows = slots[:, None].expand_as(src)
    k[:, rows, dst] = k[:, rows, src]
    v[:, rows, dst] = v[:, rows, src]


if HAVE_TRITON:

    @triton.jit(do_not_specialize=["m", "n_slots", "slot_len"])
    def _compact_kernel(cache, slots, src, dst, m, n_slots, slot_len, row_size, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        layer = tl.program_id(1)
        base = (layer * n_slots + tl.load(slots + b)) * slot_len
        offs = tl.arange(0, BLOCK)
        for i in range(m):  # ascending: see the module docstring
            s = tl.load(src + b * m + i)
            d = tl.load(dst + b * m + i)
            if s != d:
                for start in range(0, row_size, BLOCK):
                    mask = start + offs < row_size
                    row = tl.load(cache + (base + s) * row_size + start + offs, mask=mask)
                    tl.store(cache + (base + d) * row_size + start + offs, row, mask=mask)

    def compact_triton(k, v, slots, src, dst) -> None:
        layers, n_slots, slot_len, heads, head_dim = k.shape
        b, m = src.shape
        row_size = heads * head_dim
        args = (slots.contiguous(), src.contiguous(), dst.contiguous(), m, n_slots, slot_len, row_size)
        block = min(1024, triton.next_power_of_2(row_size))
        for cache in (k, v):
            _compact_kernel[(b, layers)](cache, *args, BLOCK=block)
