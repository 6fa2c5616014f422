"""kernels.greedy_accept (torch reference and Triton kernel, interpreted on CPU) against a
brute-force walk over random trees (ragged batches, depth-1 trees and empty drafts included)."""

from __future__ import annotations

import random

import torch

import pytest

from kernels.greedy_accept import greedy_accept_reference
from kernels.triton_support import HAVE_TRITON
from specdec.tree import DraftTree, pack_trees


def brute_force(root: int, tree: DraftTree, argmax: list[int]) -> tuple[list[int], int]:
    path, node = [0], 0
    while True:
        children = [i for i, p in enumerate(tree.parents, start=1) if p == node]
        match = next((c for c in children if tree.token_ids[c - 1] == argmax[node]), None)
        if match is None:
            return path, argmax[node]
        path.append(match)
        node = match


def random_tree(rng: random.Random, vocab: int) -> DraftTree:
    n = rng.choice([0, 1, 2, 5, 7, 16])
    parents, tokens = [], []
    for i in range(1, n + 1):
        while True:  # siblings differ, as drafters make them
            p = rng.randrange(0, i)
            free = sorted(set(range(vocab)) - {tokens[j - 1] for j, q in enumerate(parents, start=1) if q == p})
            if free:
                break
        tok = rng.choice(free)
        parents.append(p)
        tokens.append(tok)
    return DraftTree(tokens, parents)


def reference(p, am):
    return greedy_accept_reference(p.tokens, p.parents, p.depth, p.num_nodes, am)


def triton_kernel(p, am):
    from kernels.greedy_accept import greedy_accept_triton  # defined only where Triton is installed

    return greedy_accept_triton(p.tokens, p.parents, p.depth, p.ancestors, p.num_nodes, am)


@pytest.mark.parametrize("name, impl", [
    pytest.param("reference", reference, id="reference"),
    pytest.param("triton", triton_kernel, id="triton",
                 marks=pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")),
])
def test_matches_brute_force_on_random_trees(name, impl):
    rng = random.Random(0)
    for _ in range(25 if name == "triton" else 50):
        trees = [random_tree(rng, 4) for _ in range(rng.randint(1, 6))]
        roots = [rng.randrange(4) for _ in trees]
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        packed = pack_trees(roots, trees, device)
        n = packed.tokens.shape[1]
        argmax = torch.randint(0, 4, (len(trees), n), device=device)
        v = impl(packed, argmax)
        for b, (root, tree) in enumerate(zip(roots, trees)):
            path, bonus = brute_force(root, tree, argmax[b].tolist())
            assert v.path[b, : len(path)].tolist() == path
            assert int(v.accept_len[b]) == len(path) - 1 and int(v.bonus[b]) == bonus
