"""Lossless speculative sampling over a batch of draft trees (chains are one-child trees).

At a node with residual distribution r (starting as the target's p there), its children are
tried in order. Child x drawn from proposal q is accepted with probability min(1, r(x) / q(x));
after a rejection r <- normalize(max(0, r - q)). A deterministic child (top-k trees, greedy
drafts) is the point mass q = delta_x: accepted with probability r(x), then zeroed out of r.
When no child is accepted the bonus token is drawn from r; at a leaf, from p.
This is SpecInfer's multi-draft rule (for the chain, the standard rule of Leviathan et al.);
the output distribution equals the target's exactly. Uniform draws come in from the caller.
"""

from __future__ import annotations

import torch

from kernels.greedy_accept import GreedyVerdict
from specdec.sampling import sample_from


def child_table(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """parents [B, n] -> (children [B, n, n] node ids in index order, -1 padded; sibling rank [B, n])."""
    b, n = parents.shape
    node = torch.arange(n, device=parents.device)
    same = (parents[:, :, None] == parents[:, None, :]) & (parents[:, :, None] >= 0)
    rank = (same & (node[None, None, :] < node[None, :, None])).sum(-1)  # earlier siblings
    children = torch.full((b, n + 1, n), -1, dtype=torch.long, device=parents.device)
    rows = torch.where(parents >= 0, parents, n)  # roots and padding go to a scratch row
    children[torch.arange(b, device=parents.device)[:, None], rows, rank] = node
    return children[:, :n], rank


def spec_sample(
    probs: torch.Tensor,      # [B, n, V] target distribution after each node (node 0 = root)
    tokens: torch.Tensor,     # [B, n]
    parents: torch.Tensor,    # [B, n] -1 for the root and padding
    depth: torch.Tensor,      # [B, n]
    q_ids: torch.Tensor,      # [B, n, K] proposal support of each node's token (K may be 0)
    q_probs: torch.Tensor,    # [B, n, K] proposal probabilities (0 = padding)
    sampled: torch.Tensor,    # [B, n] bool: node drawn from q (else a point mass)
    u_accept: torch.Tensor,   # [B, n] uniform per node: its accept test
    u_bonus: torch.Tensor,    # [B, n] uniform per node: the bonus draw if the walk stops there
) -> GreedyVerdict:
    b, n, v = probs.shape
    rows = torch.arange(b, device=probs.device)
    children, _ = child_table(parents)
    max_children = int((children >= 0).sum(-1).max()) if n > 1 else 0
    cur = torch.zeros(b, dtype=torch.long, device=probs.device)
    res = probs[:, 0].double().clone()
    walking = torch.ones(b, dtype=torch.bool, device=probs.device)
    steps = [cur]
    for _ in range(int(depth.max())):
        taken = torch.full_like(cur, -1)
        for j in range(max_children):
            child = children[rows, cur, j]                                         # [B]
            live = walking & (child >= 0) & (taken < 0)
            c = child.clamp(min=0)
            x = tokens[rows, c]
            q = torch.zeros(b, v, dtype=torch.float64, device=probs.device)
            q.scatter_add_(1, q_ids[rows, c].clamp(min=0), q_probs[rows, c].double())
            q = torch.where(sampled[rows, c][:, None], q, torch.nn.functional.one_hot(x, v).double())
            r_norm = res / res.sum(-1, keepdim=True)
            ratio = r_norm[rows, x] / q[rows, x].clamp(min=1e-30)
            accept = live & (u_accept[rows, c] < ratio.clamp(max=1.0))
            taken = torch.where(accept, child, taken)
            rejected = live & ~accept
            after = (r_norm - q).clamp(min=0.0)
            after = torch.where(after.sum(-1, keepdim=True) > 0, after, r_norm)   # r == q: nothing left to fix
            res = torch.where(rejected[:, None], after, res)
        moved = taken >= 0
        cur = torch.where(moved, taken, cur)
        res = torch.where(moved[:, None], probs[rows, cur].double(), res)
        walking &= moved
        steps.append(torch.where(moved, cur, -1))
    bonus = sample_from(res, u_bonus[rows, cur])
    path = torch.stack(steps, 1)                              # [B, D+1], -1 once the walk stopped
    path = torch.where(torch.cummin(path, 1).values < 0, -1, path)
    return GreedyVerdict(path, (path >= 0).sum(1) - 1, bonus)
