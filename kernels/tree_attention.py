"""Tree attention straight from the KV cache: every new token of a sequence attends to the
sequence's cached prefix (all visible) and to the step's region of new entries as its mask says
(causal for chains, ancestors for trees) -- the ForwardBatch semantics.

The reference gathers each sequence's keys and runs torch SDPA with a boolean mask. The Triton
kernel reads K/V in place from the cache (no gather copy) and is flash-attention style: one
program per (sequence, KV head, block of query rows), the rows being (token, q head of this KV
group) pairs, with an online softmax over key blocks; the mask costs nothing on prefix blocks.

Split-K (flash-decoding): when a step has too few (sequence, KV head, row block) programs to fill
the GPU -- small batches of one to a few tokens each, the decode case -- the keys are cut into
chunks at fixed absolute positions, one program per chunk writes an unnormalised partial
(running max, sum, weighted values) and a second kernel folds the chunks in order. The chunk
count comes from the cache's slot length, not from the lengths in the batch, so the launch shape
is the same for every step of a shape (CUDA graphs replay it); chunks past a sequence's keys exit
at once.
"""

from __future__ import annotations

import functools
import math

import torch
from torch.nn import functional as F

from kernels.triton_support import HAVE_TRITON, use_triton
from specdec.model.batch import visibility_mask

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from kernels.attention_parts import fold_chunks, online_softmax_block, split_buffers, store_rows
    from kernels.invariant_attention import invariant_attention_triton


