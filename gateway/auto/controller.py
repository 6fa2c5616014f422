"""The scheduler's side of `--mode auto`: applies the policy's plan to requests and feeds it measurements.

Each step, `plan` sets every auto request's mode and draft settings for that step (the policy's
choice, or off for those it leaves out), dropping a ready draft of another shape. After the
verdicts, `observe_verdict` records each speculating request's accepted positions (fixed-mode
requests too: they measure the same drafter; counted in one batch at the next plan) and the
choice it ran, and `observe_step` gives the policy the step's measured time. Without both
services' cost profiles (started with --no-cost-profile) auto requests fall back to the gateway's
default chain.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import structlog

from gateway.auto.acceptance import AcceptanceBook
from gateway.auto.costs import CostModel, StepCalibration, bucket
from gateway.auto.policy import OFF, AutoPolicy, Choice, CyclingPolicy, Plan, menu
from gateway.request import ActiveRequest, Mode, SpecSettings
from specdec.cost_profile import StepCost, tree_shape

WARMUP_STEPS = 3
CONFIRM_MEASUREMENTS = 3   # the calibration's median needs three
SETTLED_REPLAN = 8         # while settled off, a full plan every replan_every * SETTLED_REPLAN steps


class AutoController:
    def __init__(self, verifier_costs: list[StepCost], drafter_profile: Callable[[], tuple[list[StepCost], list[str]]],
                 max_draft_tokens: int, log=None, cycle: bool = False, replan_every: int = 8,
                 verifier_accelerators: list[str] = (), hidden_states: bool = False) -> None:
        """drafter_profile: () -> a drafter's (cost profile, accelerators), asked until one answers;
        hidden_states: the verifier sends hidden states to requests that may draft (EAGLE-3)."""
        self.hidden_states = hidden_states
        self.was_settled = False                       # settled off (with hidden states) at the last plan
        self.steps_settled = 0                         # plans since the last scout while settled
        self.scout: ActiveRequest | None = None        # the request kept ready to draft for a probe
        self.scout_probed = False                      # its probe has run (its verdict comes before the next plan)
        self.open_steps = 0                            # settled, but admitting unparked for this many plans (reopen)
        self.parked_running: list[ActiveRequest] = []  # parked mid-life, for take_parked()
        self.verifier_costs, self.drafter_profile = verifier_costs, drafter_profile
        self.verifier_accelerators = set(verifier_accelerators)
        self.max_draft_tokens = max_draft_tokens
        self.book = AcceptanceBook()
        self.pending: dict[str, tuple[list[str], list[int], list[int]]] = {}   # verdicts by family, not yet counted
        self.policies: dict[bool, AutoPolicy | CyclingPolicy] = {}   # by whether overlap is allowed
        self.costs: CostModel | None = None
        self.log = log or structlog.get_logger(service="gateway")
        self.last_choice: dict[bool, str] = {}
        self.cycle = cycle   # tests only: CyclingPolicy instead of AutoPolicy
        self.replan_every = 1 if cycle else replan_every
        self.plans: dict[bool, CachedPlan] = {}   # by whether overlap is allowed
        self.step_plans: list[tuple] = []    # this step's (policy, plan, other sequences)
        self.step_drafts: list[list] = []    # per step plan: [expected drafts, accepted drafts, verdicts] (Plan.gains)
        self.steps_seen = 0
        self.catching_up = False   # this step's drafter also takes in tokens committed while a request did not draft
        self.catch_up_rows = 0     # how many (SwitchCost)
        self.draft_trips = StepCalibration()   # drafts' round trips over the profile's (_price_the_drafts)
        self.holding: set[str] = set()   # this step: seq ids whose hidden states the verifier keeps (see plan)
        self.choice_at: dict[int, Choice] = {}   # batch bucket -> the last plan's choice there (see _plan_group)
        self.load_choice: dict[bool, Choice] = {}   # by whether overlap is allowed: the same, at the last plan
        self.step_tokens = self.step_requests = 0   # this step's verdicts: tokens committed, requests
        self.step_running = 0                       # this step's requests that verify (auto or not)
        self.steps_planned = 0                      # every step's plan (the clock of Vacancies)

    def _policy(self, overlap_allowed: bool) -> AutoPolicy | CyclingPolicy | None:
        if self.costs is None:
            drafter, accelerators = self.drafter_profile()
            if not (self.verifier_costs and drafter):
                return None
            shared = bool(self.verifier_accelerators & set(accelerators))
            self.costs = CostModel(self.verifier_costs, drafter, shared_accelerator=shared)
            self.log.info("auto mode costs", drafter_shares_the_verifier_accelerator=shared)
        if overlap_allowed not in self.policies:
            # On a shared GPU or CPU an overlap pre-draft runs after the verify and drafts more than
            # the draft it may save, so it never pays (0.71-0.79x of chain without overlap in the
            # H200 sweep): it is left off the menu, which spares the policy a kind to explore.
            # (The tests' cycling policy keeps it, to switch between every shape.)
            overlap = overlap_allowed and (self.cycle or not self.costs.shared_accelerator)
            choices = menu(self.costs, self.max_draft_tokens, overlap)
            # Probes after 64 steps off, then 128, ... up to 4096.
            self.policies[overlap_allowed] = (CyclingPolicy(choices) if self.cycle else AutoPolicy(
                self.costs, self.book, choices, probe_start=64, probe_max=4096, min_measured=CONFIRM_MEASUREMENTS))
        return self.policies[overlap_allowed]

    # ---- admission ---------------------------------------------------------------------------
    def admit(self, r: ActiveRequest, batch: int | None = None) -> None:
        """Keeping an auto request ready to draft has a price with an EAGLE-3 drafter even while it
        does not draft: every verdict carries its hidden states (copied off the GPU, sent, held by
        the gateway), a large share of a small target's step. Once auto has settled on off (its
        probes keep losing), requests admitted are parked - mode off for life, without hidden
        states. Probes still need a request that can draft: when the policy's probe interval has
        passed since the last one, the request admitted becomes the scout. It keeps its hidden
        states, the next plan probes it (one step drafting one token), and once that has run it is
        parked too if auto is still settled on off, unless its drafts would pay for a whole batch of
        requests that can draft (see reopen). So scouting costs a few steps per probe, and a turn
        in acceptance or load is still noticed. batch: the batch it joins (settled there; None: at the
        last plans' batch sizes)."""
        if not (self.hidden_states and self.settled_off(batch)) or self.open_steps > 0:
            return
        if self.scout is None and self.steps_settled >= min(p.probe_interval for p in self._auto_policies()):
            self.scout, self.scout_probed, self.steps_settled = r, False, 0
            r.scout = True
            for p in self._auto_policies():
                p.probe_due()
        else:
            r.parked, r.choice, r.mode = True, "off", Mode.OFF

    def holds_admissions(self, batch: int) -> bool:
        """Whether a request admitted into a batch of `batch` sequences has its prompt's hidden
        states held on the verifier (auto has not settled): it will most likely run off, so the
        rows (a whole prompt's) travel only if it drafts. Most likely off: the last plan at that
        batch size chose off, or, at a size not planned for yet, every group's last plan did. By
        batch size because load comes in waves: a wave of prompts arriving after a quiet spell in
        which speculation ran must not ship its rows (at C = 32, 8B-shaped fp8 rows: 25 MB in
        one step) where auto already found that off wins."""
        if not self.hidden_states or (self.settled_off(batch) and self.open_steps <= 0):
            return False
        known = self.choice_at.get(bucket(batch))
        if known is not None:
            return known == OFF
        return bool(self.load_choice) and all(c == OFF for c in self.load_choice.values())

    def _after_probe(self, policy: AutoPolicy, batch: int) -> None:
        """A plan after the scout's probe still chooses off. Parked requests cannot draft, so at a
        batch of them that plan prices the scout speculating alone, beside them, which a high load
        never repays: once settled there, auto stayed off for good (H100, 8B + EAGLE-3 head at
        C = 32: 0.98x of off where chain k=4 ran at 1.08x). So the policy also prices the batch as
        requests that all draft at the drafter's acceptance; if speculation would win that, auto
        reopens: for a probe interval the requests admitted are not parked (their hidden states
        held on the verifier while it runs off), so the batch turns into requests that can draft,
        and a plan over them speculates once it pays. Else the scout is parked."""
        if policy.pays_for_a_batch(batch):
            self.open_steps = policy.probe_interval
            self.scout.scout, self.scout = False, None
            self.log.info("auto reopens admissions: speculation would pay for a batch that drafts",
                          batch=batch, steps=self.open_steps)
        else:
            self.park([self.scout])

    def _auto_policies(self) -> list[AutoPolicy]:
        return [p for p in self.policies.values() if isinstance(p, AutoPolicy)]

    def park(self, running: list[ActiveRequest]) -> None:
        """Parks requests mid-life (handed to the scheduler by take_parked): auto's own, and the
        scheduler's when their held hidden states outgrow what a request may hold
        (gateway/release_budget.py)."""
        for r in running:
            r.parked, r.scout, r.choice, r.mode = True, False, "off", Mode.OFF
            if r is self.scout:
                self.scout = None
        self.parked_running += running

    def take_parked(self) -> list[ActiveRequest]:
        """Requests parked mid-life since the last call: the scheduler stops their hidden states on
        the verifier and frees their drafter state."""
        parked, self.parked_running = self.parked_running, []
        return parked

    def settled_off(self, batch: int | None = None) -> bool:
        """Every policy chooses off at this batch size and has seen a probe lose there since it did
        (AutoPolicy.settled_off_at); batch None: at each policy's last planned batch size."""
        policies = self._auto_policies()
        if batch is None:
            return bool(policies) and all(p.settled_off for p in policies)
        return bool(policies) and all(p.settled_off_at(bucket(batch)) for p in policies)

    # ---- before the step ---------------------------------------------------------------------
    def plan(self, continuing: list[ActiveRequest], prefilling: bool = False) -> None:
        """prefilling: the step also prefills prompts (its time will not be measured), so it runs
        only choices already measured at this batch size (AutoPolicy.plan's explore=False)."""
        self._flush_drafts()
        self.steps_planned += 1
        self.step_plans, self.step_drafts = [], []
        self.step_running = len(continuing)
        self.catching_up = False
        self.catch_up_rows = 0
        self.holding = set()
        self.step_tokens = self.step_requests = 0
        self._flush_verdicts()
        settled = self.hidden_states and self.settled_off(len(continuing))
        self.open_steps = max(0, self.open_steps - 1) if settled else 0
        if settled:
            self.steps_settled += 1
            if not self.was_settled:   # the requests running since before settling, as admit() has it for later ones
                self.park([r for r in continuing if r.auto and not r.parked])
                self.steps_settled = 0
        self.was_settled = settled
        auto = [r for r in continuing if r.auto and not r.parked]
        if not auto:
            return
        fixed = [r for r in continuing if not r.auto or r.parked]
        width = max((step_width(r.settings, r.mode) for r in fixed), default=1)
        fixed_tokens = sum(max(1.0, r.stats.mean_accepted_length) for r in fixed)
        for overlap_allowed in (True, False):   # requests that said overlap=false get a menu without it
            group = [r for r in auto if r.req.spec.overlap == overlap_allowed]
            if group:
                self._plan_group(group, overlap_allowed, len(continuing) - len(group), width, fixed_tokens,
                                 prefilling)
        # A request that drafts after steps without (a probe after a spell off, the first step after
        # its prompt) has the drafter take in every token committed meanwhile: a one-off cost (on a
        # CPU a chain k=1 step went 51 -> 63-91 ms) that must not be read as the choice's step time
        # (observe_step). It was: the probes' slow steps priced chain k=1 above off, so auto stayed
        # off and parked every later request.
        drafting_anew = [r for r in continuing if r.mode != Mode.OFF and r.draft is None]
        self.catching_up = any(r.drafter_lag > step_width(r.settings, r.mode) for r in drafting_anew)
        self.catch_up_rows = sum(r.drafter_lag for r in drafting_anew) if self.catching_up else 0

    def _plan_group(self, group: list[ActiveRequest], overlap_allowed: bool, others: int, other_width: int,
                    other_tokens: float, prefilling: bool) -> None:
        policy = self._policy(overlap_allowed)
        if policy is None:   # no cost profiles: the default chain (with overlap unless refused)
            choice = Choice(Mode.CHAIN, group[0].req.spec.k, overlap=overlap_allowed)
            speculating = {r.seq_id for r in group}
        else:
            plan = self._cached_plan(policy, group, overlap_allowed, others, other_width, other_tokens, prefilling)
            self.step_plans.append((policy, plan, others))
            self.step_drafts.append([0.0, 0.0, 0])
            choice, speculating = plan.choice, set(plan.speculating)
            # Off planned for requests with at most one token left (nothing to gain by drafting)
            # says nothing about what the load favours: it must not hold the rows of the next
            # prompts admitted at this batch size (a benchmark's 2-token warm-ups did, and each
            # wave after them started off, then sent its rows: ~5% of the time at C = 16, H100).
            # Nor does a probe or challenge, one step run to measure a choice: a new drafter's
            # probe of chain k=1 where auto ran off had the next wave's prompts at that batch size
            # send their rows (stand-ins, C = 64, 8B-wide rows: 63 prompts' rows, a 455 ms step).
            if not plan.probe and (choice != OFF or any(r.req.max_new_tokens - r.generated > 1 for r in group)):
                self.choice_at[bucket(len(group) + others)] = self.load_choice[overlap_allowed] = choice
            if self.scout is not None and any(r is self.scout for r in group):
                if choice != OFF and self.scout.seq_id in speculating:
                    self.scout_probed = True
                elif self.scout_probed and choice == OFF and self.settled_off():
                    self._after_probe(policy, len(group) + others)
            if choice.name != self.last_choice.get(overlap_allowed):
                self.last_choice[overlap_allowed] = choice.name
                off = getattr(policy, "last_off", None)   # (the tests' cycling policy scores nothing)
                self.log.info("auto mode choice", choice=choice.name, batch=len(group) + others,
                              speculating=len(speculating), expected_tokens_per_second=round(plan.tokens_per_second, 1),
                              off_tokens_per_second=round(off.tokens_per_second, 1) if off else None,
                              off_step_ms=round(off.seconds * 1e3, 2) if off else None,
                              off_overhead_ms=round(off.overhead * 1e3, 2) if off else None,
                              overhead_ms=round(plan.overhead * 1e3, 2), realized=round(plan.realized, 3),
                              off_realized=round(off.realized, 3) if off else None,
                              vacancy_steps=(round(policy.vacancies.steps(), 2)
                                             if isinstance(policy, AutoPolicy) else None),
                              catch_up_us_per_row=(round(policy.switches.per_row * 1e6, 2)
                                                   if isinstance(policy, AutoPolicy) else None),
                              request_ids=sorted({r.req.request_id for r in group})[:16])
        for r in group:
            self._apply(r, choice if r.seq_id in speculating else OFF)
        if self.hidden_states:
            # A plan of off for the group: its requests' hidden states stay on the verifier until
            # one drafts again, so the steps off cost what mode off's do and off is priced from
            # them. (Else auto priced off from steps that carried rows: on the H100, 1,245 tok/s
            # at C = 32 where mode off ran 2,560, and speculation at 0.76x of off kept winning.)
            # A plan that drafts for some requests (a probe drafts one) keeps the others' rows
            # held where they were: a probe of one request at C = 64 sent every request's rows,
            # a 164 ms step (H200, 8B). The scout keeps its rows: its probe drafts at once.
            self.holding.update(r.seq_id for r in group if not r.scout and (
                choice == OFF or (r.rows_held and r.seq_id not in speculating)))

    def _cached_plan(self, policy, group: list[ActiveRequest], overlap_allowed: bool, others: int, other_width: int,
                     other_tokens: float, prefilling: bool) -> Plan:
        """A full plan every `replan_every` steps, or when the batch moves to another size bucket,
        or while the choice is changing (a plan costs 1-3 ms at batch 64 on a 2-core VM); in between
        the last choice is kept, and a request that joined meanwhile speculates with it. Once auto
        has settled on off, a full plan comes only every SETTLED_REPLAN times as many steps (or at
        a bucket change): its probes keep their step intervals, and the bookkeeping no longer costs
        a plain step 1-3% (the H200 closed loop at a = 0, C = 1: 0.93x of off). A step that
        prefills keeps the cached plan only if its choice is measured at this batch size; else it
        plans among off and the measured choices (where prompts arrive every step, a choice is
        then tried only once a step without a prefill has measured it); while auto has not settled,
        such a plan of off is redone by the next step that does not prefill. (It was once kept for
        `replan_every` steps: with clients out of step at C = 32 a prompt joins every step or two,
        each join replanned without exploring and restarted the count, so auto never tried
        speculation - off for good in a closed-loop simulation where chain k=4 ran at 1.16x of off.)"""
        ids = [r.seq_id for r in group]
        key = bucket(len(group) + others)
        cached = self.plans.get(overlap_allowed)
        explore = not (prefilling and isinstance(policy, AutoPolicy))
        # Off planned for other requests (ones about to end, say) is no verdict on a request that
        # just joined, unless auto has settled on off.
        joined_off = (cached is not None and cached.plan.choice == OFF and isinstance(policy, AutoPolicy)
                      and not policy.settled_off and any(i not in cached.known for i in ids))
        settled = (cached is not None and cached.plan.choice == OFF and isinstance(policy, AutoPolicy)
                   and policy.settled_off and self.open_steps <= 0)
        limit = self.replan_every * (SETTLED_REPLAN if settled else 1)
        scouting = self.scout is not None and not self.scout_probed   # its probe comes with a full plan
        if (cached is not None and cached.confirmed and cached.bucket == key and cached.age < limit
                and not joined_off and not scouting and (explore or self._measured(policy, cached.plan))):
            cached.age += 1
            plan, known = cached.plan, cached.known
            keep = set(plan.speculating) | ({i for i in ids if i not in known} if plan.choice != OFF else set())
            return dataclasses.replace(plan, speculating=[i for i in ids if i in keep])
        # (r.mode is still last step's: requests that ran off, or just joined, left the drafter behind)
        behind = sum(r.drafter_lag for r in group if r.mode not in (Mode.CHAIN, Mode.TREE))
        limits = np.array([r.req.max_new_tokens for r in group], dtype=np.float64)
        generated = np.array([r.generated for r in group], dtype=np.float64)
        remaining = limits - generated
        if isinstance(policy, AutoPolicy):
            policy.lengths.running(generated, limits)
        if not explore:   # off while still learning: redone at the next step that can explore (below)
            plan = policy.plan(ids, others, other_width, other_tokens, explore=False, remaining=remaining,
                               behind=behind)
            learning = plan.choice == OFF and not policy.settled_off
            self.plans[overlap_allowed] = CachedPlan(plan, key, 1, set(ids), confirmed=not learning)
            return plan
        steps = cached.age if cached is not None else 1   # steps since the last plan
        plan = policy.plan(ids, others, other_width, other_tokens, remaining=remaining, steps=steps, behind=behind)
        # Kept only once confirmed: a probe, a choice that differs from the last one, or one whose
        # step time at this batch size rests on fewer than three measurements (priced from another
        # size or choice: the policy still learning) is planned again next step - but a choice
        # planned three times running is kept anyway (steps that prefill are not measured, and a
        # server where prompts keep arriving must not pay for a full plan every step).
        same = cached is not None and cached.plan.choice == plan.choice and not plan.probe
        repeats = cached.repeats + 1 if same else 0
        confirmed = same and (self._measured(policy, plan) or repeats >= CONFIRM_MEASUREMENTS)
        self.plans[overlap_allowed] = CachedPlan(plan, key, 1, set(ids), repeats, confirmed)
        return plan

    @staticmethod
    def _measured(policy, plan: Plan) -> bool:
        return not isinstance(policy, AutoPolicy) or policy.measured(plan.choice, plan.batch)

    def _apply(self, r: ActiveRequest, c: Choice) -> None:
        r.choice = c.name
        r.mode = c.mode
        if c.mode != Mode.OFF:
            r.settings = SpecSettings(c.mode, k=c.k or r.req.spec.k, overlap=c.overlap, topk=c.topk or 1,
                                      depth=c.depth or 1, budget=c.budget or 1)
        if r.draft is not None and (c.mode == Mode.OFF or r.draft_family != c.family
                                    or (c.mode == Mode.CHAIN and len(r.draft) != c.k)):
            r.draft = None   # made for another shape (an overlap pre-draft, or last step's choice)

    # ---- after the step ----------------------------------------------------------------------
    def observe_predraft(self, k: int, hit: bool) -> None:
        """An overlap pre-draft made during the verify of a draft of k was used (hit) or dropped."""
        self.book.predraft_hits.observe(k, hit)

    def observe_verdict(self, r: ActiveRequest, drafted_depth: int, accepted: int) -> None:
        """Recorded now, counted at the next plan (or forget): a step's verdicts update the
        acceptance book in one batch per family."""
        if drafted_depth:
            ids, depths, accepts = self.pending.setdefault(r.draft_family, ([], [], []))
            ids.append(r.seq_id)
            depths.append(drafted_depth)
            accepts.append(accepted)
        if r.auto:
            r.stats.steps_by_mode[r.choice or "off"] += 1
            if drafted_depth:
                for (_, plan, _), tally in zip(self.step_plans, self.step_drafts):
                    expected = plan.gains.get(r.seq_id)
                    if expected is not None:
                        tally[0] += expected
                        tally[1] += accepted
                        tally[2] += 1
                        break
        self.step_tokens += accepted + 1
        self.step_requests += 1

    def _flush_drafts(self) -> None:
        """The last step's drafts against what its plans expected of them (TokenCalibration)."""
        for (policy, plan, _), (expected, accepted, verdicts) in zip(self.step_plans, self.step_drafts):
            if isinstance(policy, AutoPolicy):
                policy.observe_tokens(plan, expected, accepted, verdicts)

    def _flush_verdicts(self) -> None:
        for family, (ids, depths, accepts) in self.pending.items():
            self.book.observe_many(ids, family, np.array(depths), np.array(accepts))
        self.pending.clear()

    def observe_step(self, seconds: float, draft_seconds: float = 0.0, prefilling: bool = False,
                     admitted: int = 0, active: int = 0, carried: int = 0) -> None:
        """The step's wall time after its plan (drafts, verify, pre-drafts, the verdicts applied);
        draft_seconds: the round trip of its drafts before the verify; prefilling: it also prefilled prompts,
        `admitted` of them new this step and `carried` admitted by earlier steps; active: the requests in the
        batch after its admissions. Each step that took in prompts, under one plan for every sequence or with no
        sequence running, tells the policy what its kind's steps really take per admission
        (AutoPolicy.observe_overhead); a clean one (no prefill) under one plan also calibrates the choice's step
        time. The first few steps of the gateway's life are not used: they also pay for opening streams and
        first allocations. Where a drafter caught up (see `plan`), the step's drafts count as steps without a
        catch-up take them (_draft_trip), the rest of the step (the verify, the hops) as measured, and the step
        only bounds its choice's time from above (StepCalibration); the overhead keeps the drafts whole unless
        the step was a probe (a prompt's catch-up comes with every request that drafts). Every step under one
        plan, prompts, catch-ups and all, also counts toward what its kind delivers (RealizedRates)."""
        self.steps_seen += 1
        warm = self.steps_seen > WARMUP_STEPS
        if admitted:
            for policy in self._auto_policies():
                policy.vacancies.admitted(self.steps_planned, admitted, into_empty=not self.step_running)
        one = self._one_plan()
        self._count_delivered(one, seconds)
        for policy in self._auto_policies():
            policy.overheads.tick()
            if one is not None and policy is one[0]:
                policy.observe_overhead(one[1], seconds, admitted, prefilling, active, carried)
            elif warm and not self.step_running and (admitted or prefilling):   # prompts and nothing else
                policy.observe_overhead(None, seconds, admitted, prefilling, active, carried)
            else:
                policy.overheads.skip(admitted)
        if one is not None:
            policy, plan, _ = one
            if prefilling or admitted:
                # What such a step took over the clean time it was priced at, per prompt it
                # admitted, next to the figure the policy charges a prompt (StepOverheads).
                per_admission = policy.overheads.per_admission(plan.choice != OFF, plan.batch)
                self.log.debug("auto admitting step", choice=plan.choice.name, batch=plan.batch,
                               admitted=admitted, expected_ms=round(plan.seconds * 1e3, 2),
                               overhead_ms=round(plan.overhead * 1e3, 2), measured_ms=round(seconds * 1e3, 2),
                               per_admission_ms=round(per_admission * 1e3, 2))
            if self.catching_up:   # what the catch-up added, per row it took in
                policy.switches.caught_up(self.catch_up_rows, draft_seconds - self._draft_trip(plan))
            if prefilling:
                return
            self._price_the_drafts(plan, draft_seconds)
            if self.catching_up:
                seconds += self._draft_trip(plan) - draft_seconds
            # What the policy expected of this step next to what it took and committed, and the
            # best other speculative plan it weighed (SPECDEC_LOG_LEVEL=debug).
            rival = policy.last_rival
            self.log.debug("auto step", choice=plan.choice.name, batch=plan.batch,
                           rival=rival.choice.name if rival else None,
                           rival_tokens_per_second=round(rival.tokens_per_second, 1) if rival else None,
                           rival_ms=round(rival.seconds * 1e3, 2) if rival else None,
                           rival_overhead_ms=round(rival.overhead * 1e3, 2) if rival else None,
                           rival_tokens=round(rival.expected_tokens, 1) if rival else None,
                           token_ratio=round(policy.tokens.ratio, 3),
                           speculating=len(plan.speculating), probe=plan.probe, caught_up=self.catching_up,
                           model_ms=round(plan.model_seconds * 1e3, 2), expected_ms=round(plan.seconds * 1e3, 2),
                           overhead_ms=round(plan.overhead * 1e3, 2), measured_ms=round(seconds * 1e3, 2),
                           realized=round(plan.realized, 3), expected_tokens=round(plan.expected_tokens, 2),
                           tokens=self.step_tokens)
            policy.observe_step(plan, seconds, bound=self.catching_up)

    def observe_release(self, seconds: float) -> None:
        """A step that ran requests off against the plan, for their held hidden states to reach the drafter
        (the scheduler's _hold_or_release): no measure of any choice, but part of a switch's price, which the
        kind switched to pays (RealizedRates). Left out, with the catch-up after it, the switches from off to
        chain k=4 at C = 64 on the H100 (~250 ms each at 64 requests) cost nothing: auto flapped between the
        two every few steps, at 0.81x of off, while each kind's own steps delivered more than expected."""
        self.steps_seen += 1
        one = self._one_plan()
        self._count_delivered(one, seconds)
        if one is not None and one[0].last_off is not None:   # its excess over a plain off step (SwitchCost)
            one[0].switches.released(seconds - one[0].last_off.seconds)

    def _count_delivered(self, one: tuple | None, seconds: float) -> None:
        """Every step counts for RealizedRates' clock; one run under one plan is its kind's evidence."""
        for policy in self._auto_policies():
            policy.realized.tick()
        if one is not None:
            one[0].observe_realized(one[1], seconds, self.step_tokens)

    def _one_plan(self) -> tuple | None:
        """This step's (policy, plan, others) where one auto plan ran the whole batch, past the warm-up."""
        if self.steps_seen > WARMUP_STEPS and len(self.step_plans) == 1 and not self.step_plans[0][2]:
            return self.step_plans[0] if isinstance(self.step_plans[0][0], AutoPolicy) else None
        return None

    def _price_the_drafts(self, plan: Plan, draft_seconds: float) -> None:
        """A clean step whose requests all drafted before the verify (no overlap) and without
        catching up: its drafts' round trip against the profile's draft time. The round trip also
        holds the hops, serialization and the tokens appended a step, which the profile leaves out
        (stand-ins with the H100's costs, 8B at batch 58: 14-16 ms where chain k=2's profile said
        7.5), so a catch-up step's drafts are priced at this ratio (_draft_trip): at the bare profile,
        each catch-up step priced chain k=2 at 24 ms where its steps took 31-33, and auto ran
        speculation at C = 64 where it lost (0.79x of off)."""
        c = plan.choice
        if c != OFF and not c.overlap and not self.catching_up and draft_seconds > 0:
            n = len(plan.speculating)
            modelled = self.costs.draft(n, c.draft_shape)
            self.draft_trips.observe("draft", c.draft_shape, c.width, n, draft_seconds, modelled)

    def _draft_trip(self, plan: Plan) -> float:
        """What this step's drafts would have taken without the catch-up: the profile's time times
        the round trips' measured ratio (1 until a step measured it)."""
        c, n = plan.choice, len(plan.speculating)
        return self.costs.draft(n, c.draft_shape) * self.draft_trips.ratio("draft", c.draft_shape, c.width, n)

    def forget(self, r: ActiveRequest, ended: bool = True) -> None:
        """r leaves the batch: ended (finished, failed or cancelled; its length tells how often
        requests end, RequestLengths) or released to resume elsewhere."""
        self._flush_verdicts()   # its last verdict still counts for its drafter
        if ended:
            for policy in self._auto_policies():
                policy.lengths.observe(r.generated)
                policy.vacancies.ended(self.steps_planned)
        self.book.forget(r.seq_id)
        if r is self.scout:   # ended before (or right after) its probe: the next admission may scout
            self.scout = None


def step_width(s: SpecSettings, mode: Mode) -> int:
    """Tokens per sequence a verify of this mode checks (the root included)."""
    return {Mode.CHAIN: s.k + 1, Mode.TREE: s.budget + 1}.get(mode, 1)


def draft_family(settings: SpecSettings, mode: Mode) -> str:
    return tree_shape(settings.topk, settings.depth, settings.budget) if mode == Mode.TREE else "chain"


@dataclasses.dataclass
class CachedPlan:
    plan: Plan
    bucket: int          # the batch bucket it was made for
    age: int             # steps it has run (re-planned at `replan_every`)
    known: set[str]      # the requests it was made for (later joiners take its choice)
    repeats: int = 0     # plans in a row that chose the same
    confirmed: bool = True   # False: planned again next step
