"""`--mode auto` with an EAGLE-3 drafter: once it has settled on off, requests admitted are parked
(mode off for life, no hidden states asked of the verifier, no drafter state), and so are the
requests already running when it settles (handed to the scheduler once, to stop their hidden
states). When the probe interval has passed, the request admitted is a scout: the next plan probes
it, and a plan after that which still chooses off parks it. Not with a drafter that needs no hidden
states, and not before auto settles."""

from __future__ import annotations

import dataclasses

import numpy as np

from gateway.auto.controller import AutoController, draft_family, step_width
from gateway.release_budget import ReleaseBudget
from gateway.request import ActiveRequest, GenerationRequest, Mode, SpecSettings
from specdec.cost_profile import AUTO_CHAIN_KS, AUTO_TREES, VERIFY_WIDTHS, StepCost, chain_shape, predraft_shape, \
    tree_shape
from specdec.sampling_params import GREEDY

BATCHES = (1, 2, 4, 8, 16, 32, 64)


def controller(hidden_states: bool, verify_seconds=lambda width, batch: 0.01) -> AutoController:
    verify = [StepCost(f"verify:{w}", b, verify_seconds(w, b)) for w in VERIFY_WIDTHS for b in BATCHES]
    draft = [StepCost(s, b, 0.002) for b in BATCHES for s in
             [*(chain_shape(k) for k in AUTO_CHAIN_KS), *(predraft_shape(k) for k in AUTO_CHAIN_KS),
              *(tree_shape(*t) for t in AUTO_TREES)]]
    return AutoController(verify, lambda: (draft, []), 64, hidden_states=hidden_states, replan_every=1)


def request(i: int) -> ActiveRequest:
    req = GenerationRequest(f"q{i}", [1, 2, 3], 8, [], False, SpecSettings(Mode.AUTO), GREEDY)
    return ActiveRequest(req=req, seq_id=f"s{i}", mode=Mode.AUTO, detok=None, sampling=GREEDY, drafter="d:1")


def step_seconds(reqs: list[ActiveRequest]) -> float:
    """As the profile says: a verify, plus a draft when any request drafts."""
    return 0.01 + 0.002 * any(r.mode != Mode.OFF for r in reqs)


def serve_steps(auto: AutoController, reqs: list[ActiveRequest], steps: int, accept_whole: bool = False,
                seconds=step_seconds) -> None:
    """Steps in which every draft is rejected (auto settles on off and its probes keep losing), or
    with accept_whole every draft passes whole; each step takes seconds(reqs)."""
    for _ in range(steps):
        auto.plan(reqs)
        for r in reqs:
            depth = r.settings.k if r.mode == Mode.CHAIN else r.settings.depth if r.mode == Mode.TREE else 0
            r.draft_family = draft_family(r.settings, r.mode)
            auto.observe_verdict(r, depth, depth if accept_whole else 0)
        auto.observe_step(seconds(reqs))


def settle_off(auto: AutoController) -> list[ActiveRequest]:
    running = [request(i) for i in range(4)]
    for r in running:
        auto.admit(r)
    assert not any(r.parked for r in running)       # not settled yet: every request keeps its states
    serve_steps(auto, running, 400)
    assert auto.settled_off() and all(r.mode == Mode.OFF for r in running)
    return running


