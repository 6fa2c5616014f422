"""Draft trees: the plain dataclass, validation, and batched tensor packing.

A tree has a root (node 0, the sequence's last committed token, not listed) and N draft nodes
1..N in topological order, each with a parent index < its own. A chain is the tree with parents
[0, 1, ..., k-1]; plain decoding is the empty tree.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from specdec.model.batch import upload, upload_list


@dataclass
class Proposal:
    """The sparse distribution a sampled draft token was drawn from."""

    token_ids: list[int]
    probs: list[float]


@dataclass
class DraftTree:
    token_ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    proposals: list[Proposal] = field(default_factory=list)  # one per node when sampled; empty = point masses

    @classmethod
    def chain(cls, token_ids: list[int], logprobs: list[float] | None = None,
              proposals: list[Proposal] | None = None) -> DraftTree:
        return cls(list(token_ids), list(range(len(token_ids))), list(logprobs or []), list(proposals or []))

    def suffix(self, start: int) -> DraftTree:
        """A chain's nodes from `start` on, as a chain (what is left of a pre-draft after its first token)."""
        return DraftTree.chain(self.token_ids[start:], self.logprobs[start:], self.proposals[start:])

    def __len__(self) -> int:
        return len(self.token_ids)

    def shape(self) -> tuple[int, int]:
        """(depth of the deepest node, most children of one node); a chain is (k, 1) at once."""
        if not self.parents:
            return 0, 0
        if self.parents == list(range(len(self.parents))):
            return len(self.parents), 1
        depth = [0]
        for p in self.parents:  # parents precede their children
            depth.append(depth[p] + 1)
        return max(depth), max(Counter(self.parents).values())

    def problem(self, vocab_size: int, max_nodes: int) -> str | None:
        """Why this tree is malformed, or None."""
        if len(self.parents) != len(self.token_ids):
            return f"draft has {len(self.token_ids)} tokens but {len(self.parents)} parents"
        if len(self.token_ids) > max_nodes:
            return f"draft has {len(self.token_ids)} nodes; at most {max_nodes} are allowed"
        for i, (tok, parent) in enumerate(zip(self.token_ids, self.parents), start=1):
            if not 0 <= tok < vocab_size:
                return f"draft token {tok} is outside the vocabulary [0, {vocab_size})"
            if not 0 <= parent < i:
                return f"draft node {i} has parent {parent}; parents must precede their children"
        if self.proposals:
            if len(self.proposals) != len(self.token_ids):
                return "a sampled draft needs one proposal distribution per node"
            for tok, prop in zip(self.token_ids, self.proposals):
                if len(prop.token_ids) != len(prop.probs) or tok not in prop.token_ids:
                    return f"draft token {tok} is not in the support of its proposal distribution"
                if any(not 0 <= t < vocab_size for t in prop.token_ids) or any(not p >= 0 for p in prop.probs):
                    return "a proposal distribution has a token outside the vocabulary or a negative probability"
        return None


@dataclass
class PackedTrees:
    tokens: torch.Tensor     # [B, n] node tokens, node 0 = root
    parents: torch.Tensor    # [B, n] parent index, -1 for roots and padding
    num_nodes: torch.Tensor  # [B] real nodes including the root
    ancestors: torch.Tensor  # [B, n, n] bool: j is i or an ancestor of i (padding: self only)
    depth: torch.Tensor      # [B, n] root = 0
    max_depth: int           # the deepest node of the batch, known on the host (no device read)
    max_children: int        # the most children of one node in the batch, likewise


def pack_trees(roots: list[int], trees: list[DraftTree], device: torch.device) -> PackedTrees:
    n = 1 + max((len(t) for t in trees), default=0)
    tokens = [[root, *t.token_ids] + [0] * (n - 1 - len(t)) for root, t in zip(roots, trees)]
    parents = [[-1, *t.parents] + [-1] * (n - 1 - len(t)) for t in trees]
    shapes = [t.shape() for t in trees]
    tokens, parents = (upload(torch.tensor(x, dtype=torch.long), device) for x in (tokens, parents))
    num_nodes = upload_list([1 + len(t) for t in trees], device)
    max_depth = max((d for d, _ in shapes), default=0)
    ancestors, depth = tree_structure(parents, max_depth)
    return PackedTrees(tokens, parents, num_nodes, ancestors, depth, max_depth,
                       max((c for _, c in shapes), default=0))


def tree_structure(parents: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """parents [B, n] (-1 = no parent), the deepest node's depth -> (ancestor-or-self mask [B, n, n],
    depth [B, n])."""
    b, n = parents.shape
    ancestors = torch.eye(n, dtype=torch.bool, device=parents.device).expand(b, n, n).clone()
    depth = torch.zeros_like(parents)
    cur = parents
    for _ in range(max_depth):  # one hop up the tree per iteration, all nodes at once
        has_parent = cur >= 0
        ancestors |= F.one_hot(cur.clamp(min=0), n).bool() & has_parent[:, :, None]
        depth += has_parent.long()
        cur = torch.where(has_parent, torch.gather(parents, 1, cur.clamp(min=0)), cur)
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
