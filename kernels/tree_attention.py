"""Tree attention straight from the KV cache: every new token of a sequence attends to the
sequence's cached prefix (all visible) and to the step's region of new entries as its mask says
(causal for chains, ancestors for trees) -- the ForwardBatch semantics.

The reference gathers each sequence's keys and runs torch SDPA with a boolean mask. The Triton
kernel reads K/V in place from the cache (no gather copy) and is flash-attention style: one
program per (sequence, KV head, block of query rows), the rows being (token, q head of this KV
group) pairs, with an online softmax over key blocks; the mask costs nothing on prefix blocks.
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from kernels.triton_support import HAVE_TRITON, use_triton
from specdec.model.batch import visibility_mask

if HAVE_TRITON:
    import triton
    import triton.language as tl


def tree_attention(q, k_cache, v_cache, layer, slots, prefix_len, region_mask, kv_len, mask=None) -> torch.Tensor:
    """q [B, n, H, D]; caches [L, S, T, Hkv, D]; slots, prefix_len [B]; region_mask [B, n, R] -> [B, n, H, D].

    `mask` ([B, 1, n, kv_len], optional) is the reference's precomputed dense mask.
    """
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

    @triton.jit(do_not_specialize=["layer", "n", "R", "n_slots", "slot_len"])
    def _tree_attention_kernel(q, k, v, out, slots, prefix_len, region, layer, n, R, n_slots, slot_len,
                               sm_scale, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP32: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        G: tl.constexpr = H // HKV
        rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)     # (token, head-in-group) pairs
        token = rows // G
        head = kvh * G + rows % G
        row_ok = token < n
        dims = tl.arange(0, D)
        q_tile = tl.load(q + ((b * n + token[:, None]) * H + head[:, None]) * D + dims[None, :],
                         mask=row_ok[:, None], other=0.0)
        slot = tl.load(slots + b)
        prefix = tl.load(prefix_len + b)
        base = ((layer * n_slots + slot) * slot_len) * HKV * D + kvh * D
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for start in range(0, prefix + R, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            in_cache = pos < prefix + R
            kv_off = base + pos[:, None] * HKV * D + dims[None, :]
            k_tile = tl.load(k + kv_off, mask=in_cache[:, None], other=0.0)
            v_tile = tl.load(v + kv_off, mask=in_cache[:, None], other=0.0)
            if FP32:
                s = tl.dot(q_tile, tl.trans(k_tile), input_precision="ieee")
            else:
                s = tl.dot(q_tile, tl.trans(k_tile))
            s = s * sm_scale
            rel = pos - prefix
            in_region = (rel >= 0) & (rel < R)
            allowed = tl.load(region + (b * n + token[:, None]) * R + rel[None, :],
                              mask=row_ok[:, None] & in_region[None, :], other=0) != 0
            visible = (pos[None, :] < prefix) | allowed
            s = tl.where(visible & row_ok[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if FP32:
                acc = acc * alpha[:, None] + tl.dot(p, v_tile, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile)
            m_i = m_new
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out + ((b * n + token[:, None]) * H + head[:, None]) * D + dims[None, :],
                 o.to(out.dtype.element_ty), mask=row_ok[:, None])

    def tree_attention_triton(q, k_cache, v_cache, layer, slots, prefix_len, region_mask) -> torch.Tensor:
        b, n, h, d = q.shape
        _, n_slots, slot_len, hkv, _ = k_cache.shape
        r = region_mask.shape[-1]
        out = torch.empty_like(q)
        rows = n * (h // hkv)
        block_m = max(16, min(64, triton.next_power_of_2(rows)))
        grid = (b, hkv, triton.cdiv(rows, block_m))
        _tree_attention_kernel[grid](
            q.contiguous(), k_cache, v_cache, out, slots.contiguous(), prefix_len.contiguous(),
            region_mask.to(torch.int8).contiguous(), layer, n, r, n_slots, slot_len, 1.0 / math.sqrt(d),
            H=h, HKV=hkv, D=d, BLOCK_M=block_m, BLOCK_N=64, FP32=q.dtype == torch.float32,
        )
        return out
