"""`--mode auto` against every fixed choice, over real acceptance: verdicts recorded from SmolLM2 and its
shipped EAGLE-3 head (tests/data/smollm2_verdicts.json, scripts/record_verdicts.py) replayed through
the policy at synthetic step costs (benchmarks/auto_replay.py), one request at a time. The issue's
aim, within 3% of the best fixed choice and of off, must hold in every scenario and for every seed
(the seeds shuffle the requests and the step-time noise)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.auto_replay import SCENARIOS, fixed_rates, load, replay
from gateway.auto.policy import OFF

TRACES = Path(__file__).parent / "data" / "smollm2_verdicts.json"
SEEDS = range(4)


@pytest.fixture(scope="module")
def traces():
    return load(TRACES)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_auto_is_within_3_percent_of_the_best_fixed_choice(traces, scenario):
    costs = SCENARIOS[scenario]
    fixed = fixed_rates(traces, costs)
    best = max(fixed.values())
    for seed in SEEDS:
        rate, used = replay(traces, costs, seed)
        assert rate >= 0.97 * best, (seed, rate / best, used)
        assert rate >= 0.97 * fixed[OFF.name], (seed, rate / fixed[OFF.name], used)


def test_what_auto_runs_it_expects_no_more_of_than_it_commits(traces):
    """The policy speculates when and where its estimates are high, so unchecked it overestimates
    what it runs (a chosen chain k=4 by 25-30%); the token calibration takes that out."""
    checked = 0
    for costs in SCENARIOS.values():
        _, used = replay(traces, costs, seed=0)
        ran = [u for name, u in used.items() if name != OFF.name and not name.endswith("(probe)")]
        steps, expected, committed = (sum(u[i] for u in ran) for i in range(3))
        if steps >= 100:
            checked += 1
            assert expected <= 1.04 * committed, used
    assert checked >= 2
