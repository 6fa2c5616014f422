"""Greedy verification of a batch of draft trees against the target's argmax.

A draft node is correct when its token equals the target's argmax at its parent. The accepted
path is the deepest node whose whole ancestry is correct (ties: lowest node index); the bonus
token is the target's argmax at that node. `greedy_accept` runs the Triton kernel on CUDA (one
program per sequence, no loops: "ancestry all correct" is a masked reduction over the ancestor
matrix) and the torch reference elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.triton_support import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl


@dataclass
class GreedyVerdict:
    path: torch.Tensor        # [B, D+1] node indices of the accepted path from the root, -1 past its end
    accept_len: torch.Tensor  # [B] accepted draft nodes (the root not counted)
    bonus: torch.Tensor       # [B] the target's token after the accepted path


def greedy_accept(tokens, parents, depth, ancestors, num_nodes, target_argmax, max_depth=None) -> GreedyVerdict:
    """tokens, parents, depth, target_argmax: [B, n]; ancestors [B, n, n] bool; num_nodes [B].

    max_depth: the deepest node, if the caller knows it on the host (else read from the device).
    """
    if use_triton(tokens):
        return greedy_accept_triton(tokens, parents, depth, ancestors, num_nodes, target_argmax, max_depth)
    return greedy_accept_reference(tokens, parents, depth, num_nodes, target_argmax, max_depth)


def greedy_accept_reference(
    tokens: torch.Tensor,         # [B, n] node tokens (node 0 = root)
    parents: torch.Tensor,        # [B, n] -1 for the root and padding
    depth: torch.Tensor,          # [B, n]
    num_nodes: torch.Tensor,      # [B]
    target_argmax: torch.Tensor,  # [B, n] the target's greedy token after each node
    max_depth: int | None = None,
) -> GreedyVerdict:
    b, n = tokens.shape
    node = torch.arange(n, device=tokens.device)
    real = node[None, :] < num_nodes[:, None]
    has_parent = parents >= 0
    parent_idx = parents.clamp(min=0)
    correct = has_parent & real & (tokens == torch.gather(target_argmax, 1, parent_idx))
    is_root = node[None, :] == 0
    ok = is_root.expand(b, n) | correct
    if max_depth is None:
        max_depth = int(depth.max())
    for _ in range(max_depth):  # propagate "whole ancestry correct" one level per iteration
        ok = (is_root | (correct & torch.gather(ok, 1, parent_idx))).expand(b, n)
    score = torch.where(ok, depth * n + (n - 1 - node), torch.full_like(depth, -1))
    leaf = score.argmax(dim=1)                                   # [B]
    accept_len = torch.gather(depth, 1, leaf[:, None])[:, 0]     # [B]
    bonus = torch.gather(target_argmax, 1, leaf[:, None])[:, 0]  # [B]
    path = torch.full((b, max_depth + 1), -1, dtype=torch.long, device=tokens.device)
    cur = leaf
    for step in range(max_depth + 1):  # walk up from the leaf, filling the path back to front
        pos = accept_len - step
        live = pos >= 0
        slot = pos.clamp(min=0)[:, None]
        path.scatter_(1, slot, torch.where(live, cur, path.gather(1, slot)[:, 0])[:, None])
        cur = torch.where(live & (cur > 0), torch.gather(parents, 1, cur[:, None])[:, 0], cur)
    return GreedyVerdict(path, accept_len, bonus)


if HAVE_TRITON:

    @triton.jit(do_not_specialize=["n", "path_width"])
    def _greedy_accept_kernel(tokens, parents, depth, ancestors, num_nodes, argmax, path, accept_len, bonus,
                              n, path_width, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        idx = tl.arange(0, BLOCK)
        valid = idx < n
        real = idx < tl.load(num_nodes + b)
        row = b * n
        tok = tl.load(tokens + row + idx, mask=valid, other=-1)
        par = tl.load(parents + row + idx, mask=valid, other=-1)
        dep = tl.load(depth + row + idx, mask=valid, other=0)
        at_parent = tl.load(argmax + row + tl.maximum(par, 0), mask=valid, other=-2)
        correct = ((par >= 0) & real & (tok == at_parent)) | (idx == 0)
        anc = tl.load(ancestors + b * n * n + idx[:, None] * n + idx[None, :],
                      mask=valid[:, None] & valid[None, :], other=0)               # [BLOCK, BLOCK]
        broken = (anc != 0) & (correct[None, :] == 0)                              # an ancestor is wrong
        ok = (tl.sum(broken.to(tl.int32), axis=1) == 0) & real
        score = tl.where(ok, dep * BLOCK + (BLOCK - 1 - idx), -1)
        best = tl.max(score, axis=0)
        leaf = BLOCK - 1 - best % BLOCK
        tl.store(accept_len + b, (best // BLOCK).to(tl.int64))
        tl.store(bonus + b, tl.load(argmax + row + leaf))
        on_path = tl.load(ancestors + b * n * n + leaf * n + idx, mask=valid, other=0) != 0
        tl.store(path + b * path_width + dep, idx.to(tl.int64), mask=on_path & valid)

    def greedy_accept_triton(tokens, parents, depth, ancestors, num_nodes, target_argmax,
                             max_depth=None) -> GreedyVerdict:
        b, n = tokens.shape
        width = (int(depth.max()) if max_depth is None else max_depth) + 1
        path = torch.full((b, width), -1, dtype=torch.long, device=tokens.device)
        accept_len = torch.empty(b, dtype=torch.long, device=tokens.device)
        bonus = torch.empty(b, dtype=torch.long, device=tokens.device)
        _greedy_accept_kernel[(b,)](
            tokens.contiguous(), parents.contiguous(), depth.contiguous(), ancestors.to(torch.int8).contiguous(),
            num_nodes.contiguous(), target_argmax.contiguous(), path, accept_len, bonus, n, width,
            BLOCK=triton.next_power_of_2(n),
        )
        return GreedyVerdict(path, accept_len, bonus)
