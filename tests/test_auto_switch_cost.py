"""`--mode auto` prices a switch from off to speculation (gateway/auto/switch_cost.py): the drafter
must first take in every token committed while its requests ran off. On stand-ins with the H100's
costs (C = 64, a = 0.8) auto switched on a predicted +10%, the catch-up took 138 ms, and the closed
loop ran at 0.85x of off."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_auto_policy import chain_winning_policy
from test_auto_prefill import controller, request

from gateway.auto.controller import WARMUP_STEPS
from gateway.auto.policy import OFF, Plan
from gateway.auto.switch_cost import SwitchCost
from gateway.request import Mode


def test_the_cost_per_row_is_learned_from_catch_ups_with_the_releases_before_them():
    s = SwitchCost(decay=0.5)
    assert s.seconds(1000) == 0.0                 # nothing seen: switches cost nothing, as before
    s.released(0.03)                              # a release step 30 ms over a plain off step
    s.released(-0.01)                             # (faster than one: no cost, not a credit)
    s.caught_up(0, 1.0)                           # no rows taken in: no evidence
    s.caught_up(200, 0.05)
    assert s.per_row == pytest.approx(0.08 / 200)
    assert s.seconds(1000) == pytest.approx(0.4)
    s.caught_up(100, 0.01)                        # the release was counted once; recent ones weigh more
    assert s.per_row == pytest.approx((0.5 * 0.08 + 0.01) / (0.5 * 200 + 100))


def test_coming_from_off_a_plan_is_weighed_net_of_the_switch_it_needs():
    p, ids = chain_winning_policy()
    remaining = np.full(len(ids), 8.0)
    free = p.plan(ids, 0, 1, 0.0, remaining=remaining, behind=3200)
    assert free.choice != OFF                     # no catch-up seen yet: the switch is priced at nothing
    assert free.tokens_per_second > 1.5 * p.last_off.tokens_per_second
    p.current = OFF
    p.switches.caught_up(100, 0.01)               # 100 us a row: 3,200 rows behind cost 0.32 s
    horizon = 8.0 * len(ids) / free.tokens_per_second
    assert horizon < 0.32                         # the requests end before the switch pays
    assert p.plan(ids, 0, 1, 0.0, remaining=remaining, behind=3200).choice == OFF
    p.current = OFF
    kept = p.plan(ids, 0, 1, 0.0, remaining=remaining, behind=0)   # nothing to catch up: it pays
    assert kept.choice == free.choice
    assert kept.tokens_per_second == pytest.approx(free.tokens_per_second, rel=0.01)   # the rate unscaled
    # Already speculating, there is no switch to pay: the rows behind (a joining prompt's) do not count.
    assert p.plan(ids, 0, 1, 0.0, remaining=remaining, behind=3200).choice == free.choice
    # With requests that have long left to run, the same switch pays for itself.
    p.current = OFF
    assert p.plan(ids, 0, 1, 0.0, remaining=np.full(len(ids), 4000.0), behind=3200).choice == free.choice


def test_the_controller_counts_the_rows_its_requests_left_the_drafter_behind_and_learns_from_catch_ups():
    auto = controller()
    warm = request(9)
    for _ in range(WARMUP_STEPS):
        auto.plan([warm])
        auto.observe_step(0.01)
    back = request(1)                             # ran off for 30 tokens past what its drafter has
    back.req = dataclasses.replace(back.req, prompt_ids=list(range(40)), max_new_tokens=10**6)
    back.tokens, back.drafter_len, back.mode = list(range(40)) + [7] * 30, 40, Mode.OFF
    fresh = request(2)                            # just joined: its drafter has none of its 3 tokens
    fresh.tokens = [1, 2, 3]
    drafting = request(3)                         # drafted last step: one committed token to append
    drafting.tokens, drafting.drafter_len, drafting.mode = [1, 2, 3, 4], 3, Mode.CHAIN
    policy = auto.policies[True]
    behind, caught = [], []
    plan = policy.plan
    policy.plan = lambda *a, **k: (behind.append(k["behind"]), plan(*a, **k))[1]
    policy.switches.caught_up = lambda rows, seconds: caught.append((rows, seconds))
    released = []
    policy.switches.released = released.append
    auto.plan([back, fresh, drafting])
    assert behind == [30 + 3]
    assert back.mode != Mode.OFF              # a new drafter is probed first, on `back`
    policy.last_off = Plan(OFF, [], 0.0, seconds=0.01)
    auto.observe_release(0.05)                # its held rows travelled: 40 ms over a plain off step
    assert released == [pytest.approx(0.04)]
    auto.plan([back, fresh, drafting])
    assert auto.catching_up
    trip = auto._draft_trip(auto.step_plans[0][1])
    auto.observe_step(0.08, draft_seconds=trip + 0.02)
    assert caught == [(30, pytest.approx(0.02))]
