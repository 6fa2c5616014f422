"""The draft vocabulary: the target tokens a head can propose, chosen by how often the target emits them."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from specdec.train.distill import Sample


@dataclass(frozen=True)
class DraftVocab:
    target_ids: torch.Tensor   # [Vd] long, ascending: draft id i proposes target id target_ids[i]
    coverage: float            # share of the learned tokens inside the draft vocabulary

    @property
    def d2t(self) -> torch.Tensor:
        """Draft id -> target id as the published layout stores it: an offset (target = draft + d2t)."""
        return self.target_ids - torch.arange(len(self.target_ids))

    def t2d(self, vocab_size: int) -> torch.Tensor:
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[self.target_ids] = True
        return mask


def select_draft_vocab(samples: list[Sample], vocab_size: int, size: int, always: list[int]) -> DraftVocab:
    """The `size` most frequent answer tokens (ties by id), plus `always` (e.g. EOS); the whole
    vocabulary when it is no larger."""
    counts = Counter(t for s in samples for t in s.ids[max(s.answer_start, 1):])
    total = sum(counts.values()) or 1
    if size >= vocab_size:
        return DraftVocab(torch.arange(vocab_size), 1.0)
    keep = [t for t in always if 0 <= t < vocab_size]
    for tok, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(keep) >= size:
            break
        if tok not in keep:
            keep.append(tok)
    if len(keep) < size:   # fewer distinct tokens seen than asked: unseen ids fill what is left
        taken = set(keep)
        keep += [t for t in range(vocab_size) if t not in taken][:size - len(keep)]
    ids = torch.tensor(sorted(keep), dtype=torch.long)
    covered = sum(counts[t] for t in keep)
    return DraftVocab(ids, covered / total)
