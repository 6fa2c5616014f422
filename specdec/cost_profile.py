"""Start-up step-cost profiles: what one engine step costs per batch size and shape.

A verifier times verify steps of `width` tokens per sequence (shape "verify:W"); a drafter times
chains ("chain:K"), overlap pre-drafts ("pre:K": K assumed tokens, then K+1 drafted) and trees
("tree:T/D/B"). Both report the figures in ServiceInfo.step_costs; the gateway's `--mode auto`
prices its choices with them (gateway/auto/costs.py). The services measure with their real step
path, after warm-up and CUDA-graph capture, on dummy sequences that are closed afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # (the gateway reads the shapes and StepCost; only the engines time steps)
    import torch


# Shapes `--mode auto` chooses from (gateway/auto/policy.py); the drafter profiles these.
# The trees are the drafters' captured default shapes (drafter_svc/draft_graphs.py).
AUTO_CHAIN_KS = (1, 2, 3, 4, 6, 8)
AUTO_TREES = ((2, 4, 8), (4, 4, 16), (4, 5, 16), (8, 6, 32), (8, 7, 64))   # (topk, depth, budget)
VERIFY_WIDTHS = tuple(sorted({1, *(k + 1 for k in AUTO_CHAIN_KS), *(b + 1 for _, _, b in AUTO_TREES)}))
# The wide trees pay where a step costs its launches more than its tokens (a GPU at low load); on a
# CPU a step costs in proportion to its tokens, so they are not profiled there (and auto, which
# chooses only what both profiles price, leaves them out).
NARROW_WIDTH = 17


def profiled_trees(device_type: str) -> tuple[tuple[int, int, int], ...]:
    """The trees a drafter on this kind of device profiles (so offers to auto)."""
    return AUTO_TREES if device_type == "cuda" else tuple(t for t in AUTO_TREES if t[2] + 1 <= NARROW_WIDTH)


@dataclass(frozen=True)
class StepCost:
    shape: str      # "verify:W", "chain:K", "pre:K", "tree:T/D/B"
    batch: int
    seconds: float


def chain_shape(k: int) -> str:
    return f"chain:{k}"


def predraft_shape(k: int) -> str:
    return f"pre:{k}"


def tree_shape(topk: int, depth: int, budget: int) -> str:
    return f"tree:{topk}/{depth}/{budget}"


def profile_batches(max_batch: int, device: torch.device) -> list[int]:
    """Batch sizes to time: powers of two up to the slot count (fewer on the CPU, where a step
    costs in proportion to its tokens and start-up time matters more)."""
    top = min(max_batch, 64 if device.type == "cuda" else 16)
    sizes = [1 << i for i in range(top.bit_length()) if 1 << i <= top]
    if sizes[-1] != top:
        sizes.append(top)
    return sizes if device.type == "cuda" else sorted({sizes[0], sizes[len(sizes) // 2], sizes[-1]})


def time_step(run: Callable[[], None], device: torch.device, reps: int) -> float:
    """The fastest of `reps` timed calls of `run`, after one untimed call: the engine's own cost.
    (Services that start together on one GPU profile at the same time; the fastest call is the
    one least slowed by the others, and the gateway measures the rest while serving.)"""
    import torch

    run()
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best
