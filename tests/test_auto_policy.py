"""`--mode auto`'s policy on synthetic costs and acceptance: it turns speculation off when drafts are
never accepted (probing now and then, less and less often), speculates when it pays, turns off
again where a large batch makes verification compute-bound, leaves out the requests whose drafts
fail, and, when the real step times differ from the start-up profile, follows the measurements to
the choice that is really best."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.auto_replay import PROFILE_BATCHES, synthetic_profile
from gateway.auto.acceptance import AcceptanceBook, expected_tokens
from gateway.auto.costs import CostModel, StepCalibration
from gateway.auto.policy import OFF, AutoPolicy, menu
from gateway.request import Mode
from specdec.cost_profile import AUTO_TREES, StepCost

profile = synthetic_profile   # verify(batch, width), draft(rows, k_or_depth) in seconds -> a CostModel


def memory_bound(b: int, w: int) -> float:      # a GPU verify: flat until ~256 tokens
    return 0.010 * max(1.0, b * w / 256)


def cheap_draft(b: int, n: int) -> float:
    return 0.0005 * n * max(1.0, b / 32)


def policy(costs: CostModel, overlap: bool = False) -> AutoPolicy:
    return AutoPolicy(costs, AcceptanceBook(), menu(costs, 64, overlap))


def observe(p: AutoPolicy, seq_id: str, family: str, a: float, n: int, rng, positions: int = 8) -> None:
    for _ in range(n):
        accepted = 0
        while accepted < positions and rng.random() < a:
            accepted += 1
        p.book.observe(seq_id, family, positions, accepted)


def chain_winning_policy(n: int = 32) -> tuple[AutoPolicy, list[str]]:
    """A memory-bound verifier with cheap drafts, and n requests that each accepted 80% of 20 chains."""
    p = policy(profile(memory_bound, cheap_draft))
    rng = np.random.default_rng(0)
    ids = [f"r{i}" for i in range(n)]
    for sid in ids:
        observe(p, sid, "chain", 0.8, 20, rng)
    return p, ids


def test_no_acceptance_turns_speculation_off_and_probes_ever_less_often():
    p = policy(profile(memory_bound, cheap_draft))
    rng = np.random.default_rng(0)
    probes = []
    for step in range(3000):
        plan = p.plan(["r0"], 0, 1, 0.0)
        if plan.choice != OFF:
            probes.append(step)
            observe(p, "r0", plan.choice.family, 0.0, 1, rng, plan.choice.positions)
    assert p.plan(["r0"], 0, 1, 0.0).choice == OFF
    # The first measurements: five probes, then a few more tries while the estimate is unsure.
    assert probes[:5] == [0, 1, 2, 3, 4] and len([s for s in probes if s < 100]) <= 20
    late = [s for s in probes if s >= 100]
    assert len(late) <= 6, probes                                  # doubling intervals: a handful in 3000 steps
    assert all(b - a >= 2 * (d - c) for (a, b), (c, d) in zip(zip(late[1:], late[2:]), zip(late, late[1:])))


def test_a_probe_of_a_batch_of_one_runs_the_likeliest_winner():
    """While off, a probe in a batch of one is the whole step whatever it drafts, so it runs the
    speculative choice rated best and corrects that family's estimate, not chain k=1 (which
    measures only the chains' first position: a replay over recorded SmolLM2 verdicts sank into
    off for good after a tree's unlucky start, 0.85 of the tree). In a larger batch a probe stays
    one request drafting one token. Here a draft step costs twice a verify, so off wins at a = 0.5,
    and a deep draft (tree 8/7/64) is the best of the rest."""
    def dear_draft(b, n):
        return 0.02 + 0.0001 * n

    for batch, expected in ((1, None), (4, "chain k=1")):
        p = policy(profile(memory_bound, dear_draft))
        rng = np.random.default_rng(0)
        ids = [f"r{i}" for i in range(batch)]
        for sid in ids:
            observe(p, sid, "chain", 0.5, 20, rng)
        probes = []
        for step in range(600):
            plan = p.plan(ids, 0, 1, 0.0)
            if plan.probe and step >= 100:   # (after the first measurements of every family)
                probes.append(plan.choice.name)
            for sid in plan.speculating:
                observe(p, sid, plan.choice.family, 0.5, 1, rng, plan.choice.positions)
        assert p.current == OFF and len(probes) >= 2, probes
        best_speculative = max((x for x in p._scored(p.choices, ids, 0, 1, 0.0, None) if x.choice != OFF),
                               key=lambda x: x.tokens_per_second).choice.name
        assert best_speculative != "chain k=1" and probes[-1] == (expected or best_speculative), probes


def test_high_acceptance_speculates_and_large_compute_bound_batches_do_not():
    def compute_bound(b, w):    # verification cost grows with every token from the start
        return 0.002 + 0.0002 * b * w

    p = policy(profile(compute_bound, cheap_draft))
    rng = np.random.default_rng(0)
    ids = [f"r{i}" for i in range(64)]
    for sid in ids:
        observe(p, sid, "chain", 0.8, 20, rng)
    small = p.plan(ids[:1], 0, 1, 0.0)
    assert small.choice.mode != Mode.OFF and small.speculating == ["r0"]
    off_rate = 1 / compute_bound(1, 1)
    assert small.tokens_per_second > 1.3 * off_rate
    assert p.plan(ids, 0, 1, 0.0).choice == OFF


def test_the_rival_logged_is_the_best_speculative_plan_besides_the_choice():
    """What a choice beat: the best other speculative plan (logged with each measured step); with off
    chosen, the best speculative plan."""
    p = policy(profile(memory_bound, cheap_draft))
    rng = np.random.default_rng(0)
    for family in ("chain", *(c.family for c in p.choices if c.mode == Mode.TREE)):
        observe(p, "r0", family, 0.8, 30, rng)
    chosen = p.plan(["r0"], 0, 1, 0.0)
    assert chosen.choice != OFF and p.last_rival is not None and p.last_rival.choice not in (OFF, chosen.choice)
    others = [c for c in p.choices if c not in (OFF, chosen.choice)]
    best_other = max(p._scored(others, ["r0"], 0, 1, 0.0, None), key=lambda q: q.tokens_per_second)
    assert p.last_rival.choice == best_other.choice
    q = policy(profile(memory_bound, cheap_draft))
    for family in ("chain", *(c.family for c in q.choices if c.mode == Mode.TREE)):
        observe(q, "r0", family, 0.0, 30, rng)
    assert q.plan(["r0"], 0, 1, 0.0).choice == OFF
    assert q.last_rival is not None and q.last_rival.choice != OFF


def test_requests_whose_drafts_fail_are_left_out():
    def per_sequence_draft(b, n):   # a drafter whose cost grows with every sequence it drafts for
        return 0.0005 * n * b

    p = policy(profile(memory_bound, per_sequence_draft))
    rng = np.random.default_rng(0)
    good, bad = [f"g{i}" for i in range(4)], [f"b{i}" for i in range(4)]
    for sid in good:
        observe(p, sid, "chain", 0.9, 30, rng)
    for sid in bad:
        observe(p, sid, "chain", 0.0, 30, rng)
    plan = p.plan(good + bad, 0, 1, 0.0)
    assert plan.choice.mode == Mode.CHAIN
    assert sorted(plan.speculating) == good


def test_step_calibration_is_robust_and_borrows_the_nearest_measured_neighbour():
    cal = StepCalibration()
    assert cal.ratio("chain", "chain k=4", 5, 16) == 1.0                  # nothing measured: the bare model
    cal.observe("chain", "chain k=4", 5, 16, 0.050, 0.010)                # a first slow step (a connection set up)
    cal.observe("chain", "chain k=4", 5, 16, 0.020, 0.010)
    assert cal.ratio("chain", "chain k=4", 5, 16) == pytest.approx(2.0)   # fewer than three: the least
    for measured in (0.021, 0.019, 0.022):
        cal.observe("chain", "chain k=4", 5, 16, measured, 0.010)
    # then the median of the last five, the first (a stall: over 1.5x the least) left out
    assert cal.ratio("chain", "chain k=4", 5, 16) == pytest.approx(2.05)
    assert cal.ratio("chain", "chain k=4", 5, 32) == pytest.approx(2.05)  # a new bucket borrows the nearest
    cal.observe("chain", "chain k=8", 9, 16, 0.030, 0.010)
    assert cal.ratio("chain", "chain k=8", 9, 16) == pytest.approx(3.0)   # each choice its own
    assert cal.ratio("chain", "chain k=6", 7, 16) == pytest.approx(2.05)  # unmeasured: the closest width (5 < 9)
    assert cal.ratio("tree", "tree 4/4/16", 17, 16) == 1.0                # another kind is not assumed alike
    cal.observe("tree", "tree 4/4/16", 17, 16, 0.015, 0.010)
    for _ in range(3):                                                    # at 32, chain k=4 costs twice its 16 figure
        cal.observe("chain", "chain k=4", 5, 32, 0.041, 0.010)
    assert cal.ratio("chain", "chain k=8", 9, 32) == pytest.approx(4.1)   # a neighbour of its kind at this size first
    assert cal.ratio("tree", "tree 4/4/16", 17, 32) == pytest.approx(3.0)  # else its figure elsewhere, times the trend
    cal.observe("off", "off", 1, 16, 0.012, 0.010)
    # But not off: the trend is what the drafts measured, and off's steps only verify.
    assert cal.ratio("off", "off", 1, 32) == pytest.approx(1.2)


def test_stalled_steps_do_not_move_a_choices_figure_but_a_lasting_change_does():
    """A stall only slows a step: ratios over 1.5x the window's least are left out (off at C = 64 on
    the H100: three stalled steps of the last five priced it at 29 ms a step where it ran 12)."""
    cal = StepCalibration()
    for measured in (0.0116, 0.0117, 0.0138, 0.0290, 0.0348):
        cal.observe("off", "off", 1, 64, measured, 0.010)
    assert cal.ratio("off", "off", 1, 64) == pytest.approx(1.17)
    for measured in (0.0290, 0.0300, 0.0310, 0.0290, 0.0300):    # every step slower now: followed
        cal.observe("off", "off", 1, 64, measured, 0.010)
    assert cal.ratio("off", "off", 1, 64) == pytest.approx(3.0)


def simulate(p: AutoPolicy, verify, draft, a: float, batch: int, steps: int, counted: int | None = None,
             seed: int = 1) -> float:
    """Serve `steps` steps with the true costs and acceptance `a` per position; the policy sees
    only measurements (each whole step's time, each verdict). -> tokens per second over the last
    `counted` steps (default: the second half)."""
    rng = np.random.default_rng(seed)
    ids = [f"r{i}" for i in range(batch)]
    tokens = seconds = 0.0
    for step in range(steps):
        plan = p.plan(ids, 0, 1, 0.0)
        c, n = plan.choice, len(plan.speculating)
        width = c.width if n else 1
        tv = verify(batch, width)
        td = draft(n * (c.topk or 1), c.positions) if n else 0.0
        p.observe_step(plan, tv + td)
        committed = batch - n
        for sid in plan.speculating:
            accepted = 0
            while accepted < c.positions and rng.random() < a:
                accepted += 1
            p.book.observe(sid, c.family, c.positions, accepted)
            committed += accepted + 1
        if step >= steps - (steps // 2 if counted is None else counted):
            tokens, seconds = tokens + committed, seconds + tv + td
    return tokens / seconds


def best_fixed(verify, draft, a: float, batch: int, choices) -> float:
    rates = np.full(16, a)
    out = []
    for c in choices:
        if c == OFF:
            out.append(batch / verify(batch, 1))
        else:
            e = float(expected_tokens(rates, c.positions))
            out.append(batch * e / (verify(batch, c.width) + draft(batch * (c.topk or 1), c.positions)))
    return max(out)


@pytest.mark.parametrize("a, batch", [(0.8, 1), (0.8, 16), (0.0, 4), (0.6, 64)])
def test_measurements_lead_to_the_really_best_choice(a, batch):
    """The profile says drafting is nearly free; really it costs 6x that. Auto must end within a
    few percent of the best fixed choice under the true costs."""
    def true_draft(b, n):
        return 6 * cheap_draft(b, n)

    p = policy(profile(memory_bound, cheap_draft))
    got = simulate(p, memory_bound, true_draft, a, batch, 1200)
    assert got >= 0.95 * best_fixed(memory_bound, true_draft, a, batch, p.choices)


@pytest.mark.parametrize("a, batch", [(0.8, 1), (0.8, 32), (0.8, 64), (0.0, 4)])
def test_contention_the_profile_cannot_see_is_calibrated_away(a, batch):
    """Speculative steps really cost 2.5x what the profile adds up to (a drafter contending with
    the verifier on one GPU), plain steps what it says: auto ends within a few percent of the best
    fixed choice (on average over three runs). At batch 64 off is really best, and the profile
    alone would pick chain k=8 at 0.77 of it."""
    def true_verify(b, w):
        return memory_bound(b, w) * (1.0 if w == 1 else 2.5)

    def true_draft(b, n):
        return 2.5 * cheap_draft(b, n)

    # The mean of three runs: one run's verdicts can favour a tree a few percent worse for a while
    # (0.92-1.03 of the best fixed choice over six seeds at a = 0.8, batch 1).
    rates = []
    for seed in (1, 2, 3):
        p = policy(profile(memory_bound, cheap_draft))
        rates.append(simulate(p, true_verify, true_draft, a, batch, 1200, seed=seed))
    assert float(np.mean(rates)) >= 0.95 * best_fixed(true_verify, true_draft, a, batch, p.choices)


def test_an_overlap_pre_draft_on_the_verifiers_own_processor_is_priced_after_the_verify():
    """A drafter on another GPU pre-drafts while the verifier verifies: the step takes the longer of
    the two. On the verifier's own GPU (or CPU) both wait for one processor: the sum. Priced as
    the longer one there, overlap looks free and wins where it really loses (the H200 sweep)."""
    def slow_draft(b, n):   # a pre-draft as long as the verify
        return 0.010 * n / 9
    rng = np.random.default_rng(0)
    chosen = {}
    for shared in (False, True):
        p = AutoPolicy(profile(memory_bound, slow_draft, shared), AcceptanceBook(),
                       [OFF] + [c for c in menu(profile(memory_bound, slow_draft), 64, True) if c.k == 4])
        observe(p, "r0", "chain", 0.9, 200, rng)
        both = {c.overlap: c for c in p.choices if c != OFF}
        seconds = {o: p._seconds(c, 1, 1, c.width, np.array([0.9 ** 4])) for o, c in both.items()}
        verify, predraft = memory_bound(1, 5), slow_draft(1, 9)
        sync = (1 - 0.9 ** 4) * slow_draft(1, 4)
        assert seconds[True] == pytest.approx((verify + predraft if shared else max(verify, predraft)) + sync)
        assert seconds[False] == pytest.approx(verify + slow_draft(1, 4))
        chosen[shared] = p.plan(["r0"], 0, 1, 0.0).choice
    assert chosen[False].overlap and not chosen[True].overlap


def test_a_larger_batch_where_speculation_costs_more_than_it_did_at_small_ones():
    """Drafts slow down as the batch grows, more than the profile says (contention with the
    verifier on one GPU: 3x the profile at 4 sequences, 17x at 32), so what was measured at 4
    sequences does not hold at 32, where plain decoding wins. Moving from 4 to 32, auto must not
    walk through every speculative choice on estimates borrowed from the small batch (each tried
    and found slow only after steps of its own, as in the H200 sweep): from its first step at 32
    it stays within a few percent of the best fixed choice there."""
    def true_draft(b, n):
        return cheap_draft(b, n) * (1.0 + b / 2)

    p = policy(profile(memory_bound, cheap_draft))
    best_4, best_32 = (best_fixed(memory_bound, true_draft, 0.6, b, p.choices) for b in (4, 32))
    assert best_4 > 1.3 * 4 / memory_bound(4, 1) and best_32 == 32 / memory_bound(32, 1)   # drafts pay at 4, not at 32
    assert simulate(p, memory_bound, true_draft, 0.6, 4, 300) >= 0.95 * best_4
    assert simulate(p, memory_bound, true_draft, 0.6, 32, 60, counted=60) >= 0.95 * best_32


def test_a_request_at_its_last_token_is_not_worth_a_draft():
    """A draft gains at most the tokens its request has left: requests about to end do not speculate,
    the others still do."""
    def per_sequence_draft(b, n):   # each sequence drafted costs its share
        return 0.0005 * n * b

    p = policy(profile(memory_bound, per_sequence_draft))
    rng = np.random.default_rng(0)
    for sid in ("r0", "r1"):
        observe(p, sid, "chain", 0.9, 50, rng)
    assert p.plan(["r0", "r1"], 0, 1, 0.0, remaining=np.array([1.0, 1.0])).choice == OFF
    plan = p.plan(["r0", "r1"], 0, 1, 0.0, remaining=np.array([64.0, 1.0]))
    assert plan.choice != OFF and plan.speculating == ["r0"]


def test_a_lucky_fast_step_does_not_make_drafts_at_zero_acceptance_look_free():
    """On a loaded machine one speculative step can be measured faster than plain ones. A
    speculative step still does all a plain one does and drafts besides, so at zero acceptance off
    stays the choice however cheap a speculative choice's few measurements make it look."""
    p = policy(profile(memory_bound, cheap_draft))
    rng = np.random.default_rng(0)
    for sid in ("r0", "r1"):
        observe(p, sid, "chain", 0.0, 50, rng)
    off = p.plan(["r0", "r1"], 0, 1, 0.0)
    for _ in range(5):
        p.calibration.observe("off", "off", 1, 2, 0.030, 0.010)           # plain steps: 3x the model
    for c in p.choices:
        if c != OFF:
            p.calibration.observe(c.kind, c.name, c.width, 2, 0.001, 0.010)   # one lucky step each
    assert off.choice == OFF and p.plan(["r0", "r1"], 0, 1, 0.0).choice == OFF


def test_speculation_must_beat_off_by_the_margin():
    """Near break-even (verification compute-bound, high acceptance) a speculative choice scored
    less than `speculation_margin` above off is not taken; one scored above it is, as without the
    margin. The acceptance grid covers both sides of the bar."""
    def compute_bound(b, w):
        return 0.002 + 0.0004 * b * w

    costs = profile(compute_bound, cheap_draft)
    ids = [f"r{i}" for i in range(8)]
    seen = set()
    for a in np.linspace(0.7, 0.95, 11):
        book = AcceptanceBook()
        free = AutoPolicy(costs, book, menu(costs, 64, False), speculation_margin=0.0)
        kept = AutoPolicy(costs, book, menu(costs, 64, False))   # the default margin, 5%
        rng = np.random.default_rng(0)
        for sid in ids:
            observe(free, sid, "chain", a, 200, rng)
            observe(free, sid, "tree", a, 200, rng)
        want, got = free.plan(ids, 0, 1, 0.0), kept.plan(ids, 0, 1, 0.0)
        gain = want.tokens_per_second * compute_bound(len(ids), 1) / len(ids)   # against off's rate
        if want.choice == OFF or gain < 1.05:
            assert got.choice == OFF, (a, gain)
            kept.current = want.choice   # nor is a choice it was running kept below the bar
            assert kept.plan(ids, 0, 1, 0.0).choice == OFF, (a, gain)
            seen.add("off" if want.choice == OFF else "below")
        else:
            assert (got.choice, got.speculating) == (want.choice, want.speculating), (a, gain)
            seen.add("above")
    assert seen == {"off", "below", "above"}


def test_a_steps_verdicts_counted_at_once_equal_them_one_by_one():
    """The book counts a step's verdicts in one batch (per family, one row per request): the rates
    are those of counting each verdict in turn, per request and for the drafter, through request
    rows freed and reused and tables grown."""
    rng = np.random.default_rng(1)
    book, one_by_one = AcceptanceBook(), AcceptanceBook()
    counts: dict[str, tuple[np.ndarray, np.ndarray]] = {}     # per request, counted by hand
    live: list[str] = []
    for step in range(60):
        ended = [s for s in live if rng.random() < 0.15]
        for s in ended:
            book.forget(s)
            counts.pop(s)
        live = [s for s in live if s not in ended] + [f"s{step}-{i}" for i in range(int(rng.integers(0, 4)))]
        if not live:
            continue
        depths = rng.integers(1, 9, len(live))
        accepted = np.array([rng.integers(0, d + 1) for d in depths])
        book.observe_many(live, "chain", depths, accepted)
        for s, d, a in zip(live, depths, accepted):
            one_by_one.observe(s, "chain", int(d), int(a))
            tried, right = counts.setdefault(s, (np.zeros(16), np.zeros(16)))
            tried *= book.request_decay
            right *= book.request_decay
            tried[:min(a + 1, d)] += 1
            right[:a] += 1
        prior = book.drafter_rates("chain")
        np.testing.assert_allclose(prior, one_by_one.drafter_rates("chain"), rtol=1e-12)
        w = book.prior_weight
        want = np.stack([(counts[s][1] + w * prior) / (counts[s][0] + w) for s in live] + [prior])
        np.testing.assert_allclose(book.request_rates(live + ["never-seen"], "chain"), want, rtol=1e-12)
    assert len(book.requests["chain"].tried) > 8    # the table grew
    assert AcceptanceBook().request_rates(["x"], "tree 2/4/8").shape == (1, 16)


def test_one_slow_step_does_not_rule_a_kind_out_for_good():
    """The H200 case (a = 0.9, C = 1): the only chain step measured at batch 1 was a transient at
    2.5x its model, every chain there borrowed that figure, and auto kept a tree that was a few
    percent worse than a chain. Its challenges (a rival family's best, now and then) price the rival
    with borrowed figures from a single step taken as provisional, so the chain runs again, its own
    measurement replaces the borrowed one, and auto moves to it."""
    def flat(b, w):
        return 0.010

    def draft(b, n):   # a tree drafts topk rows a position: dearer than a chain of the same depth
        return 0.0008 * n * b

    p = policy(profile(flat, draft))
    rng = np.random.default_rng(0)
    observe(p, "r0", "chain", 0.9, 200, rng)
    for c in p.choices:
        if c.mode == Mode.TREE:
            observe(p, "r0", c.family, 0.9, 200, rng)
    true = {c.name: flat(1, c.width) + (draft(c.topk or 1, c.positions) if c != OFF else 0.0) for c in p.choices}
    model = {c.name: p._seconds(c, 1, 1, c.width, None) if c != OFF else flat(1, 1) for c in p.choices}
    for c in p.choices:   # everything measured at batch 1 as the model says, but chains: one slow k=8 step
        if c.mode != Mode.CHAIN:
            for _ in range(3):
                p.calibration.observe(c.kind, c.name, c.width, 1, true[c.name], model[c.name])
    k8 = next(c for c in p.choices if c.name == "chain k=8")
    p.calibration.observe(k8.kind, k8.name, k8.width, 1, 2.5 * true[k8.name], model[k8.name])
    assert p.plan(["r0"], 0, 1, 0.0).choice.mode == Mode.TREE       # the borrowed 2.5x rules chains out
    ran = []
    for _ in range(200):
        plan = p.plan(["r0"], 0, 1, 0.0)
        ran.append(plan.choice.name)
        p.observe_step(plan, true[plan.choice.name])
        if plan.speculating:
            observe(p, "r0", plan.choice.family, 0.9, 1, rng, plan.choice.positions)
    assert p.current.mode == Mode.CHAIN, ran[-20:]
    assert sum(name.startswith("chain") for name in ran[-50:]) >= 45


def chains_measured(draft, batch: int, a: float, slow: str | None = None,
                    factor: float = 1.2) -> tuple[AutoPolicy, list[str], dict[str, float]]:
    """A policy over off and the chains for `batch` requests that each accepted `a` per position of
    20 chains, every choice's step time measured three times as the model says (a memory-bound
    verify), but `slow`'s: once, at `factor` times. -> (policy, seq ids, true seconds by name)."""
    costs = profile(memory_bound, draft)
    p = AutoPolicy(costs, AcceptanceBook(), [c for c in menu(costs, 64, False) if c.mode != Mode.TREE])
    ids = [f"r{i}" for i in range(batch)]
    rng = np.random.default_rng(0)
    for sid in ids:
        observe(p, sid, "chain", a, 20, rng)
    true = {c.name: p._seconds(c, batch, batch, c.width, None) if c != OFF else memory_bound(batch, 1)
            for c in p.choices}
    for c in p.choices:
        for _ in range(1 if c.name == slow else 3):
            p.calibration.observe(c.kind, c.name, c.width, batch, true[c.name] * (factor if c.name == slow else 1),
                                  true[c.name])
    return p, ids, true


def serve(p: AutoPolicy, ids: list[str], true: dict[str, float], steps: int = 400) -> list[str]:
    """`steps` plans, each step taking its choice's true time. -> the choices run."""
    ran = []
    for _ in range(steps):
        plan = p.plan(ids, 0, 1, 0.0)
        ran.append(plan.choice.name)
        p.observe_step(plan, true[plan.choice.name])
    return ran


def test_one_slow_step_of_a_sibling_does_not_rule_it_out_for_good():
    """The H200 case (a = 0.8, C = 16): chain k=4's only clean step at batch 16 ran at 1.2x its
    later steps, so auto kept chain k=8 for the whole run (1.09x of off where chain k=4 alone ran
    1.20x). Challenges also run a sibling of the current choice whose step time there rests on
    one or two steps of its own: it is measured again and auto moves to it. (Chains only:
    the siblings are the question.)"""
    def draft(b, n):   # a fixed cost a step: the deepest chain is best, 5% above chain k=6
        return 0.002 + 0.0003 * n

    p, ids, _ = chains_measured(draft, 16, 0.8)
    best = p.plan(ids, 0, 1, 0.0).choice
    assert best.name == "chain k=8"
    p, ids, true = chains_measured(draft, 16, 0.8, slow=best.name)
    assert p.plan(ids, 0, 1, 0.0).choice != best     # its one slow step rules it out
    ran = serve(p, ids, true)
    assert p.current == best, ran[-20:]


def test_a_sibling_whose_first_step_ran_slow_is_measured_again_within_a_few_plans():
    """The H200 sweep (a = 0.8, C = 32): chain k=4's first two steps at batch 32 ran at 1.4x its
    later ones, and auto ran chain k=8 and tree 2/4/8 for ~5 s (0.87x of chain k=4) before the
    next challenge (one every 32 plans) measured it again. A rival whose one or two steps there
    stand well above its kind's confirmed figures is measured again within a few plans."""
    def draft(b, n):   # a fixed cost a step: the deepest chain is best, 5% above chain k=6
        return 0.002 + 0.0003 * n

    p, ids, _ = chains_measured(draft, 16, 0.8)
    best = p.plan(ids, 0, 1, 0.0).choice
    p, ids, true = chains_measured(draft, 16, 0.8, slow=best.name)
    assert p.plan(ids, 0, 1, 0.0).choice != best     # its one slow step rules it out
    assert p.calibration.suspect(best.kind, best.name, 16)
    ran = serve(p, ids, true, steps=8)
    assert best.name in ran and p.current == best, ran


def test_one_slow_step_of_off_does_not_keep_speculation_standing():
    """The H100 sweep (a = 0.6, C = 32): off's only clean step at the 17-32 bucket (the first after
    a wave's prompts) took 11.8 ms where its steps take ~10.5, and off, priced so, lost to chains
    for the rest of the row (0.82x of off). While speculation stands off runs only in steps that
    prefill, which measure nothing: challenges also run off where its step time at this batch
    size rests on fewer than three steps of its own, and auto turns to it."""
    def draft(b, n):   # a fixed cost a step: the best chain is ~5% below off at batch 32
        return 0.0135 + 0.0003 * n

    p, ids, true = chains_measured(draft, 32, 0.6, slow=OFF.name, factor=1.25)
    assert best_fixed(memory_bound, draft, 0.6, 32, p.choices) == 32 / memory_bound(32, 1)   # off is best
    assert p.plan(ids, 0, 1, 0.0).choice != OFF      # but its one slow step rules it out
    ran = serve(p, ids, true)
    assert p.current == OFF, ran[-20:]


def test_overlap_is_priced_with_the_measured_pre_draft_hits_once_known():
    """Whole-draft acceptance is the pre-draft hit rate only until hits are measured: a hedging
    drafter's pre-drafts hit far more often (its hedges cover rejections), a plain one's less (it
    must also guess the bonus). The sync draft after misses is priced with the measured rate."""
    costs = profile(memory_bound, cheap_draft)
    p = AutoPolicy(costs, AcceptanceBook(), menu(costs, 64, True))
    c = next(c for c in p.choices if c.overlap and c.k == 4)
    full = np.array([0.5 ** 4])
    verify, predraft, draft = memory_bound(1, 5), cheap_draft(1, 9), cheap_draft(1, 4)
    assert p._seconds(c, 1, 1, c.width, full) == pytest.approx(max(verify, predraft) + (1 - full[0]) * draft)
    for i in range(19):                       # too few to trust
        p.book.predraft_hits.observe(4, i % 10 != 0)
    assert p._seconds(c, 1, 1, c.width, full) == pytest.approx(max(verify, predraft) + (1 - full[0]) * draft)
    for i in range(200):
        p.book.predraft_hits.observe(4, i % 10 != 0)          # 90% of pre-drafts used
        p.book.predraft_hits.observe(2, False)                # another k: its own count
    rate = p.book.predraft_hits.rate(4)
    assert rate == pytest.approx(0.9, abs=0.02) and p.book.predraft_hits.rate(2) == 0.0
    assert p._seconds(c, 1, 1, c.width, full) == pytest.approx(max(verify, predraft) + (1 - rate) * draft)


def test_a_deep_chain_is_not_expected_to_commit_more_than_it_does():
    """The drafter's figure carries one standard error for the family, not one per position: those
    compound along a chain, and on the H200 (a = 0.8, C = 1) auto expected 5.6-5.8 tokens of a
    chain of 8 that commits 4.3, and preferred it to the chain of 4 that was best."""
    truth = float(expected_tokens(np.full(16, 0.8), 8))
    ratios = []
    for seed in range(6):
        rng, book = np.random.default_rng(seed), AcceptanceBook()
        for i in range(1500):   # requests of 16 steps each
            accepted = 0
            while accepted < 8 and rng.random() < 0.8:
                accepted += 1
            book.observe(f"r{i // 16}", "chain", 8, accepted)
        ratios.append(float(expected_tokens(book.drafter_rates("chain"), 8)) / truth)
    assert np.mean(ratios) < 1.04, ratios


def test_a_request_left_out_drifts_back_towards_its_drafters_estimate():
    """A request that stops drafting stops producing verdicts: its own figures, from a hard stretch
    of text, would otherwise keep it off to its end. Each step the policy leaves it out, its own
    counts weigh less, so its estimate returns towards the drafter's and it is tried again."""
    def per_sequence_draft(b, n):   # each sequence drafted costs its share: a hard one does not pay
        return 0.002 * n * b

    p = policy(profile(memory_bound, per_sequence_draft))
    rng = np.random.default_rng(0)
    for i in range(20):
        observe(p, f"easy{i}", "chain", 0.8, 20, rng)
    observe(p, "hard", "chain", 0.1, 30, rng)
    drafter = p.book.drafter_rates("chain")[0]
    before = p.book.request_rates(["hard", "easy0"], "chain")[:, 0]
    assert before[0] < 0.5 * drafter
    plan = p.plan(["hard", "easy0"], 0, 1, 0.0, steps=4)
    assert plan.speculating == ["easy0"], plan
    after = p.book.request_rates(["hard", "easy0"], "chain")[:, 0]
    assert after[0] > before[0] and after[1] == before[1]   # only the request left out was aged
    p.book.age_idle(["hard"], 20)                            # as 20 more steps off would
    assert p.book.request_rates(["hard"], "chain")[0, 0] > 0.8 * drafter


def test_the_menu_has_only_trees_both_profiles_price():
    """A tree is on the menu when the drafter profiled it and the verifier's profile reaches its
    width: a CPU verifier (widths up to 17) would otherwise price a 65-wide verify as a 17-wide one."""
    wide = {f"tree {t}/{d}/{b}" for t, d, b in AUTO_TREES if b > 16}
    full = profile(memory_bound, cheap_draft)
    assert wide <= {c.name for c in menu(full, 64, False)}
    narrow = CostModel([c for w, s in full.verify_widths.items() if w <= 17 for c in _costs(f"verify:{w}", s)],
                       [c for s, surf in full.draft_shapes.items() for c in _costs(s, surf)])
    names = {c.name for c in menu(narrow, 64, False)}
    assert not wide & names and {"tree 4/4/16", "tree 4/5/16", "chain k=8"} <= names
    assert not wide & {c.name for c in menu(full, 16, False)}   # nor past --max-draft-tokens


def _costs(shape: str, surface) -> list[StepCost]:
    return [StepCost(shape, b, surface.at(b)) for b in PROFILE_BATCHES]
