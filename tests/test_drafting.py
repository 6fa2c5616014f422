"""Drafter engine: chains are the draft model's greedy continuation, tree nodes carry the true
cumulative log-probabilities of their paths (so tree attention and positions are right), and
KV reuse across steps gives the same drafts as drafting from scratch."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from drafter_svc.engine import DrafterEngine
from drafter_svc.types import ChainShape, DraftItem, DrafterStep, TreeShape
from specdec.model.loader import load_model
from specdec.model.runner import ModelRunner


def engine(path) -> DrafterEngine:
    return DrafterEngine(ModelRunner(load_model(path, torch.float64, torch.device("cpu"))), max_sequences=4, max_context=128)


def test_tree_nodes_score_their_paths(checkpoints):
    path = checkpoints["llama-gqa"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    eng = engine(path)
    contexts = [[1, 2, 3, 4], [50, 60, 70, 80, 90, 100, 110]]
    res = eng.step(DrafterStep(1, [DraftItem(f"s{i}", len(c), c, [], TreeShape(3, 3, 10)) for i, c in enumerate(contexts)]))
    assert not res.errors
    for ctx, draft in zip(contexts, res.drafts):
        tree = draft.tree
        assert len(tree) == 10 and all(0 <= p < i for i, p in enumerate(tree.parents, start=1))
        for node in range(1, len(tree) + 1):  # rebuild the path root -> node and score it with HF
            chain = []
            i = node
            while i:
                chain.append(tree.token_ids[i - 1])
                i = tree.parents[i - 1]
            seq = ctx + chain[::-1]
            with torch.no_grad():
                logp = torch.log_softmax(hf(torch.tensor([seq])).logits[0], -1)
            expected = logp[len(ctx) - 1, chain[-1]] if len(chain) == 1 else logp[len(seq) - 2, seq[-1]]
            assert abs(tree.logprobs[node - 1] - float(expected)) < 1e-6


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
