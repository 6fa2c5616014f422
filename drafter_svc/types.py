"""Plain dataclasses for one drafter step (the servicer converts them from/to protobuf)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.errors import SequenceError
from specdec.limits import MAX_DRAFTED_CHAIN, MAX_TREE_BUDGET, MAX_TREE_DEPTH, MAX_TREE_TOPK
from specdec.sampling import GREEDY, SamplingParams
from specdec.tree import DraftTree


@dataclass(frozen=True)
class ChainShape:
    k: int

    def problem(self) -> str | None:
        if not 1 <= self.k <= MAX_DRAFTED_CHAIN:
            return f"chain k={self.k} is out of range; use 1..{MAX_DRAFTED_CHAIN}"
        return None


@dataclass(frozen=True)
class TreeShape:
    topk: int
    depth: int
    budget: int

    def problem(self) -> str | None:
        if not 1 <= self.topk <= MAX_TREE_TOPK:
            return f"tree topk={self.topk} is out of range; use 1..{MAX_TREE_TOPK}"
        if not 1 <= self.depth <= MAX_TREE_DEPTH:
            return f"tree depth={self.depth} is out of range; use 1..{MAX_TREE_DEPTH}"
        if not 1 <= self.budget <= MAX_TREE_BUDGET:
            return f"tree budget={self.budget} is out of range; use 1..{MAX_TREE_BUDGET}"
        return None

    @property
    def fed_nodes(self) -> int:
        """Tree nodes the drafter feeds through its model (all but the last depth)."""
        return (self.depth - 1) * self.topk


@dataclass
class DraftItem:
    seq_id: str
    committed_len: int
    append_ids: list[int]
    assumed_ids: list[int]
    shape: ChainShape | TreeShape
    sampling: SamplingParams = GREEDY
    # EAGLE-3: the target's hidden states [appended tokens (when opening: all but one), aux width]
    # of the positions just before each appended token (verdicts carry them; the gateway forwards).
    hidden: torch.Tensor | None = None


@dataclass
class DrafterStep:
    step: int
    items: list[DraftItem] = field(default_factory=list)
    close: list[str] = field(default_factory=list)


@dataclass
class Draft:
    seq_id: str
    committed_len: int
    assumed_len: int
    tree: DraftTree
    # overlap pre-drafts (--hedge-predrafts): assumed tokens kept -> [guessed correction, chain...]
    hedges: dict[int, DraftTree] = field(default_factory=dict)


@dataclass
class DrafterStepResult:
    step: int
    drafts: list[Draft] = field(default_factory=list)
    errors: list[SequenceError] = field(default_factory=list)
