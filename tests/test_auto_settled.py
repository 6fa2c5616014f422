"""`--mode auto` once settled on off: the controller plans rarely (the bookkeeping must not cost a plain
step a few percent), yet its probes keep their intervals in steps, so a rise in acceptance is noticed
as soon as before."""

from __future__ import annotations

import dataclasses

from test_auto_prefill import controller, request, step

from gateway.auto.controller import AutoController
from gateway.auto.policy import OFF
from gateway.request import Mode


def run(auto: AutoController, reqs, steps: int, accept: bool) -> tuple[list[int], list[int]]:
    """-> (steps that made a full plan, steps that probed); every draft accepted whole or none of it."""
    policy = auto._policy(True)
    planned, probed = [], []
    real = policy.plan

    def counting(*args, **kwargs):
        planned.append(i)
        return real(*args, **kwargs)

    policy.plan = counting
    for i in range(steps):
        step(auto, reqs, prefilling=False, accept=accept)
        if any(r.mode != Mode.OFF for r in reqs) and auto.step_plans[0][1].probe:
            probed.append(i)
    policy.plan = real
    return planned, probed


def test_settled_off_plans_rarely_and_probes_on_schedule():
    auto = controller(replan_every=8)
    reqs = [request(i) for i in range(8)]
    for r in reqs:   # requests that never end
        r.req = dataclasses.replace(r.req, max_new_tokens=10**6)
    planned, probed = run(auto, reqs, 6000, accept=False)
    policy = auto.policies[True]
    assert policy.settled_off
    late = [s for s in planned if s >= 1000]
    # Settled: a full plan every 64 steps (not every 8), plus the probes' own plans (a probe, then off).
    assert len(late) <= 5000 // 64 + 2 * len([p for p in probed if p >= 1000]) + 2, late[:20]
    # Probes after 64, 128, 256, ... steps off: the gaps double, counted in steps, not in plans.
    gaps = [b - a for a, b in zip(probed[5:], probed[6:])]
    assert gaps and all(64 <= g for g in gaps) and max(gaps) >= 1024, probed
    # And a rise in acceptance is noticed at the next probe (at most 4096 steps on): speculation resumes.
    run(auto, reqs, 4200, accept=True)
    assert policy.current != OFF and not policy.settled_off
