"""Lossless speculative sampling over a batch of draft trees (chains are one-child trees).

At a node with residual distribution r (starting as the target's p there), its children are
tried in order. Child x drawn from proposal q is accepted with probability min(1, r(x) / q(x));
after a rejection r <- normalize(max(0, r - q)). A deterministic child (top-k trees, greedy
drafts) is the point mass q = delta_x: accepted with probability r(x), then zeroed out of r.
When no child is accepted the bonus token is drawn from r; at a leaf, from p.
This is SpecInfer's multi-draft rule (for the chain, the standard rule of Leviathan et al.);
the output distribution equals the target's exactly. Uniform draws come in from the caller.

`spec_sample` runs the Triton kernel on CUDA (one program per sequence walking its tree, the
residual distribution in a float64 scratch row, vocabulary processed in blocks) and the torch
reference elsewhere.
"""

from __future__ import annotations

import torch

from kernels.greedy_accept import GreedyVerdict
from kernels.triton_support import HAVE_TRITON, use_triton
from specdec.sampling import sample_from

if HAVE_TRITON:
    import triton
    import triton.language as tl


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


def spec_sample(probs, tokens, parents, depth, q_ids, q_probs, sampled, u_accept, u_bonus,
                max_depth=None, max_children=None) -> GreedyVerdict:
    """max_depth, max_children: the trees' bounds, if the caller knows them on the host (else read
    from the device)."""
    args = (probs, tokens, parents, depth, q_ids, q_probs, sampled, u_accept, u_bonus, max_depth, max_children)
    return spec_sample_triton(*args) if use_triton(probs) else spec_sample_reference(*args)


def spec_sample_reference(
    probs: torch.Tensor,      # [B, n, V] target distribution after each node (node 0 = root)
    tokens: torch.Tensor,     # [B, n]
    parents: torch.Tensor,    # [B, n] -1 for the root and padding
    depth: torch.Tensor,      # [B, n]
    q_ids: torch.Tensor,      # [B, n, K] proposal support of each node's token (K may be 0)
    q_probs: torch.Tensor,    # [B, n, K] proposal probabilities (0 = padding)
    sampled: torch.Tensor,    # [B, n] bool: node drawn from q (else a point mass)
    u_accept: torch.Tensor,   # [B, n] uniform per node: its accept test
    u_bonus: torch.Tensor,    # [B, n] uniform per node: the bonus draw if the walk stops there
    max_depth: int | None = None,
    max_children: int | None = None,
) -> GreedyVerdict:
    b, n, v = probs.shape
    rows = torch.arange(b, device=probs.device)
    children, _ = child_table(parents)
    if max_children is None:
        max_children = int((children >= 0).sum(-1).max()) if n > 1 else 0
    if max_depth is None:
        max_depth = int(depth.max())
    cur = torch.zeros(b, dtype=torch.long, device=probs.device)
    res = probs[:, 0].double().clone()
    walking = torch.ones(b, dtype=torch.bool, device=probs.device)
    steps = [cur]
    for _ in range(max_depth):
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


