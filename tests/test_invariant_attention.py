"""kernels.invariant_attention (its agreement with the SDPA reference is in test_tree_attention.py):
the ancestor paths, and a token's output is bit-for-bit the same whether it is computed
alone (mode off: its keys all in the prefix) or as a node of a tree step whose ancestors sit at
scattered region positions among siblings, beside other sequences."""

from __future__ import annotations

import pytest
import torch

from kernels.invariant_attention import ancestor_paths
from kernels.triton_support import HAVE_TRITON
from specdec.tree import DraftTree, pack_trees

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_ancestor_paths():
    tree = DraftTree([1, 2, 3, 4, 5], [0, 0, 1, 3, 2])  # root 0; nodes 1, 2 children of the root; ...
    mask = pack_trees([0], [tree], torch.device("cpu")).ancestors
    paths, depth = ancestor_paths(mask)
    assert depth[0].tolist() == [1, 2, 2, 3, 4, 3]
    assert paths[0, 4, :4].tolist() == [0, 1, 3, 4]   # node 4: root, 1, 3, itself
    assert paths[0, 5, :3].tolist() == [0, 2, 5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if torch.cuda.is_available() else [torch.float32])
def test_a_token_computes_the_same_alone_and_in_a_tree(dtype):
    from kernels.invariant_attention import invariant_attention_triton

    torch.manual_seed(5)
    heads, kv_heads, d, prefix = 4, 2, 16, 300
    k = torch.randn(1, 3, 400, kv_heads, d, device=DEVICE, dtype=dtype)
    v = torch.randn_like(k)
    # A tree in slot 0 after `prefix` committed tokens: root 0, path 0 -> 2 -> 4 with siblings 1, 3.
    tree = DraftTree([7, 8, 9, 10], [0, 0, 2, 2])
    packed = pack_trees([0], [tree], DEVICE)
    q_tree = torch.randn(1, 5, heads, d, device=DEVICE, dtype=dtype)
    # batched with another sequence (slot 2) of another length
    q_other = torch.randn(1, 5, heads, d, device=DEVICE, dtype=dtype)
    q = torch.cat([q_tree, q_other])
    masks = torch.cat([packed.ancestors, packed.ancestors])
    tree_out = invariant_attention_triton(q, k, v, 0, torch.tensor([0, 2], device=DEVICE),
                                          torch.tensor([prefix, 123], device=DEVICE), masks)
    # Mode off computes node 4 (depth 2, on path 0 -> 2 -> 4) in slot 1 whose cache holds the same
    # keys contiguously: the prefix, then the path's entries, then node 4 itself.
    k[:, 1, :prefix], v[:, 1, :prefix] = k[:, 0, :prefix], v[:, 0, :prefix]
    for depth, node in enumerate([0, 2, 4]):
        k[:, 1, prefix + depth], v[:, 1, prefix + depth] = k[:, 0, prefix + node], v[:, 0, prefix + node]
    alone = invariant_attention_triton(q_tree[:, 4:5], k, v, 0, torch.tensor([1], device=DEVICE),
                                       torch.tensor([prefix + 2], device=DEVICE),
                                       torch.ones(1, 1, 1, dtype=torch.bool, device=DEVICE))
    assert torch.equal(alone[0, 0], tree_out[0, 4])
