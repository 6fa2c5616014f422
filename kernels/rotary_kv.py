"""Rotary embedding fused with the KV-cache write.

Input is the fused QKV projection of a step's tokens; one program per (token, head) rotates a
query head into the attention input, or rotates a KV head's key and stores it, with the value,
straight into the cache at the token's slot and position. In torch the same work is ~20 small
kernels (slices, negation, concatenation, four multiplies, two adds, two index writes).
"""

from __future__ import annotations

import torch

from kernels.triton_support import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl


def rope_and_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, layer: int, slots: torch.Tensor, write_pos: torch.Tensor,
                      heads: int, kv_heads: int) -> torch.Tensor:
    """qkv [B, n, (H + 2 Hkv) D]; cos, sin [B, n, D]; caches [L, S, T, Hkv, D]; slots [B];
    write_pos [B, n] -> rotated queries [B, n, H, D] (keys rotated and written with the values)."""
    d = cos.shape[-1]
    if use_triton(qkv) and d & (d - 1) == 0:  # tl.arange needs a power-of-two head_dim
        return rope_and_write_kv_triton(qkv, cos, sin, k_cache, v_cache, layer, slots, write_pos, heads, kv_heads)
    return rope_and_write_kv_reference(qkv, cos, sin, k_cache, v_cache, layer, slots, write_pos, heads, kv_heads)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, n, heads, D]; cos, sin [B, n, D]
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, :, None] + rotated_half * sin[:, :, None]


def rope_and_write_kv_reference(qkv, cos, sin, k_cache, v_cache, layer, slots, write_pos, heads, kv_heads):
    b, n, _ = qkv.shape
    d = cos.shape[-1]
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q = _rotate(q.reshape(b, n, heads, d), cos, sin)
    k_cache[layer, slots[:, None], write_pos] = _rotate(k.reshape(b, n, kv_heads, d), cos, sin)
    v_cache[layer, slots[:, None], write_pos] = v.reshape(b, n, kv_heads, d)
    return q


if HAVE_TRITON:

    @triton.jit(do_not_specialize=["layer", "n", "n_slots", "slot_len"])
    def _rope_kv_kernel(qkv, cos, sin, q_out, k_cache, v_cache, slots, write_pos, layer, n, n_slots, slot_len,
                        H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)  # b * n + i
        head = tl.program_id(1)                # < H: a query head; else a KV head
        HALF: tl.constexpr = D // 2
        dims = tl.arange(0, HALF)
        row = qkv + token * (H + 2 * HKV) * D
        c = tl.load(cos + token * D + dims).to(tl.float32)
        s = tl.load(sin + token * D + dims).to(tl.float32)
        x1 = tl.load(row + head * D + dims).to(tl.float32)
        x2 = tl.load(row + head * D + HALF + dims).to(tl.float32)
        r1 = (x1 * c - x2 * s).to(q_out.dtype.element_ty)
        r2 = (x2 * c + x1 * s).to(q_out.dtype.element_ty)
        if head < H:
            out = q_out + (token * H + head) * D
            tl.store(out + dims, r1)
            tl.store(out + HALF + dims, r2)
        else:
            kvh = head - H
            slot = tl.load(slots + token // n)
            pos = tl.load(write_pos + token)
            dst = ((layer * n_slots + slot) * slot_len + pos) * HKV * D + kvh * D
            tl.store(k_cache + dst + dims, r1)
            tl.store(k_cache + dst + HALF + dims, r2)
            v_src = row + (H + HKV + kvh) * D
            tl.store(v_cache + dst + dims, tl.load(v_src + dims))
            tl.store(v_cache + dst + HALF + dims, tl.load(v_src + HALF + dims))

    def rope_and_write_kv_triton(qkv, cos, sin, k_cache, v_cache, layer, slots, write_pos, heads, kv_heads):
        b, n, _ = qkv.shape
        d = cos.shape[-1]
        _, n_slots, slot_len, _, _ = k_cache.shape
        q = qkv.new_empty(b, n, heads, d)
        _rope_kv_kernel[(b * n, heads + kv_heads)](
            qkv.contiguous(), cos.contiguous(), sin.contiguous(), q, k_cache, v_cache, slots.contiguous(),
            write_pos.contiguous(), layer, n, n_slots, slot_len, H=heads, HKV=kv_heads, D=d, num_warps=1)
        return q
