"""`--mode auto` prices the slots a choice leaves empty (gateway/auto/occupancy.py): in a closed loop
each request that ends leaves its slot empty until its client's next prompt is admitted, and a choice
that ends requests more often keeps fewer slots filled (H200, 8B, C = 64: chain k=4's batch averaged
56.9 over the middle of its waves, mode off's 62.0; auto priced both at the batch in front of it and
ran chain k=4 at 0.83 of off)."""

from __future__ import annotations

import numpy as np
import pytest
from test_auto_overheads import controller, new_request
from test_auto_policy import observe, policy, profile

from gateway.auto.occupancy import Vacancies, occupancy
from gateway.auto.policy import OFF
from gateway.request import Mode


def test_an_ending_is_matched_with_the_next_admission_and_a_stale_one_dropped():
    v = Vacancies(expiry=10, min_samples=2)
    v.admitted(1, 3)                     # a load arriving: no ending to match
    assert v.steps() == 0.0
    v.ended(10)
    v.ended(11)
    v.admitted(13, 1)                    # the oldest ending first
    assert v.steps() == 0.0              # one gap: not enough yet
    v.admitted(14, 2)                    # one ending left to match
    assert list(v.gaps) == [3, 3] and v.steps() == 3.0
    v.ended(20)
    v.admitted(40, 1)                    # 20 steps on: the load fell, that slot was not refilled
    assert list(v.gaps) == [3, 3] and not v.open
    v.ended(41)
    v.admitted(44, 1)
    v.ended(45)
    v.admitted(54, 1)                    # a wave's end: its slots wait for every client to finish
    assert list(v.gaps) == [3, 3, 3, 9] and v.steps() == 3.0   # the median
    for step in (60, 70):
        v.ended(step)
        v.admitted(step + 9, 1)
    assert v.steps() == 6.0                                    # and it follows new gaps


def test_occupancy_is_littles_law_over_a_slots_cycle():
    # mode off, 64-token requests, admitted three steps after the ending: the admission step
    # commits a token, so two steps of 66 are empty
    assert occupancy(1.0, 3.0, 64.0) == pytest.approx(64 / 66)
    # a chain committing 3.3 tokens a step: 19.4 busy steps, two empty and 70% of the admission step
    assert occupancy(3.3, 3.0, 64.0) == pytest.approx((64 / 3.3) / (64 / 3.3 + 2 + (1 - 1 / 3.3)))
    assert occupancy(3.3, 0.0, 64.0) == occupancy(3.3, 3.0, None) == 1.0   # not measured: no effect


def test_a_choice_that_ends_requests_sooner_is_priced_at_the_batch_it_would_keep():
    """A chain a few percent above off at the batch in front of it falls below off once the slots
    it empties are counted; with no gap measured it still wins."""
    def verify(b, w):   # compute-bound from 90 tokens a step: a chain of 1 is 8% above off at 64
        return 0.010 * max(1.0, b * w / 90)

    def draft(b, n):
        return 0.00004 * n * b

    ids = [f"r{i}" for i in range(64)]
    choices = []
    for gap in (0, 3):
        rng = np.random.default_rng(0)
        p = policy(profile(verify, draft))
        for sid in ids:
            observe(p, sid, "chain", 0.8, 20, rng)
        for _ in range(64):
            p.lengths.observe(64)
        for step in range(16):   # endings refilled `gap` steps later
            p.vacancies.ended(step)
            p.vacancies.admitted(step + gap, 1)
        plan = p.plan(ids, 0, 1, 0.0)
        choices.append(plan.choice)
        off = p.last_off
        if gap:
            assert off.tokens_per_second == pytest.approx(64 / (off.seconds + off.overhead) * 64 / 66)
    assert choices[0].mode == Mode.CHAIN and choices[1] == OFF, choices


def test_the_controller_measures_the_gap_between_an_ending_and_the_next_admission():
    auto = controller()
    reqs = [new_request(i) for i in range(4)]
    auto.plan(reqs)                       # step 1
    policy = auto.policies[True]
    for r in reqs[:2]:
        auto.forget(r)                    # two requests end in step 1
    auto.observe_step(0.01)
    for _ in range(2):                    # steps 2 and 3 run without them
        auto.plan(reqs[2:])
        auto.observe_step(0.01)
    auto.plan(reqs[2:], prefilling=True)  # step 4 admits their successors
    auto.observe_step(0.03, prefilling=True, admitted=2, active=4)
    assert list(policy.vacancies.gaps) == [3, 3]


def test_endings_before_the_batch_emptied_refill_no_slot():
    """A prompt admitted into an empty batch (the sweep's next wave after its last requests ended
    along the tail) fills no slot a running batch did without: the endings before it are dropped."""
    v = Vacancies(expiry=64, min_samples=1)
    v.ended(10)
    v.ended(12)
    v.admitted(30, 2, into_empty=True)
    assert not v.gaps and not v.open
    v.ended(40)
    v.admitted(42, 1)
    assert list(v.gaps) == [2]


def test_the_controller_drops_the_endings_before_a_wave_into_an_empty_batch():
    auto = controller()
    reqs = [new_request(i) for i in range(2)]
    auto.plan(reqs)
    policy = auto.policies[True]
    for r in reqs:
        auto.forget(r)                    # the batch's last requests end
    auto.observe_step(0.01)
    auto.plan([], prefilling=True)        # the next wave, into an empty batch
    auto.observe_step(0.03, prefilling=True, admitted=2, active=2)
    assert not policy.vacancies.gaps and not policy.vacancies.open