def test_requests_admitted_after_auto_settles_off_are_parked_but_a_scout_per_probe():
    auto = controller(hidden_states=True)
    running = settle_off(auto)
    assert auto.take_parked() == running
    interval = auto.policies[True].probe_interval
    serve_steps(auto, running, interval)   # a probe interval since settling: the next one scouts
    scout = request(200)
    late = [request(i) for i in range(100, 108)]
    for r in [scout, *late]:
        auto.admit(r)
    assert scout.scout and scout.speculates
    assert all(r.parked and not r.speculates and r.mode == Mode.OFF and r.choice == "off" for r in late)
    batch = running + late + [scout]
    auto.plan(batch)                                  # the scout is probed at once: one step, one token
    assert scout.mode == Mode.CHAIN and all(r.mode == Mode.OFF for r in batch if r is not scout)
    assert not auto.take_parked()
    serve_steps(auto, batch, 2)          # the probe lost: the next plan parks the scout
    assert scout.parked and not scout.speculates and auto.take_parked() == [scout]
    assert auto.settled_off() and auto.policies[True].probe_interval == 2 * interval
    # The next scout comes once the doubled interval has passed.
    serve_steps(auto, batch, interval)
    early = request(300)
    auto.admit(early)
    serve_steps(auto, batch, interval)
    due = request(301)
    auto.admit(due)
    assert early.parked and due.scout


def test_requests_running_when_auto_settles_off_are_parked():
    auto = controller(hidden_states=True)
    running = [request(i) for i in range(6)]
    for r in running:
        auto.admit(r)
    serve_steps(auto, running, 30)
    assert not auto.settled_off() and not auto.take_parked()     # nothing parked before it settles
    serve_steps(auto, running, 400)
    assert auto.settled_off()
    assert auto.take_parked() == running and all(r.parked and not r.speculates for r in running)
    assert not auto.take_parked()                                # handed over once


def test_without_hidden_states_nothing_is_parked():
    auto = controller(hidden_states=False)
    running = [request(i) for i in range(4)]
    serve_steps(auto, running, 400)
    assert auto.settled_off()
    late = [request(i) for i in range(100, 116)]
    for r in late:
        auto.admit(r)
    assert not any(r.parked for r in late) and not auto.take_parked()


def test_a_drafter_that_pays_is_never_settled_off():
    auto = controller(hidden_states=True)
    reqs = [request(i) for i in range(4)]
    rng = np.random.default_rng(0)
    for _ in range(200):
        auto.plan(reqs)
        for r in reqs:
            if r.mode == Mode.CHAIN:
                accepted = 0
                while accepted < r.settings.k and rng.random() < 0.9:
                    accepted += 1
                r.draft_family = "chain"
                auto.observe_verdict(r, r.settings.k, accepted)
            else:
                auto.observe_verdict(r, 0, 0)
        auto.observe_step(step_seconds(reqs))
    assert not auto.settled_off()
    late = request(99)
    auto.admit(late)
    assert not late.parked


def test_plans_of_off_hold_the_hidden_states_on_the_verifier():
    """Before auto settles, a plan of off for the group keeps its requests' hidden states on the
    verifier (AutoController.holding), so those steps cost what mode off's do and price off
    truly, and so are the prompts of requests admitted meanwhile; a plan that drafts holds none. A
    scout is never held (its probe drafts at once), nor is anything without hidden states."""
    for hidden in (True, False):
        auto = controller(hidden_states=hidden)
        reqs = [request(i) for i in range(3)]
        reqs[2].scout = True   # kept ready for a probe: never held
        seen = set()
        for _ in range(120):
            auto.plan(reqs)
            if not auto.step_plans:   # settled on off: every request parked, no plan
                assert not auto.holding
                break
            (_, plan, _), = auto.step_plans
            kind = "off" if plan.choice.mode == Mode.OFF else "drafts"
            seen.add(kind)
            assert auto.holding == ({"s0", "s1"} if hidden and kind == "off" else set()), kind
            admits_held = auto.holds_admissions(len(reqs))   # a prompt admitted now: its rows held too
            assert not admits_held or (hidden and kind == "off")
            if admits_held:
                seen.add("admissions held")
            for r in reqs:
                r.draft_family = draft_family(r.settings, r.mode)
                auto.observe_verdict(r, r.settings.k if r.mode == Mode.CHAIN else 0, 0)
            auto.observe_step(step_seconds(reqs))
        assert seen == ({"off", "drafts", "admissions held"} if hidden else {"off", "drafts"})


