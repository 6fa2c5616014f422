"""Warm-up: run every kernel path the drafter serves with once before it reports SERVING.

As for the verifier (verifier_svc/warmup.py): Triton kernels compile on first use, which must
happen (or fail) at start-up, not on a user's first request. The paths: catch-up prefill, greedy
and sampled chains (with assumed tokens, as overlap pre-drafts send them), greedy and sampled
trees. The warm-up's sequences are closed and the counters restored.
"""

from __future__ import annotations

import torch

from drafter_svc.eagle3_engine import Eagle3DrafterEngine
from drafter_svc.engine import DrafterEngine
from drafter_svc.types import ChainShape, DraftItem, DrafterStep, TreeShape
from specdec.sampling import GREEDY, SamplingParams

SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, top_k=4, seed=1)
PROMPT = [1, 2, 3]
TREE = TreeShape(topk=2, depth=2, budget=3)


def warm_up(engine: DrafterEngine | Eagle3DrafterEngine) -> None:
    if isinstance(engine, Eagle3DrafterEngine):
        return warm_up_eagle3(engine)
    opened = engine.table.opened
    prompt = [t % engine.runner.spec.vocab_size for t in PROMPT]
    try:
        for n, sampling in enumerate((GREEDY, SAMPLED)):
            sid = f"warmup-{n}"
            _step(engine, DrafterStep(4 * n + 1, [DraftItem(sid, len(prompt), prompt, [], ChainShape(2), sampling)]))
            _step(engine, DrafterStep(4 * n + 2, [DraftItem(sid, len(prompt), [], prompt[:1], ChainShape(3), sampling)]))
            _step(engine, DrafterStep(4 * n + 3, [DraftItem(sid, len(prompt), [], [], TREE, sampling)]))
            _step(engine, DrafterStep(4 * n + 4, close=[sid]))
    finally:
        engine.close(["warmup-0", "warmup-1"])
        engine.table.opened = opened
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)  # surface asynchronous kernel errors here


def _step(engine: DrafterEngine | Eagle3DrafterEngine, step: DrafterStep) -> None:
    result = engine.step(step)
    if result.errors:
        raise RuntimeError(f"warm-up step {step.step} was refused: {result.errors}")


def warm_up_eagle3(engine: Eagle3DrafterEngine) -> None:
    """Every path once before SERVING (compiles the Triton kernels on the GPU): opening catch-up,
    a chain, an overlap pre-draft with assumed tokens; the warm-up sequence is closed again."""
    opened = engine.table.opened
    prompt, zeros = [1, 2, 3], torch.zeros(2, engine.aux_width, dtype=engine.dtype)
    try:
        _step(engine, DrafterStep(1, [DraftItem("warmup", 3, prompt, [], ChainShape(2), hidden=zeros)]))
        _step(engine, DrafterStep(2, [DraftItem("warmup", 3, [], prompt[:2], ChainShape(3))]))
    finally:
        engine.close(["warmup"])
        engine.table.opened = opened
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
