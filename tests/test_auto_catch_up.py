"""`--mode auto` does not read a drafter's catch-up as a choice's step time. A request that drafts after
steps without (the first step after its prompt, a probe after a spell off) has the drafter take in
every token committed meanwhile: on a CPU a chain k=1 step went from 51 ms to 63-91 ms then. Measured
whole, those one-off steps priced chain k=1 above off, so auto stayed off where chain k=1 paid 1.3x.
Such a step's drafts count as the steps without a catch-up take them (their round trip over the
profile's draft time); the rest of the step is measured as ever.
Each measured step's debug line says what the plan expected and what the step took and committed
(scripts/auto_log_summary.py sums them per choice)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
from test_auto_prefill import controller, request

from gateway.auto.controller import WARMUP_STEPS, draft_family
from gateway.auto.costs import StepCalibration
from gateway.request import Mode

VERIFY, DRAFT = 0.01, 0.0005            # the test profile's verify and draft seconds (test_auto_prefill)
CATCH_UP = 0.001                        # seconds a drafter takes per token it catches up on


def run_step(auto, r, hop: float = 0.0) -> tuple[str, int]:
    """One step as the scheduler runs it: plan; if r drafts, the drafter is sent every token committed
    since it last drafted (its round trip grows with them, and takes `hop` more than the profile's
    draft), every draft is accepted; the tokens committed; the step's time. -> (the choice that ran,
    the tokens the drafter took in)."""
    auto.plan([r], prefilling=False)
    choice, committed, backlog, draft_seconds = r.choice, 1, 0, 0.0
    if r.mode != Mode.OFF:
        backlog = len(r.tokens) - r.drafter_len
        r.drafter_len = len(r.tokens)
        draft_seconds = hop + DRAFT + CATCH_UP * max(0, backlog - (r.settings.k + 1))
        auto.observe_verdict(r, r.settings.k, r.settings.k)
        committed += r.settings.k
    r.tokens += [7] * committed
    auto.observe_step(VERIFY + draft_seconds, draft_seconds)
    return choice, backlog


def last_measured(log) -> tuple[float, bool]:
    """The last measured step's (measured / modelled time, whether it caught up), from its debug line."""
    e = [e for e in log.events if e["event"] == "auto step"][-1]
    return e["measured_ms"] / e["model_ms"], e["caught_up"]


def test_a_drafters_catch_up_is_not_read_as_the_choices_step_time():
    auto = controller()
    auto.log = log = _Recorder()
    first = request(1)
    for _ in range(WARMUP_STEPS):
        run_step(auto, first)
    auto.forget(first)
    r = request(0)
    r.tokens = list(range(100))                       # a prompt the drafter has not seen
    r.req = dataclasses.replace(r.req, max_new_tokens=10**6)
    caught_up = steady = 0
    for _ in range(40):
        choice, backlog = run_step(auto, r)
        if choice == "off":
            continue
        ratio, flagged = last_measured(log)
        assert flagged == (backlog > r.settings.k + 1), (choice, backlog)
        caught_up += flagged   # more than one step committed: the prompt's first draft, at least
        steady += not flagged
        # Every step measured as the profile has it: the verify and a draft of its shape.
        assert ratio == pytest.approx(1.0, abs=0.01), (choice, backlog)
        if flagged:   # and a catch-up only bounds the choice's figure (test below)
            assert auto.policies[True].calibration.bounds[(choice, 1)] == pytest.approx(1.0, abs=0.01)
    assert caught_up and steady, (caught_up, steady)


def test_a_catch_up_steps_drafts_are_priced_at_what_the_drafts_round_trips_take():
    """The drafts' round trip holds more than the profile's draft time (hops, serialization, the
    tokens appended a step): here twice the profile. A catch-up step is measured with its drafts
    priced as the steps without a catch-up measured them, not at the bare profile, which would price
    the choice below what its steps take (stand-ins with the H100's costs at C = 64: 24 ms where chain
    k=2's steps took 31-33)."""
    auto = controller()
    auto.log = log = _Recorder()
    r = request(0)
    r.req = dataclasses.replace(r.req, max_new_tokens=10**6)
    caught_up = []
    for step in range(WARMUP_STEPS + 60):
        if step % 10 == 9:   # a spell the drafter misses: the next drafting step catches up
            r.tokens += [7] * 30
        choice, backlog = run_step(auto, r, hop=DRAFT)
        if choice != "off" and step >= WARMUP_STEPS and backlog > r.settings.k + 1:
            caught_up.append(last_measured(log)[0])
    steady = (VERIFY + 2 * DRAFT) / (VERIFY + DRAFT)   # what a step without a catch-up measures over the model
    assert len(caught_up) >= 3, caught_up
    assert caught_up[1:] == pytest.approx([steady] * (len(caught_up) - 1), abs=0.01), caught_up


