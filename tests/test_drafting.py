"""Drafter engine: chains are the draft model's greedy continuation, a tree is exactly the best
`budget` candidates of the EAGLE-2 expansion by path log-probability (checked against HF paths,
so tree attention and positions are right too), and KV reuse across steps gives the same drafts
as drafting from scratch."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from drafter_svc.engine import DrafterEngine
from drafter_svc.types import ChainShape, DraftItem, DrafterStep, TreeShape
from specdec.model.loader import load_model
from specdec.model.runner import ModelRunner


def engine(path) -> DrafterEngine:
    return DrafterEngine(ModelRunner(load_model(path, torch.float64, torch.device("cpu"))), max_sequences=4, max_context=128)


def hf_logp(hf, seq: list[int]) -> torch.Tensor:
    """[len(seq), V] float64 next-token log-probabilities after each prefix of seq."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([seq])).logits[0], -1)


def brute_force_candidates(hf, ctx: list[int], shape: TreeShape) -> dict[tuple[int, ...], float]:
    """EAGLE-2 expansion with HF, one path at a time: each candidate's token path -> its
    cumulative log-probability. Depth 1 is the root's top-k; each later depth takes the top-k
    children of every frontier node and keeps the best k of them as the next frontier."""
    cands: dict[tuple[int, ...], float] = {}
    frontier: list[tuple[int, ...]] = [()]
    for _ in range(shape.depth):
        children = {}
        for path in frontier:
            top = hf_logp(hf, ctx + list(path))[-1].topk(shape.topk)
            for lp, tok in zip(top.values.tolist(), top.indices.tolist()):
                children[path + (tok,)] = cands.get(path, 0.0) + lp
        cands.update(children)
        frontier = sorted(children, key=children.get, reverse=True)[: shape.topk]
    return cands


def node_paths(tree) -> list[tuple[int, ...]]:
    """Each node's token path from the root (root excluded), following the parent pointers."""
    paths: list[tuple[int, ...]] = []
    for tok, parent in zip(tree.token_ids, tree.parents):
        paths.append((paths[parent - 1] if parent else ()) + (tok,))
    return paths


# One step drafts all four (a batched expansion per shape). In the last two a deeper candidate
# outranks a shallower one at the budget's cut, so a selection by depth alone would fail them.
TREE_CASES = [
    ([1, 2, 3, 4], TreeShape(3, 3, 10)),
    ([50, 60, 70, 80, 90, 100, 110], TreeShape(3, 3, 10)),
    ([217, 22, 134, 263, 250, 209], TreeShape(4, 4, 19)),  # a depth-3 node in, a depth-2 node out
    ([146, 73, 50, 318], TreeShape(4, 4, 36)),             # a depth-4 node in, a depth-3 node out
]


