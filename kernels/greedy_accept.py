"""Greedy verification of a batch of draft trees against the target's argmax.

A draft node is correct when its token equals the target's argmax at its parent. The accepted
path is the deepest node whose whole ancestry is correct (ties: lowest node index); the bonus
token is the target's argmax at that node.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GreedyVerdict:
    path: torch.Tensor        # [B, D+1] node indices of the accepted path from the root, -1 past its end
    accept_len: torch.Tensor  # [B] accepted draft nodes (the root not counted)
    bonus: torch.Tensor       # [B] the target's token after the accepted path


def greedy_accept(
    tokens: torch.Tensor,         # [B, n] node tokens (node 0 = root)
    parents: torch.Tensor,        # [B, n] -1 for the root and padding
    depth: torch.Tensor,          # [B, n]
    num_nodes: torch.Tensor,      # [B]
    target_argmax: torch.Tensor,  # [B, n] the target's greedy token after each node
) -> GreedyVerdict:
    b, n = tokens.shape
    node = torch.arange(n, device=tokens.device)
    real = node[None, :] < num_nodes[:, None]
    has_parent = parents >= 0
    parent_idx = parents.clamp(min=0)
    correct = has_parent & real & (tokens == torch.gather(target_argmax, 1, parent_idx))
    is_root = node[None, :] == 0
    ok = is_root.expand(b, n) | correct
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
        path.scatter_(1, pos.clamp(min=0)[:, None], torch.where(live, cur, path.gather(1, pos.clamp(min=0)[:, None])[:, 0])[:, None])
        cur = torch.where(live & (cur > 0), torch.gather(parents, 1, cur[:, None])[:, 0], cur)
    return GreedyVerdict(path, accept_len, bonus)
