"""Packing draft trees for a step: the host-known bounds (deepest node, widest fan-out) that let
the step skip device reads, the ancestor/depth tensors, and the proposal layout, against
brute force on random trees."""

from __future__ import annotations

import random
from collections import Counter

import torch
from test_greedy_accept import random_tree

from specdec.tree import DraftTree, Proposal, pack_proposals, pack_trees


def brute_depths(tree: DraftTree) -> list[int]:
    depth = [0]
    for p in tree.parents:
        depth.append(depth[p] + 1)
    return depth


def test_bounds_ancestors_and_depths_match_brute_force():
    rng = random.Random(3)
    cpu = torch.device("cpu")
    for _ in range(40):
        trees = [random_tree(rng, 5) for _ in range(rng.randint(1, 5))]
        if rng.random() < 0.3:
            trees.append(DraftTree.chain([1] * rng.randint(1, 9)))
        packed = pack_trees([0] * len(trees), trees, cpu)
        depths = [brute_depths(t) for t in trees]
        assert packed.max_depth == max(max(d) for d in depths)
        assert packed.max_children == max((max(Counter(t.parents).values()) for t in trees if len(t)), default=0)
        for b, (tree, depth) in enumerate(zip(trees, depths)):
            assert packed.depth[b, : len(depth)].tolist() == depth
            for i in range(len(depth)):  # ancestors-or-self by walking up the parents
                chain, j = {i}, i
                while j:
                    j = tree.parents[j - 1]
                    chain.add(j)
                row = packed.ancestors[b, i, : len(depth)].tolist()
                assert row == [j in chain for j in range(len(depth))]


def test_proposals_are_laid_out_per_node():
    trees = [DraftTree.chain([3, 4], proposals=[Proposal([3, 1], [0.7, 0.3]), Proposal([4], [1.0])]),
             DraftTree([5], [0]), DraftTree()]
    q_ids, q_probs, sampled = pack_proposals(trees, 3, torch.device("cpu"))
    assert q_ids.shape == (3, 3, 2) and sampled.tolist() == [[False, True, True], [False] * 3, [False] * 3]
    assert q_ids[0].tolist() == [[0, 0], [3, 1], [4, 0]]
    assert q_probs[0].tolist() == [[0.0, 0.0], [0.7, 0.3], [1.0, 0.0]]
    assert not q_probs[1:].any()
