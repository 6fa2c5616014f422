"""`--mode auto` under a stream of arriving prompts: a step that admits one costs more (the verifier's
prefill, the drafter's catch-up), more so for a speculating step, and speculation, committing more
tokens a step, brings a prompt into more of its steps, unless clients run in lockstep. The H200
closed loop at a = 0.8, C = 32 had clean chain steps ahead of off and chain at 0.79x of off in
all; auto must see what the steps of each kind really take."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gateway.auto.controller import WARMUP_STEPS as WARMUP, AutoController, draft_family
from gateway.auto.costs import RequestLengths, StepOverheads
from gateway.auto.policy import OFF, Choice, Plan
from gateway.request import ActiveRequest, GenerationRequest, Mode, SpecSettings
from specdec.cost_profile import AUTO_CHAIN_KS, AUTO_TREES, VERIFY_WIDTHS, StepCost, chain_shape, tree_shape
from specdec.sampling_params import GREEDY

BATCHES = (1, 2, 4, 8, 16, 32, 64)


def test_overheads_are_a_kinds_excess_per_admitted_prompt_and_borrow_the_nearest():
    o = StepOverheads(window=16, min_prompts=8)
    for _ in range(7):
        o.observe(False, 32, 0.002, 1, prefilling=True)
    assert o.per_admission(False, 32) == 0.0                 # too few prompts yet
    o.observe(False, 32, 0.002, 1, prefilling=True)
    assert o.per_admission(False, 32) == pytest.approx(0.002)
    assert o.per_admission(True, 32) == pytest.approx(0.002)  # speculation borrows off's until measured
    assert o.per_admission(True, 4) == pytest.approx(0.002)   # ... as off is charged there (its nearest)
    assert o.per_admission(False, 4) == pytest.approx(0.002)  # off: its own figure at the nearest size
    for excess, admitted in ((0.0, 0), (0.020, 4)) * 4:   # four prompts every other step, a batch of 32
        o.observe(True, 32, excess, admitted, prefilling=admitted > 0)
    o.observe(True, 62, 0.5, 32, prefilling=True)             # 32 joining 30: the bucket of 64
    assert o.per_admission(True, 32) == pytest.approx(0.08 / 16)
    assert o.per_admission(True, 64) == pytest.approx(0.5 / 32)
    assert o.per_admission(False, 32) == pytest.approx(0.002)
    o.observe(False, 2, 0.012, 8, prefilling=False)          # off at batch 2: nearer 4 than 32 is
    assert o.per_admission(False, 4) == pytest.approx(0.0015)
    # Speculation unmeasured at a size: its own figure at the nearest size that has one...
    assert o.per_admission(True, 16) == pytest.approx(0.08 / 16)
    o.observe(False, 8, 0.08, 8, prefilling=False)            # off's prompts at 8: 10 ms each
    assert o.per_admission(True, 8) == pytest.approx(0.01)    # ... never below what off is charged there
    for _ in range(513):   # a spell of other buckets: speculation's old figures expire, off's stand
        o.tick()
    assert o.per_admission(False, 32) == pytest.approx(0.002)
    assert o.per_admission(True, 32) == pytest.approx(0.002)  # borrowed from off again


def test_a_group_of_prompts_is_charged_with_the_steps_its_admission_slowed():
    """Prompts admitted in groups (gateway/admission.py), as off's steps ran on the stand-ins at C = 64
    (ms over the clean price): 9 prompts, a step they still slowed, steady steps, then 1 prompt and
    its follow-up. Per prompt that is the excess of each group's steps over the 10 prompts; leaving
    out the step of largest excess alone charged 22 ms to the one prompt left."""
    o = StepOverheads(window=16, min_prompts=8)
    for excess_ms, admitted in [(0.4, 0), (27.0, 9), (7.0, 0), *[(0.5, 0)] * 6, (12.0, 1), (3.0, 0),
                                *[(-0.5, 0)] * 10]:
        o.observe(False, 60, excess_ms / 1e3, admitted, prefilling=admitted > 0)
    assert o.per_admission(False, 64) == pytest.approx(0.0049)   # (27 + 7 + 12 + 3) / 10; the steady steps: none's


def test_a_group_takes_the_steps_that_prefill_its_prompts_and_a_wave_is_a_group():
    """A wave admitted beside a few running requests: its chunked prefill slows the next steps, and the
    drafter's first feed of its prompts the step after. Those steps are the wave's, at the batch it
    joins, not the cost of the group of prompts admitted before it (on the H100 that charged chain
    k=4's prompts 24 ms each, where they cost 3-4); and a wave's prompts cost what they cost (left
    out, they priced mode off, whose lockstep clients admit nothing but waves, at its clean steps)."""
    o = StepOverheads(window=16, min_prompts=8)
    for _ in range(3):   # groups of 4 prompts beside 28 requests, 4 ms each, the step after included
        o.observe(True, 32, 0.012, 4, prefilling=True)
        o.observe(True, 32, 0.004, 0, prefilling=False)
        o.observe(True, 32, 0.001, 0, prefilling=False)   # past the group: noise, nobody's
    o.observe(True, 32, 0.050, 28, prefilling=True)         # a wave of 28 beside 4 running
    o.observe(True, 32, 0.050, 0, prefilling=True)          # its chunks
    o.observe(True, 32, 0.030, 0, prefilling=False)         # the wave's first drafts
    o.observe(True, 32, 0.001, 0, prefilling=False)
    assert o.per_admission(True, 32) == pytest.approx((3 * 0.016 + 0.130) / 40)


def test_a_wave_into_an_empty_batch_counts_for_both_kinds():
    o = StepOverheads(window=16, min_prompts=8)
    o.observe(True, 32, 0.080, 8, prefilling=True)     # speculation's own group: 10 ms a prompt
    o.observe(None, 32, 0.128, 32, prefilling=True)    # nothing ran but 32 prompts: 4 ms each
    assert o.per_admission(False, 32) == pytest.approx(0.004)
    assert o.per_admission(True, 32) == pytest.approx(0.208 / 40)


def test_steps_that_prefill_prompts_of_earlier_groups_are_shared_with_them():
    """A wave into a batch of one on the H100 (C = 64, ms over clean): 43 prompts joined under off, 20
    more under chain k=4 the step after, and the next five steps prefilled all 63 in chunks. Each
    group takes those steps by its prompts (where the newest group took every step, the chain's took
    them all: 5.4 ms a prompt where the chain row's prompts cost 3.3, and auto ran off at 0.88x of
    chain k=4). Prompts finish their prefill in the order they came: a step that still prefills
    only the newest group's prompts is that group's."""
    o = StepOverheads(window=16, min_prompts=8)
    o.observe(False, 44, 0.046, 43, prefilling=True)
    o.observe(True, 64, 0.020, 20, prefilling=True, carried=43)
    for _ in range(5):
        o.observe(True, 64, 0.020, 0, prefilling=True, carried=63)
    o.observe(True, 64, 0.002, 0, prefilling=False)        # the step after: both groups' first drafts
    shared = 6 * 0.020 + 0.002
    assert o.per_admission(True, 64) == pytest.approx(shared / 63)
    assert o.per_admission(False, 64) == pytest.approx((0.046 + shared * 43 / 63) / 43)
    o.observe(False, 20, 0.010, 8, prefilling=True)       # 8 prompts, then 4 more while they prefill
    o.observe(False, 24, 0.012, 4, prefilling=True, carried=8)
    o.observe(False, 24, 0.006, 0, prefilling=True, carried=4)   # only the 4 still prefill
    o.observe(False, 24, 0.0, 0, prefilling=False)
    assert o.per_admission(False, 32) == pytest.approx((0.010 + 0.012 + 0.006) / 12)
    assert o.groups[(False, 32)][0][1] == pytest.approx(0.010 + 0.012 * 8 / 12)


def test_steps_of_requests_auto_did_not_plan_are_not_charged_to_its_kinds():
    """A gateway also runs requests that named a mode: a step of theirs that takes in prompts has no
    plan of auto's and no price, and its whole time is not a prompt's cost (on the H100 a sweep's
    fixed rows before auto's made chain k=2 cost 718 ms a step in prompts at C = 64)."""
    auto = controller()
    auto.plan([new_request(i) for i in range(8)])
    policy = auto.policies[True]
    fixed = []
    for i in range(32):
        req = GenerationRequest(f"f{i}", [1, 2, 3], 64, [], False, SpecSettings(Mode.CHAIN, k=4), GREEDY)
        fixed.append(ActiveRequest(req=req, seq_id=f"f{i}", mode=Mode.CHAIN, detok=None, sampling=GREEDY,
                                   drafter="d:1"))
    for step in range(WARMUP + 24):
        auto.plan(fixed, prefilling=True)
        auto.observe_step(0.040, prefilling=True, admitted=4 if step % 2 else 0, active=32)
    assert policy.overheads.per_admission(False, 32) == policy.overheads.per_admission(True, 32) == 0.0


def test_a_choice_admits_prompts_as_often_as_it_ends_requests():
    """64-token answers: a choice committing 32 tokens a step ends (and so admits) half a request a
    step, one committing 96 three times as many. The mean follows the last `window` requests."""
    lengths = RequestLengths(window=4)
    assert lengths.admissions(32.0) == 0.0   # until a request ended
    for n in (60, 68, 64, 64):
        lengths.observe(n)
    assert lengths.admissions(32.0) == pytest.approx(0.5) and lengths.admissions(96.0) == pytest.approx(1.5)
    for _ in range(4):   # longer answers now
        lengths.observe(128)
    assert lengths.admissions(32.0) == pytest.approx(0.25)


def test_running_requests_are_expected_to_reach_the_lengths_of_the_requests_that_outlived_them():
    """A burst of two-token requests ended (the sweep's warm-ups, 64 of them at C = 64) and the requests
    running have generated more than that: those lengths say nothing about when they end. Each is
    expected at the mean of the ended lengths beyond what it generated, capped at its own limit; the
    batch at the harmonic mean of those."""
    lengths = RequestLengths(window=8)
    for n in (2, 2, 2, 2, 2, 2, 64, 64):
        lengths.observe(n)
    assert lengths.admissions(64.0) == pytest.approx(64.0 / 17.5)   # the window's mean, before `running`
    lengths.running(np.array([5.0, 10.0]), np.array([64.0, 64.0]))
    assert lengths.admissions(64.0) == pytest.approx(1.0)           # both end at 64 tokens
    lengths.running(np.array([0.0, 1.0]), np.array([64.0, 64.0]))  # not past the burst's length yet
    assert lengths.admissions(64.0) == pytest.approx(64.0 / 17.5)
    lengths.running(np.array([5.0, 70.0]), np.array([32.0, 200.0]))   # capped at 32; none outlived 70: its limit
    assert lengths.admissions(64.0) == pytest.approx(64.0 * (1 / 32 + 1 / 200) / 2)


def test_the_controller_prices_admissions_from_the_running_requests_lengths():
    """A plan's overheads use what the requests it is for have generated: after a burst of two-token
    requests ended, a batch of requests past two tokens is priced at their own limit's length."""
    auto = controller()
    reqs = [new_request(i) for i in range(8)]
    for r in reqs:
        r.req = dataclasses.replace(r.req, max_new_tokens=64)
        r.tokens += [7] * 10   # 10 generated
    auto.plan(reqs)
    policy = auto.policies[True]
    for _ in range(8):
        policy.lengths.observe(2)
    auto.plans.clear()   # a full plan next step
    auto.plan(reqs)
    assert policy.lengths.admissions(64.0) == pytest.approx(1.0)


def test_a_choices_overhead_is_its_admissions_times_its_kinds_cost_per_prompt():
    """Off's cost per prompt, measured while off stood, prices a chain committing four tokens a
    request at four times off's admissions: the figure follows the choice, not the spell in which
    it was measured (off measured right after a wave began, at many prompts a step, priced off at
    0.69x of what it ran on the H100, and speculation at 0.73x of off ran instead)."""
    auto = controller()
    reqs = [new_request(i) for i in range(32)]
    auto.plan(reqs)
    policy = auto.policies[True]
    policy.current = OFF
    off = Plan(OFF, [], 1000.0, batch=32, seconds=0.0085)
    for _ in range(16):   # a burst: 8 prompts in every step, 2 ms each
        policy.observe_overhead(off, 0.0085 + 0.016, 8, True, 32)
    for _ in range(8):    # 64-token answers: at 32 tokens a step, a prompt every other step
        policy.lengths.observe(64)
    assert policy._overhead(False, 32, 32.0) == pytest.approx(0.5 * 0.002)
    assert policy._overhead(True, 32, 128.0) == pytest.approx(4 * 0.5 * 0.002)   # borrowed cost, 4x the prompts


def test_off_steps_taken_while_speculation_stands_do_not_price_off():
    """A step that admits a prompt plans among measured choices only, often just off: while
    speculation stands, such off steps carry the prefill, and as off's samples they made off look
    far slower than it runs (stand-ins, C = 32: priced ~1,800 tok/s, ran ~2,800)."""
    auto = controller()
    reqs = [new_request(i) for i in range(32)]
    auto.plan(reqs)
    policy = auto.policies[True]
    slow_off = Plan(OFF, [], 1000.0, batch=32, seconds=0.0085)
    policy.current = Choice(Mode.CHAIN, 4)
    for _ in range(16):
        policy.observe_overhead(slow_off, 0.0085 + 0.0075, 1, True, 32)
    assert policy.overheads.per_admission(False, 32) == 0.0
    policy.current = OFF   # off standing: its steps, prompts and all, are off's
    for _ in range(16):
        policy.observe_overhead(slow_off, 0.0085 + 0.0075, 1, True, 32)
    assert policy.overheads.per_admission(False, 32) == pytest.approx(0.0075)


# The true costs of the simulated server (seconds): clean steps, and what a step that admits costs more.
OFF_STEP, CHAIN_TOKEN_DRAFT, TREE_STEP = 0.0085, 0.0046, 0.060
EXTRA_OFF, EXTRA_SPECULATING = 0.006, 0.018
LENGTH, BATCH, ACCEPTANCE = 64, 32, 0.8


def controller(replan_every: int = 1) -> AutoController:
    """Profiles that see none of it: every verify 10 ms, drafts nearly free."""
    verify = [StepCost(f"verify:{w}", b, 0.01) for w in VERIFY_WIDTHS for b in BATCHES]
    shapes = [*(chain_shape(k) for k in AUTO_CHAIN_KS), *(tree_shape(*t) for t in AUTO_TREES)]
    draft = [StepCost(s, b, 0.0005) for b in BATCHES for s in shapes]
    return AutoController(verify, lambda: (draft, ["gpu-1"]), 64, replan_every=replan_every,
                          verifier_accelerators=["gpu-0"])


def new_request(i: int) -> ActiveRequest:
    req = GenerationRequest(f"q{i}", [1, 2, 3], 10_000, [], False, SpecSettings(Mode.AUTO), GREEDY)
    return ActiveRequest(req=req, seq_id=f"s{i}", mode=Mode.AUTO, detok=None, sampling=GREEDY, drafter="d:1")


def closed_loop(auto: AutoController, steps: int, fixed: Mode | None = None, k: int = 4,
                lockstep: bool = False, extras: tuple[float, float] = (EXTRA_OFF, EXTRA_SPECULATING),
                token_draft: float = CHAIN_TOKEN_DRAFT) -> float:
    """BATCH clients, each sending a LENGTH-token request as soon as its last one ended; a step that
    admits costs its kind's extra. fixed: every step runs that mode (chain of k) instead of auto's
    plan; lockstep: the clients start together (mode off then keeps them in step: all their prompts
    arrive in one step of LENGTH); extras: what a step that admits costs more, off and
    speculating; token_draft: a chain's draft cost per token. -> tokens per second over the
    second half."""
    rng = np.random.default_rng(0)
    reqs = [new_request(i) for i in range(BATCH)]
    starts = [LENGTH] * BATCH if lockstep else rng.integers(1, LENGTH + 1, BATCH)
    left = {r.seq_id: int(n) for r, n in zip(reqs, starts)}
    opened, tokens, seconds = BATCH, 0, 0.0
    for step in range(steps):
        admitted, opened_now = opened, opened
        auto.plan(reqs, prefilling=admitted > 0)
        if fixed is not None:
            for r in reqs:
                r.mode, r.settings = fixed, SpecSettings(fixed, k=k)
        committed = 0
        for r in reqs:
            depth = r.settings.k if r.mode == Mode.CHAIN else r.settings.depth if r.mode == Mode.TREE else 0
            accepted = 0
            while accepted < depth and rng.random() < ACCEPTANCE:
                accepted += 1
            r.draft_family = draft_family(r.settings, r.mode)
            auto.observe_verdict(r, depth, accepted)
            committed += accepted + 1
            left[r.seq_id] -= accepted + 1
        modes = {r.mode for r in reqs}
        speculating = modes != {Mode.OFF}
        clean = (TREE_STEP if Mode.TREE in modes else
                 OFF_STEP + token_draft * max((r.settings.k for r in reqs if r.mode == Mode.CHAIN), default=0))
        took = clean + extras[speculating] * (opened_now > 0)
        auto.observe_step(took, prefilling=admitted > 0, admitted=opened_now, active=BATCH)
        opened = 0
        for i, r in enumerate(reqs):
            if left[r.seq_id] <= 0:   # its client sends the next one at once
                r.tokens = [0] * (len(r.req.prompt_ids) + LENGTH)
                auto.forget(r)
                reqs[i] = new_request(BATCH * (step + 1) + i)
                left[reqs[i].seq_id] = LENGTH
                opened += 1
        if step >= steps // 2:
            tokens, seconds = tokens + committed, seconds + took
    return tokens / seconds


@pytest.mark.parametrize("lockstep", [False, True])
def test_auto_sees_what_the_steps_of_each_kind_really_take(lockstep):
    """With clients out of step, auto must end within 5% of off, the best fixed mode. With clients
    that start together, off alone keeps them in step (a prompt step in every LENGTH); any step
    of speculation puts them out of step for good, so the bar there is off with clients out of
    step: auto must not mistake that traffic's prompt steps for a reason to speculate."""
    off = closed_loop(controller(), 1500, fixed=Mode.OFF)
    chain = closed_loop(controller(), 1500, fixed=Mode.CHAIN, lockstep=lockstep)
    assert chain < 0.92 * off                        # with every cost counted, off is best here ...
    clean_off, clean_chain = BATCH / OFF_STEP, BATCH * (1 - ACCEPTANCE ** 5) / (1 - ACCEPTANCE) / (
        OFF_STEP + 4 * CHAIN_TOKEN_DRAFT)
    assert clean_chain > 1.05 * clean_off            # ... though clean steps alone say chain k=4
    got = closed_loop(controller(), 1500, lockstep=lockstep)
    assert got >= 0.95 * off


def test_off_in_lockstep_is_priced_with_its_waves_all_cycle_long():
    """Clients that mode off keeps in lockstep: once every answer's length, the batch empties and a
    wave of their prompts comes in (4 ms each), then clean steps. Off's price must carry its half a
    prompt a step (2 ms) at every step of the cycle. With waves left out, and admissions counted
    over a window of steps (which held a wave or none), off was priced at its clean steps: H100,
    C = 32, 3,200 tok/s where off ran 2,440, and auto ran off at 0.92x of chain k=4."""
    auto = controller()
    reqs = [new_request(i) for i in range(BATCH)]
    auto.plan(reqs)
    policy = auto.policies[True]
    charges = []
    for cycle in range(3):
        auto.plan([])   # nothing running: the wave is the step's only work
        auto.observe_step(BATCH * 0.004, prefilling=True, admitted=BATCH, active=BATCH)
        for _ in range(LENGTH - 1):
            auto.plan(reqs)
            (_, plan, _), = auto.step_plans
            auto.observe_step(plan.seconds, active=BATCH)   # clean steps, at their price
            charges.append(policy._overhead(False, BATCH, float(BATCH)))
        for i, r in enumerate(reqs):
            r.tokens = [0] * (len(r.req.prompt_ids) + LENGTH)
            auto.forget(r)
            reqs[i] = new_request(BATCH * (cycle + 1) + i)
    assert policy.current == OFF
    assert charges[-LENGTH + 1:] == pytest.approx([0.5 * 0.004] * (LENGTH - 1))


def test_prompts_joining_every_few_steps_do_not_keep_auto_from_trying_speculation():
    """Clients out of step at C = 32: a prompt joins every step or two. Each join is planned on a
    step that prefills, among measured choices only; such a plan of off must not restart the
    count to the next full plan (the gateway replans every 8 steps), or speculation is never tried
    (it was not: off for good here, where chain k=4 runs at 1.16x of off)."""
    cheap = dict(extras=(0.001, 0.001), token_draft=0.004)
    off = closed_loop(controller(8), 1500, fixed=Mode.OFF, **cheap)
    chain = closed_loop(controller(8), 1500, fixed=Mode.CHAIN, **cheap)
    assert chain > 1.1 * off
    assert closed_loop(controller(8), 1500, **cheap) >= 0.97 * chain
