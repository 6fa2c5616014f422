"""`--mode auto`'s policy replayed over recorded verdicts, at synthetic step costs, one request at a time.

The acceptance comes from real drafts: scripts/record_verdicts.py records, per held-out prompt, the
tokens each step of a fixed mode committed (SmolLM2 + the shipped EAGLE-3 head). A replay runs the
real AutoPolicy (its acceptance book, calibrations, probes, challenges): each step it plans, the
step's verdict is the recorded one of the chosen family at the request's position (a chain of k
cuts the recorded chain of 4 at k), and the step takes the scenario's time for that choice (with
a few percent of noise). What the policy cannot see comes as it does when serving: the profiles
it is given price the engines only, and each step's measured time adds the gateway's hops.

Auto is judged against every fixed choice replayed over the same verdicts. The scenarios span
the orderings that matter: the wide tree best (the H100's SmolLM2 ratios at C = 1), all
speculation a few percent below off, all of it well below off, and a CPU-like verify that grows
with the tokens it checks (a chain or small tree best).

    python -m benchmarks.auto_replay tests/data/smollm2_verdicts.json --seeds 8
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gateway.auto.acceptance import AcceptanceBook
from gateway.auto.costs import CostModel
from gateway.auto.policy import OFF, AutoPolicy, Choice, menu
from gateway.request import Mode
from specdec.cost_profile import AUTO_CHAIN_KS, AUTO_TREES, VERIFY_WIDTHS, StepCost, chain_shape, predraft_shape, \
    tree_shape

# The recorded config behind each acceptance family (chains of k <= 4 are cut from the chain of 4).
TRACED = {"chain": "chain k=4 no-overlap", "tree:2/4/8": "tree topk=2 depth=4 budget=8",
          "tree:4/5/16": "tree topk=4", "tree:8/6/32": "tree topk=8 depth=6 budget=32",
          "tree:8/7/64": "tree topk=8 depth=7 budget=64"}
RECORDED_CHAIN = 4
PROFILE_BATCHES = (1, 2, 4, 8, 16, 32, 64)   # as the services profile on a GPU


@dataclass(frozen=True)
class Costs:
    """Seconds: verify = verify0 * (1 + per_token * (tokens - 1)); draft = draft0 + per_node * depth *
    (1 + 0.02 * rows), rows = batch x topk; each step adds `hops`, a drafting one `draft_hop`
    besides (the gateway's round trips, which no profile holds)."""
    verify0: float
    per_token: float
    draft0: float
    per_node: float
    hops: float
    draft_hop: float

    def verify(self, batch: int, width: int) -> float:
        return self.verify0 * (1 + self.per_token * (batch * width - 1))

    def draft(self, rows: int, depth: int) -> float:
        return self.draft0 + self.per_node * depth * (1 + 0.02 * rows)

    def step(self, c: Choice) -> float:
        """A whole step at batch 1, as the gateway's clock sees it."""
        if c == OFF:
            return self.verify(1, 1) + self.hops
        return self.verify(1, c.width) + self.draft(c.topk or 1, c.positions) + self.hops + self.draft_hop

    def profile(self) -> CostModel:
        """What the services' start-up profiles would report (engines only)."""
        return synthetic_profile(self.verify, self.draft)


def synthetic_profile(verify, draft, shared_accelerator: bool = False) -> CostModel:
    """verify(batch, width) and draft(rows, k_or_depth) in seconds -> the CostModel that profiles of
    every shape auto chooses from, at the batch sizes a GPU service times, would give (a tree drafts
    batch x topk rows; an overlap pre-draft of k is priced as a chain of 2k + 1)."""
    v = [StepCost(f"verify:{w}", b, verify(b, w)) for w in VERIFY_WIDTHS for b in PROFILE_BATCHES]
    d = [StepCost(chain_shape(k), b, draft(b, k)) for k in AUTO_CHAIN_KS for b in PROFILE_BATCHES]
    d += [StepCost(predraft_shape(k), b, draft(b, 2 * k + 1)) for k in AUTO_CHAIN_KS for b in PROFILE_BATCHES]
    d += [StepCost(tree_shape(*t), b, draft(b * t[0], t[1])) for t in AUTO_TREES for b in PROFILE_BATCHES]
    return CostModel(v, d, shared_accelerator=shared_accelerator)


SCENARIOS = {
    "wide tree best (H100 SmolLM2 ratios)": Costs(0.0040, 0.001, 0.0020, 0.0006, 0.002, 0.003),
    "speculation a few % below off": Costs(0.0040, 0.001, 0.0020, 0.0011, 0.002, 0.003),
    "speculation well below off": Costs(0.0040, 0.001, 0.0035, 0.0008, 0.002, 0.006),
    "verify grows with its tokens (CPU-like)": Costs(0.045, 0.03, 0.004, 0.004, 0.004, 0.004),
}


def load(path: Path) -> dict[str, list[list[int]]]:
    return json.loads(Path(path).read_text())["traces"]


def replayable(choices: list[Choice], traces: dict) -> list[Choice]:
    """The choices whose verdicts the traces hold."""
    return [c for c in choices if c == OFF or (TRACED.get(c.family) in traces
                                               and (c.mode != Mode.CHAIN or c.k <= RECORDED_CHAIN))]


def _accepted(c: Choice, recorded: int) -> int:
    return min(recorded - 1, c.k) if c.mode == Mode.CHAIN else recorded - 1


def fixed_rates(traces: dict, costs: Costs) -> dict[str, float]:
    """Tokens per second of each replayable choice run for every step of every request."""
    out = {}
    for c in replayable(menu(costs.profile(), 64, False), traces):
        if c == OFF:
            out[c.name] = 1 / costs.step(OFF)
            continue
        steps = [_accepted(c, n) + 1 for request in traces[TRACED[c.family]] for n in request[1:]]
        out[c.name] = float(np.mean(steps)) / costs.step(c)
    return out


def replay(traces: dict, costs: Costs, seed: int = 0, noise: float = 0.03, max_new_tokens: int = 64):
    """-> (auto's tokens per second, {choice name: [steps, expected tokens, committed tokens]}; probes
    and challenges, priced to be tried rather than to be right, under "name (probe)").
    Requests run one at a time (seed 0 in recorded order, others shuffled); step times get
    `noise` relative Gaussian noise."""
    rng = np.random.default_rng(seed)
    profile = costs.profile()
    policy = AutoPolicy(profile, AcceptanceBook(), replayable(menu(profile, 64, False), traces))
    reference = traces[TRACED["chain"]]
    starts = {f: [np.cumsum([0] + r[:-1]) for r in traces[name]] for f, name in TRACED.items() if name in traces}
    used: dict[str, list] = {}
    tokens = seconds = 0.0
    order = rng.permutation(len(reference)) if seed else range(len(reference))
    for i in order:
        sid, total, position = f"r{i}", sum(reference[i]), reference[i][0]
        while position < total:
            plan = policy.plan([sid], 0, 1, 0.0, remaining=np.array([float(max_new_tokens - position)]))
            c = plan.choice if plan.speculating else OFF
            committed = 1
            if c != OFF:
                j = int(np.searchsorted(starts[c.family][i], position, side="right")) - 1
                committed = min(_accepted(c, traces[TRACED[c.family]][i][j]) + 1, total - position)
                policy.book.observe(sid, c.family, c.positions, committed - 1)
                if sid in plan.gains:   # (a probe expects nothing)
                    policy.observe_tokens(plan, plan.gains[sid], committed - 1, 1)
            took = costs.step(c) * (1 + noise * rng.standard_normal())
            policy.observe_step(plan, took)
            u = used.setdefault(c.name + (" (probe)" if plan.probe else ""), [0, 0.0, 0])
            u[0], u[1], u[2] = u[0] + 1, u[1] + plan.expected_tokens, u[2] + committed
            tokens, seconds, position = tokens + committed, seconds + took, position + committed
        policy.book.forget(sid)
    return tokens / seconds, used


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.auto_replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", type=Path)
    p.add_argument("--seeds", type=int, default=8)
    a = p.parse_args(argv)
    traces = load(a.traces)
    print("| scenario | best fixed (x off) | auto x off, min / mean | auto / best fixed, min / mean "
          "| auto's most run |")
    print("|---|---|---|---|---|")
    for name, costs in SCENARIOS.items():
        fixed = fixed_rates(traces, costs)
        best = max(fixed, key=fixed.get)
        runs = [replay(traces, costs, seed) for seed in range(a.seeds)]
        rates = np.array([r for r, _ in runs])
        off = fixed[OFF.name]
        counts: dict[str, int] = {}
        for _, used in runs:
            for choice, (steps, _, _) in used.items():
                counts[choice] = counts.get(choice, 0) + steps
        most = ", ".join(sorted(counts, key=counts.get, reverse=True)[:2])
        print(f"| {name} | {best} ({fixed[best] / off:.2f}x) | {rates.min() / off:.3f} / {rates.mean() / off:.3f} | "
              f"{rates.min() / fixed[best]:.3f} / {rates.mean() / fixed[best]:.3f} | {most} |")


if __name__ == "__main__":
    main()
