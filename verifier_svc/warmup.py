"""Warm-up: run every kernel path the verifier serves with once before it reports SERVING.

On the GPU the first call of each Triton kernel compiles it (and Triton's C driver stub), which
can take seconds or fail outright (no C compiler in the image): that must happen at start-up,
where it fails the health check, never on a user's first request. The paths: prefill (with a
shared prefix where two slots allow), a prompt in two chunks (with --prefill-chunk), greedy tree
verification, speculative sampling over a
sampled chain and over a point-mass tree, and KV compaction. The warm-up's sequences are closed
and the engine's counters restored, so it leaves no trace.
"""

from __future__ import annotations

import torch

from specdec.sampling import SamplingParams
from specdec.tree import DraftTree, Proposal
from verifier_svc.engine import VerifierEngine
from verifier_svc.types import OpenSequence, VerifierStep, VerifyItem

SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, top_k=4, seed=1)
PROMPT = [1, 2, 3]
TREE = DraftTree([1, 2, 3], [0, 0, 1])  # two children of the root, one grandchild


def warm_up(engine: VerifierEngine) -> None:
    opened, computed = engine.table.opened, engine.prefill_tokens_computed
    vocab, most = engine.spec.vocab_size, engine.max_draft_tokens
    chain = DraftTree.chain([1, 2], proposals=[Proposal([1, 0], [0.5, 0.5]), Proposal([2, 0], [0.5, 0.5])])
    prompt = [t % vocab for t in PROMPT]
    shared = engine.table.num_slots >= 2
    opens = [OpenSequence("warmup-greedy", prompt)]
    if shared:
        opens.append(OpenSequence("warmup-shared", prompt, share_prefill_with="warmup-greedy"))
    try:
        _step(engine, VerifierStep(1, open=opens))
        engine.finish_prefills()
        _step(engine, VerifierStep(2, verify=[_item(engine, "warmup-greedy", _fit(TREE, vocab, most))]))
        _step(engine, VerifierStep(3, close=[o.seq_id for o in opens],
                                   open=[OpenSequence("warmup-sampled", prompt, SAMPLED)]))
        engine.finish_prefills()
        _step(engine, VerifierStep(4, verify=[_item(engine, "warmup-sampled", _fit(chain, vocab, most))]))
        _step(engine, VerifierStep(5, verify=[_item(engine, "warmup-sampled", _fit(TREE, vocab, most))]))
        # Compaction runs only when a tree's accepted path is not already dense: force one move.
        state = engine.table.get("warmup-sampled")
        slot = engine.table.slots([state], engine.device)
        engine.runner.move(slot, torch.tensor([[1]], device=engine.device), torch.tensor([[0]], device=engine.device))
        if engine.prefills.chunk:   # a chunk after the first attends to the KV of those before it
            long = [t % vocab for t in range(min(engine.prefills.chunk + 2, engine.max_context - 1))]
            _step(engine, VerifierStep(6, close=["warmup-sampled"], open=[OpenSequence("warmup-chunked", long)]))
            engine.finish_prefills()
    finally:
        engine.close(["warmup-greedy", "warmup-shared", "warmup-sampled", "warmup-chunked"])
        engine.table.opened, engine.prefill_tokens_computed = opened, computed
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)  # surface asynchronous kernel errors here


def _fit(tree: DraftTree, vocab: int, max_nodes: int) -> DraftTree:
    """The tree's first `max_nodes` nodes (parents come first, so still a tree), token ids
    inside a (possibly tiny) vocabulary."""
    n = min(len(tree), max_nodes)
    proposals = [Proposal([t % vocab for t in p.token_ids], p.probs) for p in tree.proposals[:n]]
    if any(len(set(p.token_ids)) < len(p.token_ids) for p in proposals):
        proposals = [Proposal([t % vocab], [1.0]) for t in tree.token_ids[:n]]
    return DraftTree([t % vocab for t in tree.token_ids[:n]], tree.parents[:n], [], proposals)


def _item(engine: VerifierEngine, seq_id: str, tree: DraftTree) -> VerifyItem:
    return VerifyItem(seq_id, len(engine.table.get(seq_id).tokens), tree)


def _step(engine: VerifierEngine, step: VerifierStep) -> None:
    result = engine.step(step)
    if result.errors:
        raise RuntimeError(f"warm-up step {step.step} was refused: {result.errors}")
