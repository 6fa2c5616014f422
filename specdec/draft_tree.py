"""Draft trees as plain data: the dataclass the gateway, the drafters and the protocol share, and
its validation (no torch here: the gateway imports it; specdec/tree.py packs trees into tensors).

A tree has a root (node 0, the sequence's last committed token, not listed) and N draft nodes
1..N in topological order, each with a parent index < its own. A chain is the tree with parents
[0, 1, ..., k-1]; plain decoding is the empty tree.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


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