if HAVE_TRITON:

    @triton.jit
    def _load_row(probs, res, row, V, BLOCK_V: tl.constexpr):
        """res <- probs[row] (as float64); -> its sum."""
        row = row.to(tl.int64)  # row * V passes 2**31 for large batches at 128k vocabularies
        offs = tl.arange(0, BLOCK_V)
        total = tl.sum(tl.zeros([BLOCK_V], dtype=tl.float64), axis=0)  # a float64 zero (loop-carried)
        for start in range(0, V, BLOCK_V):
            mask = start + offs < V
            p = tl.load(probs + row * V + start + offs, mask=mask, other=0.0).to(tl.float64)
            tl.store(res + start + offs, p, mask=mask)
            total += tl.sum(p, axis=0)
        return total

    @triton.jit(do_not_specialize=["n", "K", "C", "max_depth", "path_width"])
    def _spec_sample_kernel(probs, tokens, children, q_ids, q_probs, sampled, u_accept, u_bonus, scratch,
                            path, accept_len, bonus, n, V, K, C, max_depth, path_width,
                            BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
        b = tl.program_id(0)
        offs = tl.arange(0, BLOCK_V)
        koffs = tl.arange(0, BLOCK_K)
        res = scratch + b * V
        zero = tl.sum(tl.zeros([BLOCK_V], dtype=tl.float64), axis=0)
        total = _load_row(probs, res, b * n, V, BLOCK_V)
        cur = 0
        walking = 1
        depth = 0
        for _d in range(max_depth):
            if walking != 0:
                taken = -1
                for j in range(C):
                    c = tl.load(children + (b * n + cur) * C + j)
                    if (c >= 0) & (taken < 0):
                        node = b * n + c
                        x = tl.load(tokens + node)
                        is_sampled = tl.load(sampled + node) != 0
                        kmask = koffs < K
                        ids = tl.load(q_ids + node * K + koffs, mask=kmask, other=-1)
                        qp = tl.load(q_probs + node * K + koffs, mask=kmask, other=0.0).to(tl.float64)
                        qx = tl.where(is_sampled, tl.sum(tl.where(ids == x, qp, 0.0), axis=0), zero + 1.0)
                        rx = tl.load(res + x) / total
                        ratio = tl.minimum(rx / tl.maximum(qx, 1e-30), 1.0)
                        if tl.load(u_accept + node) < ratio:
                            taken = c
                        else:  # residual <- max(0, r/total - q)
                            new_total = zero
                            for start in range(0, V, BLOCK_V):
                                vv = start + offs
                                mask = vv < V
                                r = tl.load(res + vv, mask=mask, other=0.0) / total
                                hit = vv[:, None] == ids[None, :]
                                point = tl.where(vv == x, 1.0, 0.0).to(tl.float64)
                                q = tl.where(is_sampled, tl.sum(tl.where(hit, qp[None, :], 0.0), axis=1), point)
                                r = tl.maximum(r - q, 0.0)
                                tl.store(res + vv, r, mask=mask)
                                new_total += tl.sum(tl.where(mask, r, 0.0), axis=0)
                            total = tl.where(new_total > 0, new_total, total)  # r == q: cannot be rejected
                if taken >= 0:
                    cur = taken
                    depth += 1
                    tl.store(path + b * path_width + depth, cur.to(tl.int64))
                    total = _load_row(probs, res, b * n + cur, V, BLOCK_V)
                else:
                    walking = 0
        # bonus: the first token whose cumulative mass exceeds u * total
        target = tl.load(u_bonus + b * n + cur) * total
        running = zero
        found = V - 1
        searching = 1
        for start in range(0, V, BLOCK_V):
            if searching != 0:
                vv = start + offs
                r = tl.load(res + vv, mask=vv < V, other=0.0)
                cum = running + tl.cumsum(r, axis=0)
                first = tl.min(tl.where((cum > target) & (vv < V), vv, V), axis=0)
                if first < V:
                    found = first
                    searching = 0
                running += tl.sum(r, axis=0)
        tl.store(path + b * path_width, 0)
        tl.store(accept_len + b, depth.to(tl.int64))
        tl.store(bonus + b, found.to(tl.int64))

    def spec_sample_triton(probs, tokens, parents, depth, q_ids, q_probs, sampled, u_accept, u_bonus,
                           max_depth=None, max_children=None) -> GreedyVerdict:
        b, n, v = probs.shape
        children, _ = child_table(parents)
        if max_children is None:
            max_children = int((children >= 0).sum(-1).max())
        c = max(1, max_children)
        children = children[:, :, :c].to(torch.int32).contiguous()  # int32: loop-carried node ids
        width = (int(depth.max()) if max_depth is None else max_depth) + 1
        k = q_ids.shape[-1]
        path = torch.full((b, width), -1, dtype=torch.long, device=probs.device)
        accept_len = torch.empty(b, dtype=torch.long, device=probs.device)
        bonus = torch.empty(b, dtype=torch.long, device=probs.device)
        scratch = torch.empty(b, v, dtype=torch.float64, device=probs.device)
        _spec_sample_kernel[(b,)](
            probs.contiguous(), tokens.contiguous(), children, q_ids.contiguous(), q_probs.contiguous(),
            sampled.to(torch.int8).contiguous(), u_accept.double().contiguous(), u_bonus.double().contiguous(),
            scratch, path, accept_len, bonus, n, v, k, c, width - 1, width,
            BLOCK_V=min(1024, triton.next_power_of_2(v)), BLOCK_K=triton.next_power_of_2(max(k, 1)),
        )
        return GreedyVerdict(path, accept_len, bonus)