def test_tree_is_the_best_budget_of_the_expansion(checkpoints):
    path = checkpoints["llama-gqa"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    eng = engine(path)
    items = [DraftItem(f"s{i}", len(ctx), ctx, [], shape) for i, (ctx, shape) in enumerate(TREE_CASES)]
    res = eng.step(DrafterStep(1, items))
    assert not res.errors
    not_by_depth = 0
    for (ctx, shape), draft in zip(TREE_CASES, res.drafts):
        tree = draft.tree
        assert len(tree) == shape.budget and all(0 <= p < i for i, p in enumerate(tree.parents, start=1))
        paths = node_paths(tree)
        cumulative = {}
        for node, toks in enumerate(paths):
            # logprobs are per node; their sum along the path is the path's log-probability
            logp = hf_logp(hf, ctx + list(toks))
            per_token = [float(logp[len(ctx) - 1 + j, t]) for j, t in enumerate(toks)]
            assert abs(tree.logprobs[node] - per_token[-1]) < 1e-6
            cumulative[toks] = cumulative.get(toks[:-1], 0.0) + tree.logprobs[node]
            assert abs(cumulative[toks] - sum(per_token)) < 1e-6
        cands = brute_force_candidates(hf, ctx, shape)
        ranked = sorted(cands, key=cands.get, reverse=True)
        chosen, left = ranked[: shape.budget], ranked[shape.budget :]
        assert cands[chosen[-1]] - cands[left[0]] > 1e-6  # no tie at the cut
        # A child whose parent was left out would hang off the root here and match no candidate.
        assert set(paths) == set(chosen)
        not_by_depth += any(len(a) > len(b) for a in chosen for b in left)
    assert not_by_depth == 2


def test_chain_is_greedy_and_kv_reuse_is_exact(checkpoints):
    path = checkpoints["qwen2-bias"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    hf.generation_config.eos_token_id = None
    eng = engine(path)
    ctx = [7, 8, 9, 10]
    first = eng.step(DrafterStep(1, [DraftItem("s", 4, ctx, [], ChainShape(4))])).drafts[0].tree.token_ids
    ref = hf.generate(torch.tensor([ctx]), max_new_tokens=8, do_sample=False, pad_token_id=0)[0, 4:].tolist()
    assert first == ref[:4]
    # Overlap pre-draft: assume the draft passes; the KV already holds it (only its last token is fed).
    pre = eng.step(DrafterStep(2, [DraftItem("s", 4, [], first, ChainShape(4))])).drafts[0].tree.token_ids
    assert pre == ref[4:8]
    # A miss: commit two drafted tokens and a different bonus token; the drafter rolls back.
    commit = first[:2] + [123]
    redo = eng.step(DrafterStep(3, [DraftItem("s", 7, commit, [], ChainShape(3))])).drafts[0].tree.token_ids
    fresh = engine(path).step(DrafterStep(1, [DraftItem("s", 7, ctx + commit, [], ChainShape(3))])).drafts[0].tree
    assert redo == fresh.token_ids


def test_stale_and_unknown_items_are_refused(checkpoints):
    eng = engine(checkpoints["llama-gqa"])
    eng.step(DrafterStep(1, [DraftItem("s", 3, [1, 2, 3], [], ChainShape(2))]))
    res = eng.step(DrafterStep(2, [
        DraftItem("s", 9, [4], [], ChainShape(2)),           # lengths do not add up
        DraftItem("ghost", 5, [1], [], ChainShape(2)),       # never opened
        DraftItem("s", 4, [4], [], ChainShape(99)),          # k out of range
    ]))
    assert [e.code.name for e in res.errors] == ["STALE", "NOT_FOUND", "INVALID"]
    assert not res.drafts


def test_incremental_catch_up_equals_drafting_from_scratch(checkpoints):
    """Random commits (partial acceptance, misses, full acceptance), overlap pre-drafts on
    assumed tokens and repeated drafts without new tokens: every draft of one long-lived sequence
    equals a fresh engine's draft from the whole context (so the KV bookkeeping is exact)."""
    import random

    path = checkpoints["llama-gqa"]
    eng = engine(path)
    rng = random.Random(11)
    context = [5, 6, 7]
    sent = 0
    for step in range(1, 25):
        assumed = [rng.randrange(380) for _ in range(rng.choice([0, 0, 1, 3]))]
        shape = ChainShape(rng.choice([1, 2, 4]))
        res = eng.step(DrafterStep(step, [DraftItem("s", len(context), context[sent:], assumed, shape)]))
        sent = len(context)
        fresh = engine(path).step(DrafterStep(1, [DraftItem("s", len(context) + len(assumed), context + assumed,
                                                            [], shape)]))
        assert res.drafts[0].tree.token_ids == fresh.drafts[0].tree.token_ids, f"step {step}"
        drafted = res.drafts[0].tree.token_ids
        kept = drafted[: rng.randrange(len(drafted) + 1)] if not assumed else []
        context += kept + [rng.randrange(380)] * rng.choice([0, 1, 1])  # sometimes nothing new at all


def test_long_context_batched_with_long_feed(checkpoints):
    """A sequence near the context limit that feeds one token, batched with a sequence that opens
    with a long prompt: the short feed's padding lies past the KV slot and must not be written
    there (it indexed out of bounds once). Both drafts equal a fresh engine's."""
    path = checkpoints["llama-gqa"]
    eng = engine(path)
    old = [(7 * i) % 300 + 1 for i in range(120)]
    new = [(11 * i) % 300 + 1 for i in range(120)]
    eng.step(DrafterStep(1, [DraftItem("old", len(old), old, [], ChainShape(1))]))
    res = eng.step(DrafterStep(2, [DraftItem("old", len(old) + 1, [42], [], ChainShape(1)),
                                   DraftItem("new", len(new), new, [], ChainShape(4))]))
    assert not res.errors
    for draft, ctx, k in zip(res.drafts, [old + [42], new], [1, 4]):
        fresh = engine(path).step(DrafterStep(1, [DraftItem("s", len(ctx), ctx, [], ChainShape(k))]))
        assert draft.tree.token_ids == fresh.drafts[0].tree.token_ids


def test_a_prompt_is_fed_apart_from_the_catch_ups(checkpoints):
    """A step where one sequence opens with a long prompt and others catch up a few tokens: the
    prompt gets a forward of its own (padding the catch-ups to the prompt's length would feed each
    of them 60 tokens), and every draft equals a fresh engine's."""
    path = checkpoints["llama-gqa"]
    eng = engine(path)
    a, b, new = [3, 4, 5], [9, 8], [(13 * i) % 300 + 1 for i in range(60)]
    eng.step(DrafterStep(1, [DraftItem("a", 3, a, [], ChainShape(2)), DraftItem("b", 2, b, [], ChainShape(2))]))
    shapes, real = [], eng.runner.forward
    eng.runner.forward = lambda batch, *rest, **kw: (shapes.append(tuple(batch.tokens.shape))
                                                     or real(batch, *rest, **kw))
    res = eng.step(DrafterStep(2, [DraftItem("a", 4, [6], [], ChainShape(1)),
                                   DraftItem("new", 60, new, [], ChainShape(1)),
                                   DraftItem("b", 5, [7, 6, 5], [], ChainShape(1))]))
    assert not res.errors
    assert sorted(shapes) == [(1, 60), (2, 3)]
    for draft, ctx in zip(res.drafts, [a + [6], new, b + [7, 6, 5]]):
        fresh = engine(path).step(DrafterStep(1, [DraftItem("s", len(ctx), ctx, [], ChainShape(1))]))
        assert draft.tree.token_ids == fresh.drafts[0].tree.token_ids


def test_chains_and_trees_in_one_step_draft_as_they_would_alone(checkpoints):
    """A step mixing chains and two tree shapes (the engine holds 4 sequences): each group drafts
    from its own rows of the catch-up's logits, so every draft equals the item drafted alone."""
    path = checkpoints["llama-gqa"]
    items = [DraftItem("a", 4, [1, 2, 3, 4], [], TreeShape(3, 3, 10)),
             DraftItem("b", 5, [9, 8, 7, 6, 5], [], ChainShape(3)),
             DraftItem("c", 3, [40, 41, 42], [], TreeShape(2, 2, 4)),
             DraftItem("d", 6, [11, 12, 13, 14, 15, 16], [], ChainShape(2))]
    together = engine(path).step(DrafterStep(1, items)).drafts
    assert len(together) == 4
    for item, draft in zip(items, together):
        alone = engine(path).step(DrafterStep(1, [item])).drafts[0]
        assert (draft.seq_id, draft.tree.token_ids, draft.tree.parents) == (
            item.seq_id, alone.tree.token_ids, alone.tree.parents), item.seq_id
