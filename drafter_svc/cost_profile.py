"""The drafter's start-up cost profile: seconds per draft step by batch size and shape.

The shapes are those `--mode auto` chooses from (specdec/cost_profile.py): chains of k tokens,
overlap pre-drafts (k assumed tokens, then k+1 drafted) and the default trees. Runs after warm-up
(and CUDA-graph capture) through the engine's real step path on dummy sequences that are closed
afterwards; the gateway reads the figures from ServiceInfo.
"""

from __future__ import annotations

import random

import torch

from drafter_svc.eagle3_engine import Eagle3DrafterEngine
from drafter_svc.engine import DrafterEngine
from drafter_svc.types import ChainShape, DraftItem, DrafterStep, TreeShape
from specdec.cost_profile import (AUTO_CHAIN_KS, StepCost, chain_shape, predraft_shape, profile_batches,
                                  profiled_trees, time_step, tree_shape)

PROMPT_LEN = 16


def _shapes(device: torch.device, draft_vocab_size: int) -> list[tuple[str, ChainShape | TreeShape, int]]:
    """(name, shape, assumed tokens) for every profiled shape (fewer chains on the CPU, where a
    chain's cost is close to linear in k; no tree picking more tokens than the vocabulary has)."""
    ks = AUTO_CHAIN_KS if device.type == "cuda" else (1, 4, 8)
    out = [(chain_shape(k), ChainShape(k), 0) for k in ks]
    out += [(predraft_shape(k), ChainShape(k + 1), k) for k in ks]
    return out + [(tree_shape(*t), TreeShape(*t), 0) for t in profiled_trees(device.type) if t[0] <= draft_vocab_size]


def measure_draft_costs(engine: DrafterEngine | Eagle3DrafterEngine, reps: int = 3) -> list[StepCost]:
    device, vocab = engine.device, engine.table.vocab_size
    reps = reps if device.type == "cuda" else 1
    rng = random.Random(0)
    opened = engine.table.opened
    costs = []
    for batch in profile_batches(engine.table.num_slots, device):
        ids = [f"profile-{i}" for i in range(batch)]
        prompt = [rng.randrange(vocab) for _ in range(PROMPT_LEN)]
        try:
            hidden = (torch.zeros(PROMPT_LEN - 1, engine.aux_width, dtype=engine.dtype)
                      if isinstance(engine, Eagle3DrafterEngine) else None)
            _step(engine, [DraftItem(sid, PROMPT_LEN, prompt, [], ChainShape(1), hidden=hidden) for sid in ids])
            for name, shape, assumed in _shapes(device, engine.draft_vocab_size):
                items = [DraftItem(sid, PROMPT_LEN, [], prompt[:assumed], shape) for sid in ids]
                costs.append(StepCost(name, batch, time_step(lambda: _step(engine, items), device, reps)))
        finally:
            engine.close(ids)
    engine.table.opened = opened
    return costs


def _step(engine: DrafterEngine | Eagle3DrafterEngine, items: list[DraftItem]) -> None:
    result = engine.step(DrafterStep(0, items))
    if result.errors:
        raise RuntimeError(f"cost profile step refused: {result.errors[0]}")
