"""What `--mode auto` costs the gateway a step in Python, apart from the services: the controller's
plan for the batch, the verdicts recorded and the step observed, on synthetic cost profiles (an
8 ms plain step, a 2 ms draft) with every request's drafts either always accepted or never
(settled on off). The step loop itself, gRPC and emission are not in it; mode off pays none of this.

    python scripts/bench_auto_bookkeeping.py --batch 1 32 64 --acceptance 0 1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # allow running without installing

from gateway.auto.controller import AutoController, draft_family  # noqa: E402
from gateway.request import ActiveRequest, GenerationRequest, Mode, SpecSettings  # noqa: E402
from specdec.cost_profile import AUTO_CHAIN_KS, AUTO_TREES, VERIFY_WIDTHS, StepCost, chain_shape, \
    predraft_shape, tree_shape  # noqa: E402
from specdec.log import configure_logging  # noqa: E402
from specdec.sampling_params import GREEDY  # noqa: E402

BATCHES = (1, 2, 4, 8, 16, 32, 64)
DRAFT_SHAPES = [*(chain_shape(k) for k in AUTO_CHAIN_KS), *(predraft_shape(k) for k in AUTO_CHAIN_KS),
                *(tree_shape(*t) for t in AUTO_TREES)]


def controller() -> AutoController:
    verify = [StepCost(f"verify:{w}", b, 0.008 * max(1.0, b * w / 256)) for w in VERIFY_WIDTHS for b in BATCHES]
    draft = [StepCost(s, b, 0.002) for b in BATCHES for s in DRAFT_SHAPES]
    return AutoController(verify, lambda: (draft, ["gpu-0"]), 64, verifier_accelerators=["gpu-0"])


def requests(n: int) -> list[ActiveRequest]:
    return [ActiveRequest(req=GenerationRequest(f"q{i}", [1, 2, 3], 10**9, [], False, SpecSettings(Mode.AUTO), GREEDY),
                          seq_id=f"s{i}", mode=Mode.AUTO, detok=None, sampling=GREEDY, drafter="d:1")
            for i in range(n)]


def step(auto: AutoController, reqs: list[ActiveRequest], accept: bool, seconds: float) -> None:
    auto.plan(reqs, False)
    for r in reqs:
        depth = r.settings.k if r.mode == Mode.CHAIN else r.settings.depth if r.mode == Mode.TREE else 0
        r.draft_family = draft_family(r.settings, r.mode)
        auto.observe_verdict(r, depth, depth if accept else 0)
    auto.observe_step(seconds)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32, 64])
    p.add_argument("--acceptance", type=float, nargs="+", default=[0.0, 1.0], choices=[0.0, 1.0])
    p.add_argument("--warmup", type=int, default=3000, help="steps before timing (auto settles)")
    p.add_argument("--steps", type=int, default=2000, help="steps timed")
    a = p.parse_args(argv)
    configure_logging("gateway", "warning")
    print("| batch | acceptance | auto's choice | us per step |")
    print("|---|---|---|---|")
    for batch in a.batch:
        for acc in a.acceptance:
            auto, reqs = controller(), requests(batch)
            for _ in range(a.warmup):
                step(auto, reqs, acc > 0, 0.008)
            start = time.perf_counter()
            for _ in range(a.steps):
                step(auto, reqs, acc > 0, 0.008)
            us = (time.perf_counter() - start) / a.steps * 1e6
            print(f"| {batch} | {acc:g} | {reqs[0].choice} | {us:.1f} |", flush=True)


if __name__ == "__main__":
    main()
