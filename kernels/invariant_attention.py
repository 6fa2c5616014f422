"""Batch-invariant attention: one kernel for mode off, chains and trees whose result for a token
depends only on that token's own context, never on the step's shape.

Plain decoding computes the token at position p against keys 0..p, physically contiguous. A chain
or tree step computes the same token against the same keys, but its draft ancestors sit at other
cache positions (a tree's siblings in between), and its block of query rows holds other tokens:
a flash kernel would group the keys into other blocks and round differently. Here each program
takes ONE token (its query heads of one KV head) and walks its keys in *logical* order -- the
prefix 0..prefix-1, then its ancestors by depth, gathered from wherever the region stores them --
in blocks of fixed logical positions. So the token at logical position p always sees the same
keys in the same lanes of the same blocks, whatever the mode, draft size or batch.

Decode-sized steps (at most MAX_SPLIT_TOKENS tokens a sequence) split the logical range into
chunks of a fixed length (a function of the cache's slot length only), folded in order by a
second kernel; longer forwards (prefills) run unsplit. A generated token is only ever computed in
decode-sized steps, a prompt token only in its prefill, so each sees one arithmetic.
"""

from __future__ import annotations

import math

import torch

from kernels.triton_support import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from kernels.attention_parts import fold_chunks, online_softmax_block, split_buffers, store_rows

MAX_SPLIT_TOKENS = 65  # the largest verify step: a 64-node tree and its root


def ancestor_paths(region_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """region_mask [B, n, R] bool (ancestors incl. self, parents before children) ->
    paths [B, n, R] int32: the region index of each token's i-th ancestor (i < depth), and
    depth [B, n] int32: how many region entries it sees."""
    mask = region_mask.to(torch.int32)
    rank = mask.cumsum(-1) - 1                                    # [B, n, R] rank among the set bits
    r = mask.shape[-1]
    target = torch.where(region_mask, rank, r).long()             # unset bits go to a dropped column
    paths = torch.zeros(*mask.shape[:-1], r + 1, dtype=torch.int32, device=mask.device)
    idx = torch.arange(r, dtype=torch.int32, device=mask.device).expand_as(mask)
    paths.scatter_(2, target, idx)
    return paths[..., :r].contiguous(), mask.sum(-1, dtype=torch.int32)


def chunk_len(slot_len: int) -> int:
    """Fixed split length: at least 256 keys, at most 32 chunks per slot."""
    return max(256, 1 << max(0, math.ceil(math.log2(max(1, math.ceil(slot_len / 32))))))


if HAVE_TRITON:

    @triton.jit(do_not_specialize=["layer", "n", "R", "n_slots", "slot_len", "n_chunks"])
    def _attention_kernel(q, k, v, out, part_m, part_l, part_acc, slots, prefix_len, paths, depths, layer, n, R,
                          n_slots, slot_len, n_chunks, sm_scale, H: tl.constexpr, HKV: tl.constexpr,
                          D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
                          SPLIT: tl.constexpr, FP32: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        token = tl.program_id(2) // n_chunks
        chunk = tl.program_id(2) % n_chunks
        G: tl.constexpr = H // HKV
        r = tl.arange(0, BLOCK_M)
        row_ok = r < G
        row_id = (b * n + token) * H + kvh * G + r  # this token's query heads of KV head kvh
        prefix = tl.load(prefix_len + b)
        seen = prefix + tl.load(depths + b * n + token)  # logical keys 0 .. seen-1
        lo = chunk * CHUNK
        if SPLIT:
            hi = tl.minimum(lo + CHUNK, seen)
        else:
            hi = seen
        if lo < hi:
            dims = tl.arange(0, D)
            q_tile = tl.load(q + row_id[:, None] * D + dims[None, :], mask=row_ok[:, None], other=0.0)
            base = ((layer * n_slots + tl.load(slots + b)) * slot_len) * HKV * D + kvh * D
            path = paths + (b * n + token) * R
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, D], tl.float32)
            for start in range(lo, hi, BLOCK_N):
                logical = start + tl.arange(0, BLOCK_N)
                valid = logical < hi
                rel = logical - prefix
                ancestor = tl.load(path + rel, mask=valid & (rel >= 0), other=0)
                phys = tl.where(rel < 0, logical, prefix + ancestor)
                kv_off = base + phys[:, None] * HKV * D + dims[None, :]
                k_tile = tl.load(k + kv_off, mask=valid[:, None], other=0.0)
                v_tile = tl.load(v + kv_off, mask=valid[:, None], other=0.0)
                visible = valid[None, :] & row_ok[:, None]
                m_i, l_i, acc = online_softmax_block(q_tile, k_tile, v_tile, visible, m_i, l_i, acc, sm_scale, FP32)
            store_rows(out, part_m, part_l, part_acc, row_id, row_ok, chunk, n_chunks, m_i, l_i, acc, D, SPLIT)

    def invariant_attention_triton(q, k_cache, v_cache, layer, slots, prefix_len, region_mask,
                                   paths_depths: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Same contract as tree_attention (q [B, n, H, D] -> [B, n, H, D]); paths_depths:
        ancestor_paths(region_mask), passed in when the caller computes it once for all layers."""
        b, n, h, d = q.shape
        _, n_slots, slot_len, hkv, _ = k_cache.shape
        paths, depths = paths_depths if paths_depths is not None else ancestor_paths(region_mask)
        r = region_mask.shape[-1]
        out = torch.empty_like(q)
        split = n <= MAX_SPLIT_TOKENS
        chunk = chunk_len(slot_len)
        n_chunks = triton.cdiv(slot_len, chunk) if split else 1
        part_m, part_l, part_acc = split_buffers(q, n_chunks) if split else (out, out, out)  # else unused
        q, slots, prefix_len = q.contiguous(), slots.contiguous(), prefix_len.contiguous()
        _attention_kernel[(b, hkv, n * n_chunks)](
            q, k_cache, v_cache, out, part_m, part_l, part_acc, slots, prefix_len, paths, depths, layer, n, r,
            n_slots, slot_len, n_chunks, 1.0 / math.sqrt(d), H=h, HKV=hkv, D=d,
            BLOCK_M=max(16, triton.next_power_of_2(h // hkv)), BLOCK_N=64, CHUNK=chunk, SPLIT=split,
            FP32=q.dtype == torch.float32,
        )
        if split:
            fold_chunks(out, part_m, part_l, part_acc, prefix_len, depths, n, r, chunk)
        return out