def test_a_catch_up_step_bounds_its_choices_time_without_setting_it():
    """The first step of a choice after a spell off also does one-off work the drafts' price cannot
    take out (the rows the verifier held travel; on the H100 at C = 64 such a step of chain k=2 took
    28 ms where its clean steps took ~20). It caps the choice's estimate at its bucket, is not a
    measurement (the choice's own, or one its kin borrow), and a clean step replaces it."""
    cal = StepCalibration()
    k2, k4 = ("chain", "chain k=2", 3), ("chain", "chain k=4", 5)
    for _ in range(3):
        cal.observe(*k2, 32, 0.013, 0.010)                 # clean at C = 32: 1.3x the model
    cal.observe(*k2, 64, 0.025, 0.010, bound=True)         # the slow first step at C = 64
    assert cal.measured("chain k=2", 64) == 0
    assert cal.ratio(*k2, 64) == pytest.approx(1.3)        # borrowed from C = 32, below the bound
    assert cal.ratio(*k4, 64) == pytest.approx(1.3)        # kin borrow measurements only
    cal.observe(*k2, 64, 0.012, 0.010, bound=True)
    assert cal.ratio(*k2, 64) == pytest.approx(1.2)        # a lower bound caps the borrowed figure
    cal.observe(*k2, 64, 0.014, 0.010)                     # a clean step: the choice's own figure
    assert cal.ratio(*k2, 64) == pytest.approx(1.4) and cal.measured("chain k=2", 64) == 1


class _Recorder:
    """A logger that keeps its debug events."""

    def __init__(self) -> None:
        self.events: list[dict] = []

    def debug(self, event: str, **kw) -> None:
        self.events.append({"event": event, **kw})

    def info(self, event: str, **kw) -> None:
        pass


def test_each_measured_step_logs_what_it_expected_and_what_it_committed():
    """The debug line per measured step carries the plan's expected tokens and the tokens the step
    committed, so a run's log shows where auto's estimates go wrong."""
    auto = controller()
    auto.log = log = _Recorder()
    r = request(0)
    r.req = dataclasses.replace(r.req, max_new_tokens=10**6)
    logged = 0
    for _ in range(WARMUP_STEPS + 20):
        before = len(r.tokens)
        run_step(auto, r)
        steps = [e for e in log.events if e["event"] == "auto step"]
        if len(steps) > logged:   # a measured step: its line carries what it committed
            logged = len(steps)
            assert steps[-1]["tokens"] == len(r.tokens) - before, steps[-1]
            assert {"choice", "expected_tokens", "expected_ms", "measured_ms", "rival", "rival_tokens_per_second",
                    "token_ratio"} <= steps[-1].keys()
    assert logged >= 10


def test_the_log_summary_reads_those_lines():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from auto_log_summary import summarize

    lines = ["... [debug ] auto step batch=1 caught_up=False choice='chain k=1' expected_ms=58.0 expected_tokens=1.5 "
             "measured_ms=60.0 model_ms=50 overhead_ms=0.0 probe=False service=gateway speculating=1 tokens=2",
             "... [debug ] auto step batch=1 caught_up=False choice='chain k=1' expected_ms=58.0 expected_tokens=1.5 "
             "measured_ms=56.0 model_ms=50 overhead_ms=0.0 probe=False service=gateway speculating=1 tokens=2",
             "... [debug ] auto step batch=1 caught_up=True choice='chain k=1' expected_ms=0.0 expected_tokens=0.0 "
             "measured_ms=90.0 model_ms=50 overhead_ms=0.0 probe=True service=gateway speculating=1 tokens=2",
             "... [info ] auto mode choice choice=off"]
    c = summarize(lines)["chain k=1"]
    assert (c.steps, c.probes, c.measured_ms, c.expected_tokens, c.tokens) == (3, 1, 116.0, 3.0, 4.0)


