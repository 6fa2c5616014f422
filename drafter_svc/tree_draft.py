"""EAGLE-2 style draft trees, expanded for a batch of sequences at once.

Depth 1 takes the root's top-k tokens. Each later depth feeds the k frontier nodes through the
draft model (tree attention: a node sees the context and its own ancestors), scores their top-k
children by cumulative log-probability and keeps the best k of those k*k as the next frontier.
In the end the best `budget` candidates of all depths form the tree; a child never scores above
its parent, so (with ties broken by creation order) the chosen set contains its ancestors.
"""

from __future__ import annotations

import torch

from drafter_svc.types import TreeShape
from specdec.model.batch import ForwardBatch, upload_list
from specdec.model.runner import ModelRunner
from specdec.sequence_table import SequenceState
from specdec.tree import DraftTree


def expand_trees(
    runner: ModelRunner,
    states: list[SequenceState],
    shape: TreeShape,
    root_logits: torch.Tensor,  # [B, V] next-token logits after each context
    graphs=None,                # DraftGraphs: the expansion as one replay when a graph fits
) -> list[DraftTree]:
    device = root_logits.device
    kv_lens = [len(s.kv_tokens) for s in states]
    ctx_len = upload_list(kv_lens, device)                      # [B]
    slots = upload_list([s.slot for s in states], device)
    out = graphs.tree(root_logits, ctx_len, slots, shape) if graphs is not None else None
    if out is None:
        out = expand(lambda batch, _parents: runner.forward(batch), root_logits, ctx_len, slots, shape,
                     max(kv_lens))
    return to_trees(*out)


def expand(forward, root_logits: torch.Tensor, ctx_len: torch.Tensor, slots: torch.Tensor, shape: TreeShape,
           max_ctx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The expansion and selection as tensor work only (no host reads: CUDA graphs capture it).
    forward: (ForwardBatch, parents [B, k]: which earlier fed node each fed node hangs from, -1 for
    the root; an EAGLE-3 head reads its parent's hidden state) -> logits [B, k, V]; max_ctx: the longest context (host-known) ->
    tokens, parent nodes (0 = root), log-probabilities, each [B, budget]."""
    device = root_logits.device
    b, k = root_logits.shape[0], shape.topk
    scores, tokens = torch.log_softmax(root_logits, -1).topk(k, dim=-1)  # [B, k]
    cand_tokens, cand_scores = [tokens], [scores]
    cand_parents = [torch.full((b, k), -1, dtype=torch.long, device=device)]  # -1 = the root
    cand_logps = [scores]
    frontier = torch.arange(k, device=device).expand(b, k)   # candidate index of each frontier node
    fed_ancestors = torch.zeros(b, 0, 0, dtype=torch.bool, device=device)  # among fed nodes
    fed_of_cand = torch.full((b, k + (shape.depth - 1) * k * k), -1, dtype=torch.long, device=device)
    n_cands = k

    for depth in range(1, shape.depth):
        n_fed = fed_ancestors.shape[1]
        # Feed the frontier: each node sees the context, its parent's ancestors and itself.
        parent_cand = torch.gather(torch.cat(cand_parents, 1), 1, frontier)  # [B, k]
        parent_fed = torch.where(parent_cand >= 0, torch.gather(fed_of_cand, 1, parent_cand.clamp(min=0)), -1)
        rows = torch.zeros(b, k, n_fed + k, dtype=torch.bool, device=device)
        if n_fed:
            inherited = torch.gather(fed_ancestors, 1, parent_fed.clamp(min=0)[:, :, None].expand(-1, -1, n_fed))
            rows[:, :, :n_fed] = inherited & (parent_fed >= 0)[:, :, None]
        rows[:, :, n_fed:] = torch.eye(k, dtype=torch.bool, device=device)
        fed_ancestors = torch.cat(
            [torch.cat([fed_ancestors, torch.zeros(b, n_fed, k, dtype=torch.bool, device=device)], 2), rows], 1)
        fed_of_cand.scatter_(1, frontier, n_fed + torch.arange(k, device=device).expand(b, k))

        front_tokens = torch.gather(torch.cat(cand_tokens, 1), 1, frontier)   # [B, k]
        front_scores = torch.gather(torch.cat(cand_scores, 1), 1, frontier)   # [B, k]
        positions = (ctx_len - 1 + depth)[:, None].expand(b, k)
        write_pos = ctx_len[:, None] + n_fed + torch.arange(k, device=device)
        region = fed_ancestors[:, -k:, :]  # the frontier's rows: [B, k, n_fed + k]
        batch = ForwardBatch.build(front_tokens, positions, slots, write_pos, ctx_len, region,
                                   kv_len=max_ctx + n_fed + k)
        logp = torch.log_softmax(forward(batch, parent_fed), -1)                             # [B, k, V]
        child_logp, child_tok = logp.topk(k, dim=-1)                           # [B, k, k]
        child_scores = front_scores[:, :, None] + child_logp
        cand_tokens.append(child_tok.reshape(b, k * k))
        cand_scores.append(child_scores.reshape(b, k * k))
        cand_logps.append(child_logp.reshape(b, k * k))
        cand_parents.append(frontier[:, :, None].expand(b, k, k).reshape(b, k * k))
        best = child_scores.reshape(b, k * k).topk(k, dim=-1).indices          # [B, k]
        frontier = n_cands + best
        n_cands += k * k

    return _select(
        torch.cat(cand_tokens, 1), torch.cat(cand_parents, 1), torch.cat(cand_scores, 1),
        torch.cat(cand_logps, 1), min(shape.budget, n_cands),
    )


def _select(tokens, parents, scores, logps, budget: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keep the `budget` best candidates; renumber them as nodes 1..budget in creation order."""
    b, c = tokens.shape
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :budget]
    chosen = torch.sort(order, dim=1).values                                   # creation order = topological
    node_of = torch.zeros(b, c, dtype=torch.long, device=tokens.device)
    node_of.scatter_(1, chosen, torch.arange(1, budget + 1, device=tokens.device).expand(b, budget))
    parent_cand = torch.gather(parents, 1, chosen)
    parent_node = torch.where(parent_cand >= 0, torch.gather(node_of, 1, parent_cand.clamp(min=0)), 0)
    return torch.gather(tokens, 1, chosen), parent_node, torch.gather(logps, 1, chosen)


def to_trees(tokens: torch.Tensor, parents: torch.Tensor, logps: torch.Tensor) -> list[DraftTree]:
    """[B, budget] tensors -> one DraftTree per row (the step's host read)."""
    return [DraftTree(t, p, lp) for t, p, lp in zip(tokens.tolist(), parents.tolist(), logps.tolist())]
