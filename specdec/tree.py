"""Draft trees packed into batched tensors (node tokens, parents, ancestor masks, proposals) for
verification; the plain dataclass and its validation live in specdec/draft_tree.py."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec.draft_tree import DraftTree, Proposal  # noqa: F401  (re-exported)
from specdec.model.batch import upload, upload_packed


@dataclass
class PackedTrees:
    tokens: torch.Tensor     # [B, n] node tokens, node 0 = root
    parents: torch.Tensor    # [B, n] parent index, -1 for roots and padding
    num_nodes: torch.Tensor  # [B] real nodes including the root
    ancestors: torch.Tensor  # [B, n, n] bool: j is i or an ancestor of i (padding: self only)
    depth: torch.Tensor      # [B, n] root = 0
    max_depth: int           # the deepest node of the batch, known on the host (no device read)
    max_children: int        # the most children of one node in the batch, likewise


def pack_trees(roots: list[int], trees: list[DraftTree], device: torch.device, width: int = 1) -> PackedTrees:
    """The structure is worked out on the host (a few numpy operations, not dozens of kernel
    launches) and moved in two copies. width: at least this many nodes a row (padding)."""
    n = max(width, 1 + max((len(t) for t in trees), default=0))
    # per row: the node tokens, their parents, the real node count   [B, 2n + 1]
    rows = np.array([[root, *t.token_ids, *[0] * (n - 1 - len(t)), -1, *t.parents, *[-1] * (n - 1 - len(t)),
                      1 + len(t)] for root, t in zip(roots, trees)], dtype=np.int64).reshape(-1, 2 * n + 1)
    shapes = [t.shape() for t in trees]
    max_depth = max((d for d, _ in shapes), default=0)
    ancestors, depth = tree_structure(rows[:, n:2 * n], max_depth)
    tokens, parents, num_nodes, depth = upload_packed(
        [torch.from_numpy(x) for x in (rows[:, :n], rows[:, n:2 * n], rows[:, 2 * n], depth)], device)
    return PackedTrees(tokens, parents, num_nodes, upload(torch.from_numpy(ancestors), device), depth, max_depth,
                       max((c for _, c in shapes), default=0))


def tree_structure(parents: np.ndarray, max_depth: int) -> tuple[np.ndarray, np.ndarray]:
    """parents [B, n] (-1 = no parent), the deepest node's depth -> (ancestor-or-self mask [B, n, n],
    depth [B, n])."""
    b, n = parents.shape
    ancestors = np.broadcast_to(np.eye(n, dtype=bool), (b, n, n)).copy()
    depth = np.zeros((b, n), dtype=np.int64)
    if max_depth == 0:   # mode off: roots alone
        return ancestors, depth
    rows, nodes = np.arange(b)[:, None], np.arange(n)[None, :]
    cur = parents
    for _ in range(max_depth):  # one hop up the tree per iteration, all nodes at once
        has_parent = cur >= 0
        ancestors[rows, nodes, np.where(has_parent, cur, nodes)] = True   # no parent: self, already set
        depth += has_parent
        cur = np.where(has_parent, np.take_along_axis(parents, np.maximum(cur, 0), 1), cur)
    return ancestors, depth


def pack_proposals(trees: list[DraftTree], n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (q_ids [B, n, K], q_probs [B, n, K], sampled [B, n]) aligned with pack_trees' nodes."""
    k = max(1, max((len(p.token_ids) for t in trees for p in t.proposals), default=0))
    empty = ([0] * k, [0.0] * k)
    rows = [[empty] + [(p.token_ids + [0] * (k - len(p.token_ids)), p.probs + [0.0] * (k - len(p.probs)))
                       for p in t.proposals] + [empty] * (n - 1 - len(t.proposals)) for t in trees]
    q_ids = torch.tensor([[ids for ids, _ in row] for row in rows], dtype=torch.long)       # [B, n, K]
    q_probs = torch.tensor([[probs for _, probs in row] for row in rows], dtype=torch.float64)
    sampled = torch.tensor([[False] + [True] * len(t.proposals) + [False] * (n - 1 - len(t.proposals))
                            for t in trees], dtype=torch.bool)
    return upload(q_ids, device), upload(q_probs, device), upload(sampled, device)
