"""The verifier's start-up cost profile: seconds per verify step by batch size and width.

Runs after warm-up (and CUDA-graph capture), through the engine's real step path: for each batch
size, dummy sequences are opened, verified with chain drafts of width-1 tokens (random, so almost
never accepted and the sequences stay short), timed, and closed. The engine's counters are
restored, so the profile leaves no trace. The gateway's `--mode auto` reads it (ServiceInfo).
"""

from __future__ import annotations

import random

from specdec.cost_profile import NARROW_WIDTH, VERIFY_WIDTHS, StepCost, profile_batches, time_step
from specdec.tree import DraftTree
from verifier_svc.engine import VerifierEngine
from verifier_svc.types import OpenSequence, VerifierStep, VerifyItem

PROMPT_LEN = 16


def measure_verify_costs(engine: VerifierEngine, reps: int = 3) -> list[StepCost]:
    vocab, device = engine.table.vocab_size, engine.device
    reps = reps if device.type == "cuda" else 1   # the CPU is not shared with other kernels' queues
    widths = [w for w in VERIFY_WIDTHS if w - 1 <= engine.max_draft_tokens]
    if device.type != "cuda":   # a CPU step costs in proportion to its tokens: three widths suffice
        widths = [w for w in widths if w <= NARROW_WIDTH]   # (no wide trees there: profiled_trees)
        widths = sorted({widths[0], widths[len(widths) // 2], widths[-1]})
    rng = random.Random(0)
    opened, computed = engine.table.opened, engine.prefill_tokens_computed
    costs = []
    for batch in profile_batches(engine.table.num_slots, device):
        ids = [f"profile-{i}" for i in range(batch)]
        try:
            engine.step(VerifierStep(0, open=[OpenSequence(sid, [rng.randrange(vocab) for _ in range(PROMPT_LEN)])
                                              for sid in ids]))
            engine.finish_prefills()
            for width in widths:
                def run() -> None:
                    items = [VerifyItem(sid, len(engine.table.get(sid).tokens),
                                        DraftTree.chain([rng.randrange(vocab) for _ in range(width - 1)]))
                             for sid in ids]
                    result = engine.step(VerifierStep(0, verify=items))
                    if result.errors:
                        raise RuntimeError(f"cost profile step refused: {result.errors[0]}")

                costs.append(StepCost(f"verify:{width}", batch, time_step(run, device, reps)))
        finally:
            engine.close(ids)
    engine.table.opened, engine.prefill_tokens_computed = opened, computed
    return costs


def pass_tokens(costs: list[StepCost]) -> float:
    """What one forward's pass over the weights costs, in tokens of compute: the narrowest step's
    time (batch 1, width 1: the weights read once for one token) over what a token adds where the
    steps are largest (the largest batch profiled, its widest width against its narrowest). The
    engine weighs folding prompt chunks into a wider verify forward with it (fold_width).
    0 when the profile cannot tell (too few entries, or no growth with tokens)."""
    seconds = {(int(c.shape.removeprefix("verify:")), c.batch): c.seconds for c in costs
               if c.shape.startswith("verify:")}                          # (width, batch) -> seconds
    if (1, 1) not in seconds:
        return 0.0
    top = max(b for _, b in seconds)
    lo, hi = min(w for w, b in seconds if b == top), max(w for w, b in seconds if b == top)
    per_token = (seconds[(hi, top)] - seconds[(lo, top)]) / (top * (hi - lo)) if hi > lo else 0.0
    return seconds[(1, 1)] / per_token if per_token > 0 else 0.0