def test_the_log_summary_sets_choices_per_batch_bucket_beside_their_rivals():
    """Per power-of-two batch bucket and choice: tokens a second expected (overhead included) and
    committed on its clean steps, the delivered ratio its plans were scaled by, and the rival it was weighed against most often, with its price:
    a sibling that never ran at a batch size shows there only as a rival."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from auto_log_summary import by_bucket

    def line(batch, choice, rival, rival_tps, probe=False, realized=1.0):
        return (f"... [debug ] auto step batch={batch} choice='{choice}' expected_ms=18.0 expected_tokens=60.0 "
                f"measured_ms=20.0 overhead_ms=2.0 probe={probe} rival='{rival}' rival_tokens_per_second={rival_tps} "
                f"realized={realized} tokens=62")

    lines = [line(14, "chain k=8", "chain k=4", 2500.0, realized=0.9), line(16, "chain k=8", "chain k=4", 2700.0),
             line(12, "chain k=8", "chain k=6", 2900.0), line(15, "chain k=8", "chain k=4", 9.0, probe=True),
             line(20, "chain k=4", "chain k=8", 4000.0)]
    buckets = by_bucket(lines)
    assert sorted(buckets) == [16, 32]
    k8 = buckets[16]["chain k=8"]
    assert k8.steps == 3   # the probe left out
    assert k8.expected_tps / k8.steps == pytest.approx(3000.0) and k8.measured_tps / k8.steps == pytest.approx(3100.0)
    assert k8.rivals == {"chain k=4": [2, 5200.0], "chain k=6": [1, 2900.0]}
    assert k8.realized / k8.steps == pytest.approx(2.9 / 3)
    assert list(buckets[32]) == ["chain k=4"]


def test_steps_that_admit_prompts_log_their_excess_and_the_charge_per_prompt():
    """A step that admits prompts is priced at its clean time plus a charge per prompt (StepOverheads);
    its debug line says what it took over the clean price and the charge, and the log summary
    sums them per kind, so a run shows where that charge goes wrong."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from auto_log_summary import admissions

    auto = controller()
    auto.log = log = _Recorder()
    r = request(0)
    r.req = dataclasses.replace(r.req, max_new_tokens=10**6)
    for step in range(WARMUP_STEPS + 12):
        auto.plan([r], prefilling=step % 3 == 0)
        r.tokens += [7]
        auto.observe_step(VERIFY + 0.004, 0.0, prefilling=step % 3 == 0, admitted=2 if step % 3 == 0 else 0)
    lines = [e for e in log.events if e["event"] == "auto admitting step"]
    assert len(lines) >= 3 and all(e["admitted"] == 2 for e in lines), lines
    assert {"choice", "batch", "expected_ms", "measured_ms", "overhead_ms", "per_admission_ms"} <= lines[-1].keys()
    text = ["... [debug ] auto admitting step " + " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}"
                                                            for k, v in e.items() if k != "event") for e in lines]
    kinds = admissions(text + ["... [debug ] auto step choice=off expected_ms=1 measured_ms=2 expected_tokens=1"])
    assert sum(a.steps for a in kinds.values()) == len(lines)
    assert sum(a.admitted for a in kinds.values()) == 2 * len(lines)
    for kind, a in kinds.items():
        mine = [e for e in lines if (e["choice"] == "off") == (kind == "off")]
        assert a.excess_ms == pytest.approx(sum(e["measured_ms"] - e["expected_ms"] for e in mine))


@pytest.mark.parametrize("accept_all", [True, False])
def test_the_verdicts_of_planned_drafts_calibrate_what_the_policy_expects(accept_all):
    """Each verdict of a request that a plan made speculate is set against what the plan expected of
    it (TokenCalibration): drafts accepted more often than expected raise the figure, less lower it."""
    auto = controller()
    r = request(0)
    r.req = dataclasses.replace(r.req, max_new_tokens=10**6)
    for _ in range(WARMUP_STEPS + 30):
        auto.plan([r], prefilling=False)
        accepted = r.settings.k if accept_all else 0
        if r.mode != Mode.OFF:
            r.draft_family = draft_family(r.settings, r.mode)   # as the scheduler sets it with the draft
            r.drafter_len = len(r.tokens)
            auto.observe_verdict(r, r.settings.k, accepted)
        r.tokens += [7] * (1 + (accepted if r.mode != Mode.OFF else 0))
        auto.observe_step(VERIFY + DRAFT, DRAFT)
    policy = auto.policies[True]
    assert policy.tokens.expected > 0
    assert (policy.tokens.ratio > 1.0) if accept_all else (policy.tokens.ratio < 1.0)