def test_a_probe_keeps_the_other_requests_rows_held():
    """Before auto settles, a probe drafts one request of a batch that runs off: the others' rows stay
    on the verifier (a probe of one request at C = 64 sent every request's rows: 164 ms, H200, 8B),
    while a plan that drafts for every request holds none."""
    from types import SimpleNamespace

    from gateway.scheduler import Scheduler

    auto = controller(hidden_states=True)
    reqs = [request(i) for i in range(8)]
    for r in reqs:
        r.req = dataclasses.replace(r.req, max_new_tokens=10**6)
    sched = SimpleNamespace(auto=auto, release_budget=ReleaseBudget())
    probes = 0
    for _ in range(300):
        auto.plan(reqs)
        if not auto.step_plans:   # settled: every request parked
            break
        Scheduler._hold_or_release(sched, reqs)   # as the scheduler does after each plan
        (_, plan, _), = auto.step_plans
        if plan.probe and plan.choice.mode != Mode.OFF and all(r.rows_held for r in reqs
                                                               if r.seq_id not in plan.speculating):
            probes += 1
            held = {r.seq_id for r in reqs if r.seq_id not in plan.speculating}
            assert held and auto.holding == held, (plan.speculating, auto.holding)
        for r in reqs:
            r.draft_family = draft_family(r.settings, r.mode)
            auto.observe_verdict(r, r.settings.k if r.mode == Mode.CHAIN else 0, 0)
            r.tokens.append(7)
        auto.observe_step(step_seconds(reqs))
    assert probes, "no probe ran while the batch's rows were held"


def test_a_held_request_fetches_its_hidden_states_before_it_drafts():
    """The scheduler's side: a request whose hidden states the verifier holds and which auto now
    plans to draft runs off for one step (its verdict brings them), then drafts; the step is not
    measured as the plan's."""
    from types import SimpleNamespace

    from gateway.scheduler import Scheduler

    a, b = request(0), request(1)
    sched = SimpleNamespace(auto=SimpleNamespace(holding={"s0", "s1"}), release_budget=ReleaseBudget())
    assert not Scheduler._hold_or_release(sched, [a, b]) and a.rows_held and b.rows_held
    a.mode, b.mode = Mode.CHAIN, Mode.OFF   # auto's next plan: a drafts, b stays off but is not held
    sched.auto.holding = set()
    assert Scheduler._hold_or_release(sched, [a, b])
    assert a.mode == Mode.OFF and not a.rows_held and not b.rows_held
    a.mode = Mode.CHAIN
    assert not Scheduler._hold_or_release(sched, [a, b]) and a.mode == Mode.CHAIN


def test_held_rows_are_released_within_a_steps_budget_and_a_request_holding_too_many_is_parked():
    """A verdict that brings held hidden states must stay within the message limit: one step releases
    at most the budget's rows (the others stay held and run off a step longer), and a request holding
    more than one request may is parked instead (gateway/release_budget.py). No row size seen yet:
    nothing is limited."""
    from types import SimpleNamespace

    from gateway.scheduler import Scheduler
    from specdec.rpc import common_pb2

    def scheduler(budget):
        reqs = [request(i) for i in range(4)]
        for r, n in zip(reqs, (100, 100, 100, 300)):   # the rows each holds: all its tokens (none drafted)
            r.tokens, r.rows_held, r.mode = list(range(n)), True, Mode.CHAIN
        parked = []
        auto = SimpleNamespace(holding=set(), park=parked.extend, hidden_states=True)   # auto now drafts all
        return reqs, parked, SimpleNamespace(auto=auto, release_budget=budget, held_back=set(),
                                             active={r.seq_id: r for r in reqs})

    budget = ReleaseBudget(release_bytes=250 * 10, held_bytes=200 * 10)   # 250 rows a step, 200 a request
    reqs, parked, sched = scheduler(budget)
    assert Scheduler._hold_or_release(sched, reqs) and not parked   # row size unknown: all released
    assert not any(r.rows_held for r in reqs) and Scheduler._held_ids(sched) == []

    budget.saw(common_pb2.TensorPayload(dtype="uint8", shape=[3, 10], data=bytes(30)))   # 10 bytes a row
    reqs, parked, sched = scheduler(budget)
    assert Scheduler._hold_or_release(sched, reqs)
    # s0 and s1 released (200 rows), s2 would pass 250: held back, off this step; s3 holds 300 > 200:
    # parked, its rows held this step (the next one stops them)
    assert [r.rows_held for r in reqs] == [False, False, True, False] and reqs[2].mode == Mode.OFF
    assert parked == [reqs[3]] and Scheduler._held_ids(sched) == ["s2", "s3"]
    reqs[2].mode = Mode.CHAIN
    Scheduler._hold_or_release(sched, reqs[:3])   # the next step: s2's turn
    assert not reqs[2].rows_held and Scheduler._held_ids(sched) == []