def tree_attention(q, k_cache, v_cache, layer, slots, prefix_len, region_mask, kv_len, mask=None,
                   ancestor_paths: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q [B, n, H, D]; caches [L, S, T, Hkv, D]; slots, prefix_len [B]; region_mask [B, n, R] -> [B, n, H, D].

    `mask` ([B, 1, n, kv_len], optional) is the reference's precomputed dense mask.
    ancestor_paths (invariant_attention.ancestor_paths of region_mask, given = batch-invariant):
    kernels/invariant_attention.py, where a token's result depends only on its own context (not on
    the mode, the draft's size or shape, or the batch).
    """
    if use_triton(q) and ancestor_paths is not None:
        return invariant_attention_triton(q, k_cache, v_cache, layer, slots, prefix_len, region_mask, ancestor_paths)
    if use_triton(q):
        return tree_attention_triton(q, k_cache, v_cache, layer, slots, prefix_len, region_mask)
    return tree_attention_reference(q, k_cache, v_cache, layer, slots, prefix_len, region_mask, kv_len, mask)


def tree_attention_reference(q, k_cache, v_cache, layer, slots, prefix_len, region_mask, kv_len, mask=None):
    if mask is None:
        mask = visibility_mask(prefix_len, region_mask, kv_len)
    keys, values = k_cache[layer, slots, :kv_len], v_cache[layer, slots, :kv_len]  # [B, T, Hkv, D]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask,
        enable_gqa=q.shape[2] != keys.shape[2],
    )
    return out.transpose(1, 2)


if HAVE_TRITON:

    @triton.jit(do_not_specialize=["layer", "n", "R", "n_slots", "slot_len", "n_chunks"])
    def _tree_attention_kernel(q, k, v, out, part_m, part_l, part_acc, slots, prefix_len, region, layer, n, R,
                               n_slots, slot_len, n_chunks, sm_scale, H: tl.constexpr, HKV: tl.constexpr,
                               D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
                               SPLIT: tl.constexpr, FP32: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        G: tl.constexpr = H // HKV
        chunk = tl.program_id(2) % n_chunks
        rows = (tl.program_id(2) // n_chunks) * BLOCK_M + tl.arange(0, BLOCK_M)  # (token, head-in-group) pairs
        token = rows // G
        head = kvh * G + rows % G
        row_ok = token < n
        row_id = (b * n + token) * H + head
        slot = tl.load(slots + b)
        prefix = tl.load(prefix_len + b)
        lo = chunk * CHUNK
        if SPLIT:
            hi = tl.minimum(lo + CHUNK, prefix + R)
        else:
            hi = prefix + R
        if lo < hi:
            dims = tl.arange(0, D)
            q_tile = tl.load(q + row_id[:, None] * D + dims[None, :], mask=row_ok[:, None], other=0.0)
            base = ((layer * n_slots + slot) * slot_len) * HKV * D + kvh * D
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, D], tl.float32)
            for start in range(lo, hi, BLOCK_N):
                pos = start + tl.arange(0, BLOCK_N)
                in_cache = pos < hi
                kv_off = base + pos[:, None] * HKV * D + dims[None, :]
                k_tile = tl.load(k + kv_off, mask=in_cache[:, None], other=0.0)
                v_tile = tl.load(v + kv_off, mask=in_cache[:, None], other=0.0)
                rel = pos - prefix
                in_region = (rel >= 0) & (rel < R)
                allowed = tl.load(region + (b * n + token[:, None]) * R + rel[None, :],
                                  mask=row_ok[:, None] & in_region[None, :], other=0) != 0
                visible = ((pos[None, :] < prefix) | allowed) & in_cache[None, :] & row_ok[:, None]
                m_i, l_i, acc = online_softmax_block(q_tile, k_tile, v_tile, visible, m_i, l_i, acc, sm_scale, FP32)
            store_rows(out, part_m, part_l, part_acc, row_id, row_ok, chunk, n_chunks, m_i, l_i, acc, D, SPLIT)

    @functools.cache
    def _sm_count(device: torch.device) -> int:
        return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1

    def split_chunks(slot_len: int, programs: int, sm_count: int) -> int:
        """Key-chunk length for split-K, or 0 for none: split when the unsplit launch has fewer
        programs than SMs, into at most 64 chunks of at least 64 keys."""
        if programs >= sm_count:
            return 0
        chunk = max(64, triton.next_power_of_2(triton.cdiv(slot_len, 64)))
        return chunk if slot_len > chunk else 0

    def tree_attention_triton(q, k_cache, v_cache, layer, slots, prefix_len, region_mask,
                              split: bool | None = None) -> torch.Tensor:
        """split None: decide by launch size (split_chunks); True/False force it (tests)."""
        b, n, h, d = q.shape
        _, n_slots, slot_len, hkv, _ = k_cache.shape
        r = region_mask.shape[-1]
        out = torch.empty_like(q)
        rows = n * (h // hkv)
        block_m = max(16, min(64, triton.next_power_of_2(rows)))
        row_blocks = triton.cdiv(rows, block_m)
        programs = b * hkv * row_blocks
        if split is None:
            chunk = split_chunks(slot_len, programs, _sm_count(q.device))
        else:
            chunk = split_chunks(slot_len, 0 if split else programs, programs)
        n_chunks = triton.cdiv(slot_len, chunk) if chunk else 1
        part_m, part_l, part_acc = split_buffers(q, n_chunks) if chunk else (out, out, out)  # else unused
        q, slots, prefix_len = q.contiguous(), slots.contiguous(), prefix_len.contiguous()
        region = region_mask.contiguous().view(torch.int8)  # bool is one byte: a view, no kernel
        _tree_attention_kernel[(b, hkv, row_blocks * n_chunks)](
            q, k_cache, v_cache, out, part_m, part_l, part_acc, slots, prefix_len, region, layer, n, r,
            n_slots, slot_len, n_chunks, 1.0 / math.sqrt(d), H=h, HKV=hkv, D=d, BLOCK_M=block_m, BLOCK_N=64,
            CHUNK=chunk or 64, SPLIT=bool(chunk), FP32=q.dtype == torch.float32,
        )
        if chunk:
            fold_chunks(out, part_m, part_l, part_acc, prefix_len, None, n, r, chunk)
        return out
