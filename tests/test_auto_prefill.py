"""`--mode auto` on steps that also prefill prompts: their time is not measured, so they run only off
or a choice already measured at that batch size (never a probe, a challenge or a borrowed estimate),
and they leave the policy's state alone. And the menu: overlap is offered only when the drafter has
an accelerator of its own."""

from __future__ import annotations

import dataclasses

from gateway.auto.controller import CONFIRM_MEASUREMENTS, AutoController, draft_family
from gateway.auto.policy import AutoPolicy
from gateway.request import ActiveRequest, GenerationRequest, Mode, SpecSettings
from specdec.cost_profile import AUTO_CHAIN_KS, AUTO_TREES, VERIFY_WIDTHS, StepCost, chain_shape, predraft_shape, \
    tree_shape
from specdec.sampling_params import GREEDY

BATCHES = (1, 2, 4, 8, 16, 32, 64)
DRAFT_SHAPES = [*(chain_shape(k) for k in AUTO_CHAIN_KS), *(predraft_shape(k) for k in AUTO_CHAIN_KS),
                *(tree_shape(*t) for t in AUTO_TREES)]


def controller(verifier_gpu: str = "gpu-0", drafter_gpu: str = "gpu-1", cycle: bool = False,
               replan_every: int = 1) -> AutoController:
    verify = [StepCost(f"verify:{w}", b, 0.01) for w in VERIFY_WIDTHS for b in BATCHES]
    draft = [StepCost(s, b, 0.0005) for b in BATCHES for s in DRAFT_SHAPES]
    return AutoController(verify, lambda: (draft, [drafter_gpu]), 64, replan_every=replan_every, cycle=cycle,
                          verifier_accelerators=[verifier_gpu])


def request(i: int) -> ActiveRequest:
    req = GenerationRequest(f"q{i}", [1, 2, 3], 8, [], False, SpecSettings(Mode.AUTO), GREEDY)
    return ActiveRequest(req=req, seq_id=f"s{i}", mode=Mode.AUTO, detok=None, sampling=GREEDY, drafter="d:1")


def step(auto: AutoController, reqs: list[ActiveRequest], prefilling: bool, accept: bool = True) -> None:
    """One step where every draft is accepted whole (or, accept=False, none of it); its time is the
    profile's (measured only without a prefill, as the scheduler does)."""
    auto.plan(reqs, prefilling)
    for r in reqs:
        depth = r.settings.k if r.mode == Mode.CHAIN else r.settings.depth if r.mode == Mode.TREE else 0
        r.draft_family = draft_family(r.settings, r.mode)
        auto.observe_verdict(r, depth, depth if accept else 0)
    if not prefilling:
        auto.observe_step(0.01 + 0.0005 * any(r.mode != Mode.OFF for r in reqs))


def policy_state(p: AutoPolicy) -> tuple:
    return p.current, p.steps_off, p.probe_interval, p.plans_since_challenge


def test_prefill_steps_run_only_off_or_a_choice_measured_at_their_batch_size():
    auto = controller()
    reqs = [request(i) for i in range(4)]
    for _ in range(10):      # nothing measured yet: not even the first probe runs beside a prefill
        step(auto, reqs, prefilling=True)
        assert all(r.mode == Mode.OFF for r in reqs)
    policy = auto.policies[True]
    assert policy_state(policy) == (policy.current, 0, policy.probe_start, 0)
    speculated = set()
    for i in range(300):
        prefilling = i % 3 == 2
        before = policy_state(policy)
        step(auto, reqs, prefilling)
        choices = {r.choice for r in reqs}
        if prefilling:
            assert policy_state(policy) == before
            assert all(c == "off" or policy.calibration.measured(c, len(reqs)) >= CONFIRM_MEASUREMENTS
                       for c in choices), choices
            speculated |= choices - {"off"}
    assert speculated    # drafts that always pay run beside prefills once measured


def test_overlap_is_on_the_menu_only_for_a_drafter_with_its_own_accelerator():
    def menu_of(auto: AutoController) -> list:
        step(auto, [request(0)], prefilling=False)
        return auto.policies[True].choices

    own, shared = menu_of(controller()), menu_of(controller(drafter_gpu="gpu-0"))
    assert any(c.overlap for c in own) and not any(c.overlap for c in shared)
    assert {c for c in own if not c.overlap} == set(shared)
    assert any(c.overlap for c in menu_of(controller(drafter_gpu="gpu-0", cycle=True)))   # tests switch through all


def test_a_request_joining_an_off_plan_made_for_ending_requests_gets_a_plan_of_its_own():
    """Off chosen because every request was at its last token (a draft could gain nothing) must not
    hold back a request that joins with its whole answer ahead (the cached plan would keep it off
    for up to `replan_every` steps: a short answer's whole life)."""
    auto = AutoController([StepCost(f"verify:{w}", b, 0.01) for w in VERIFY_WIDTHS for b in BATCHES],
                          lambda: ([StepCost(s, b, 0.0005) for b in BATCHES for s in DRAFT_SHAPES], ["gpu-1"]), 64,
                          verifier_accelerators=["gpu-0"])    # plans kept for 8 steps, as served
    warm = [request(i) for i in range(4)]
    for _ in range(40):
        step(auto, warm, prefilling=False)     # every draft accepted: auto speculates
    assert any(r.mode != Mode.OFF for r in warm)
    ending = [dataclasses.replace(r, req=dataclasses.replace(r.req, max_new_tokens=r.generated + 1)) for r in warm]
    for _ in range(2):     # off chosen twice running, and measured: kept for the next steps
        step(auto, ending, prefilling=False)
        assert all(r.mode == Mode.OFF for r in ending)
    fresh = request(99)
    step(auto, ending[1:] + [fresh], prefilling=False)     # the same batch size: the cached plan applies
    assert fresh.mode != Mode.OFF and all(r.mode == Mode.OFF for r in ending[1:])