def test_a_prompt_admitted_while_auto_runs_off_is_held_until_its_verdict():
    """The verify message holds the seq ids auto runs off and those of prompts admitted meanwhile
    (rows_held at admission) while they are still opening."""
    from types import SimpleNamespace

    from gateway.scheduler import Scheduler

    opening, open_unheld, running = request(0), request(1), request(2)
    opening.opening = open_unheld.opening = True
    opening.rows_held = True
    sched = SimpleNamespace(auto=SimpleNamespace(holding={"s2"}, hidden_states=True), held_back=set(),
                            active={r.seq_id: r for r in (opening, open_unheld, running)})
    assert Scheduler._held_ids(sched) == ["s0", "s2"]
    opening.opening = False   # its prefill's verdict came: from now on auto's plan decides
    assert Scheduler._held_ids(sched) == ["s2"]


def test_prompts_arriving_at_a_load_where_auto_chose_off_are_held_while_it_drafts_at_another():
    """Load comes in waves: auto runs off at batch 32 (verifying wide rows costs more than half-right
    drafts earn there) and drafts at batch 1. A prompt admitted into a batch of 32 while the last
    plan (at batch 1) drafts has its rows held all the same; one admitted into a batch of 1 does
    not; a batch size never planned for follows the last plans."""
    auto = controller(True, lambda width, batch: 0.01 + 0.0005 * width * batch)
    rng = np.random.default_rng(0)

    def serve(reqs: list[ActiveRequest], steps: int) -> str:
        for _ in range(steps):
            auto.plan(reqs)
            width = 1
            for r in reqs:
                depth = r.settings.k if r.mode == Mode.CHAIN else r.settings.depth if r.mode == Mode.TREE else 0
                r.draft_family = draft_family(r.settings, r.mode)
                accepted = next((i for i in range(depth) if rng.random() >= 0.5), depth)   # a = 0.5
                auto.observe_verdict(r, depth, accepted)
                width = max(width, r.settings.k + 1 if r.mode == Mode.CHAIN else
                            r.settings.budget + 1 if r.mode == Mode.TREE else 1)
            auto.observe_step(0.01 + 0.0005 * width * len(reqs) + 0.002 * (width > 1))
        (_, plan, _), = auto.step_plans
        return plan.choice.name

    assert serve([request(i) for i in range(32)], 40) == "off" and not auto.settled_off()
    assert serve([request(100)], 40) != "off" and not auto.settled_off()
    assert auto.holds_admissions(32) and auto.holds_admissions(20)   # (the same bucket)
    assert not auto.holds_admissions(1)
    assert not auto.holds_admissions(64) and not auto.holds_admissions(4)   # never planned: the last plan drafts


