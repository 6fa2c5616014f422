"""kernels.spec_sampling: the Triton kernel (interpreted on CPU) makes the same decisions as the
torch reference on random target distributions, sampled chains and point-mass trees (ragged
batches, depth-1 trees and empty drafts included)."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.spec_sampling import spec_sample_reference
from kernels.triton_support import HAVE_TRITON
from specdec.tree import DraftTree, Proposal, pack_proposals, pack_trees

VOCAB = 37


def random_draft(rng: random.Random) -> DraftTree:
    kind = rng.choice(["empty", "chain", "tree"])
    if kind == "empty":
        return DraftTree()
    if kind == "chain":  # sampled: each token drawn from a sparse proposal that contains it
        k = rng.randint(1, 4)
        props = []
        for _ in range(k):
            ids = rng.sample(range(VOCAB), 4)
            w = [rng.random() + 0.05 for _ in ids]
            props.append(Proposal(ids, [x / sum(w) for x in w]))
        return DraftTree.chain([rng.choice(p.token_ids) for p in props], proposals=props)
    parents, tokens = [], []
    for i in range(1, rng.randint(1, 7) + 1):
        p = rng.randrange(0, i)
        used = {tokens[j - 1] for j, q in enumerate(parents, start=1) if q == p}
        parents.append(p)
        tokens.append(rng.choice([t for t in range(VOCAB) if t not in used]))
    return DraftTree(tokens, parents)


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_triton_makes_the_reference_decisions():
    from kernels.spec_sampling import spec_sample_triton

    rng = random.Random(0)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    accepted = rejected = 0
    for _ in range(12):
        drafts = [random_draft(rng) for _ in range(rng.randint(1, 4))]
        packed = pack_trees([rng.randrange(VOCAB) for _ in drafts], drafts, torch.device(device))
        b, n = packed.tokens.shape
        q_ids, q_probs, sampled = pack_proposals(drafts, n, torch.device(device))
        # random targets, biased towards the drafted tokens so that walks go deep as well
        logits = torch.randn(b, n, VOCAB, device=device) * 2
        has_parent = packed.parents >= 0
        rows, nodes = has_parent.nonzero(as_tuple=True)
        logits[rows, packed.parents[rows, nodes], packed.tokens[rows, nodes]] += 3.0
        probs = torch.softmax(logits, -1)
        u_accept, u_bonus = torch.rand(b, n, device=device).double(), torch.rand(b, n, device=device).double()
        args = (probs, packed.tokens, packed.parents, packed.depth, q_ids, q_probs, sampled, u_accept, u_bonus)
        ref, got = spec_sample_reference(*args), spec_sample_triton(*args)
        assert torch.equal(got.accept_len, ref.accept_len)
        assert torch.equal(got.bonus, ref.bonus)
        width = ref.path.shape[1]
        assert torch.equal(got.path[:, :width], ref.path)
        accepted += int(ref.accept_len.sum())
        rejected += int((ref.accept_len < packed.depth.max(1).values).sum())
    assert accepted > 5 and rejected > 5  # both branches of the rule were exercised