def test_a_probe_where_auto_runs_off_does_not_send_the_next_prompts_rows():
    """A probe (one request drafting one token to measure the drafter) is not auto's choice at that
    batch size: where the plans there run off, the prompts admitted next keep their rows on the
    verifier. A new drafter's probe of chain k=1 at C = 64 once had every later wave send its 63
    prompts' rows (stand-ins with 8B-wide rows: a 455 ms step against 58 ms)."""
    auto = controller(True, lambda width, batch: 0.01 + 0.0005 * width * batch)
    reqs = [request(i) for i in range(32)]
    auto.plan(reqs, prefilling=True)   # a wave's prefill: off (nothing measured yet)
    (_, plan, _), = auto.step_plans
    assert plan.choice.name == "off" and auto.holds_admissions(32)
    auto.plan(reqs)                    # a new drafter: its first plan probes it
    (_, plan, _), = auto.step_plans
    assert plan.probe and plan.choice.name == "chain k=1" and not auto.settled_off()
    assert auto.holds_admissions(32)


def test_off_for_requests_with_nothing_left_to_gain_does_not_hold_the_next_prompts():
    """Requests with one token left (a benchmark's 2-token warm-ups, after their prompt's token) run
    off whatever the load: nothing to draft. That plan must not hold the rows of the prompts
    admitted next at that batch size (on the H100 each wave after the warm-ups started off and then
    sent its rows: ~5% of the time at C = 16)."""
    auto = controller(True, lambda width, batch: 0.01 + 0.0005 * width * batch)
    speculating = [request(i) for i in range(16)]
    serve_steps(auto, speculating, 12, accept_whole=True)   # auto drafts at batch 16
    assert not auto.holds_admissions(16)
    ending = [request(100 + i) for i in range(16)]
    for r in ending:
        r.req = dataclasses.replace(r.req, max_new_tokens=2)
        r.tokens = [*r.req.prompt_ids, 7]   # the prompt's first token came with its prefill
    auto.plan(ending)
    (_, plan, _), = auto.step_plans
    assert plan.choice.name == "off"
    assert not auto.holds_admissions(16) and not auto.holds_admissions(64)


def test_a_probe_that_would_pay_for_a_whole_batch_reopens_admissions(monkeypatch):
    """Settled off at a batch of parked requests, the plan after a scout's probe prices the scout
    speculating alone beside them, which a high load never repays. When speculation would pay for a
    batch of requests that all draft (AutoPolicy.pays_for_a_batch), the scout is kept and for a
    probe interval the requests admitted are neither parked nor scouts (their rows held on the
    verifier while auto runs off), so the batch can turn into one that drafts; after it they are
    parked again. When it would not pay, the scout is parked as before."""
    for pays in (True, False):
        auto = controller(hidden_states=True)
        running = settle_off(auto)
        policy = auto.policies[True]
        monkeypatch.setattr(policy, "pays_for_a_batch", lambda batch: pays)
        serve_steps(auto, running, policy.probe_interval)
        scout = request(200)
        auto.admit(scout)
        batch = running + [scout]
        serve_steps(auto, batch, 2)          # its probe, then a plan that still chooses off
        assert scout.parked != pays and not scout.scout and auto.settled_off()
        joined = [request(i) for i in range(100, 104)]
        for r in joined:
            auto.admit(r)
        assert all(not r.parked and not r.scout for r in joined) == pays
        assert all(r.parked for r in joined) != pays
        assert auto.holds_admissions(len(batch) + 4) == pays   # reopened: their rows stay on the verifier
        if pays:   # a probe interval later admissions are parked again (auto still settled off)
            assert auto.open_steps == policy.probe_interval
            serve_steps(auto, batch + joined, auto.open_steps)
            late = request(300)
            auto.admit(late)
            assert late.parked or late.scout


def measured_policy(right: float):
    """An auto policy over 13 requests whose drafter is right `right` of the time, measured over 60
    steps; a draft step costs 40% of a verify whatever its batch."""
    draft = [StepCost(s, b, 0.004) for b in BATCHES for s in
             [*(chain_shape(k) for k in AUTO_CHAIN_KS), *(tree_shape(*t) for t in AUTO_TREES)]]
    verify = [StepCost(f"verify:{w}", b, 0.01) for w in VERIFY_WIDTHS for b in BATCHES]
    auto = AutoController(verify, lambda: (draft, []), 64, hidden_states=True, replan_every=1)
    reqs = [request(i) for i in range(13)]
    rng = np.random.default_rng(1)
    for _ in range(60):
        auto.plan(reqs)
        for r in reqs:
            depth = r.settings.k if r.mode == Mode.CHAIN else r.settings.depth if r.mode == Mode.TREE else 0
            r.draft_family = draft_family(r.settings, r.mode)
            auto.observe_verdict(r, depth, next((i for i in range(depth) if rng.random() >= right), depth))
        auto.observe_step(0.01 + 0.004 * any(r.mode != Mode.OFF for r in reqs))
    return auto.policies[True]


def test_speculation_pays_for_a_batch_that_drafts_where_a_lone_request_would_not():
    """The counterfactual behind reopening: one request drafting beside 12 that cannot loses to
    off; 13 that all draft at the drafter's acceptance (0.9) win; at 0.1 they do not."""
    policy = measured_policy(0.9)
    assert policy.pays_for_a_batch(13)
    alone = policy.plan(["s0"], 12, 1, 12.0)
    assert alone.choice.mode == Mode.OFF
    assert not measured_policy(0.1).pays_for_a_batch(13)


def test_a_batch_size_where_off_settled_stays_settled_across_the_waves_ramps():
    """Probing is counted per batch bucket: a wave's ramp, whose small batches speculate, does not
    restart it where off wins. Settled off at batch 64, the next wave's requests run at batch 8
    (speculating, not parked), and once the batch is back at 64 they and the prompts admitted there
    are parked at once: no hidden states held for a switch that does not pay. (With one count each
    ramp reset it: on the H100 at a = 0.8, C = 64 auto ran off at batch 64 holding every request's
    rows, +1.2 ms a step, at 0.92x of off.)"""
    def verify_seconds(width: int, batch: int) -> float:   # grows faster than its tokens
        return 0.01 + 0.00002 * (width * batch) ** 1.5

    def seconds(reqs: list[ActiveRequest]) -> float:       # what the profile says the step takes
        width = max(step_width(r.settings, r.mode) for r in reqs)
        return verify_seconds(width, len(reqs)) + 0.002 * (width > 1)

    def serve(reqs: list[ActiveRequest], steps: int) -> None:
        serve_steps(auto, reqs, steps, accept_whole=True, seconds=seconds)

    auto = controller(True, verify_seconds)
    ramp = [request(i) for i in range(8)]
    for r in ramp:
        auto.admit(r, 8)
    serve(ramp, 20)
    assert any(r.mode != Mode.OFF for r in ramp) and not auto.settled_off(8)
    top = [request(100 + i) for i in range(64)]
    for r in top:
        auto.admit(r, 64)
    serve(top, 200)    # off at 64, its probes lose: settled there
    assert auto.settled_off(64) and all(r.mode == Mode.OFF for r in top)
    auto.take_parked()

    ramp = [request(200 + i) for i in range(8)]       # the next wave
    for r in ramp:
        auto.admit(r, 8)
    assert not any(r.parked for r in ramp)
    serve(ramp, 20)
    assert any(r.mode != Mode.OFF for r in ramp) and not auto.settled_off(8) and auto.settled_off(64)
    joined = [request(300 + i) for i in range(56)]
    for r in joined:
        auto.admit(r, 64)
    assert sum(not r.parked for r in joined) <= 1 and not auto.holds_admissions(64)   # (one may scout)
    auto.plan(ramp + joined)
    parked = auto.take_parked()
    assert set(map(id, ramp)) <= set(map(id, parked)) and all(r.mode == Mode.OFF for r in ramp + joined)
