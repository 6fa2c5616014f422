"""`--mode auto`: each step, the speculation choice that maximises the batch's expected tokens per second.

A verify step pads every sequence to the widest draft in it, so the choice is made for the batch:
one shape (off, a chain of k with or without overlap, or one of the default trees) for every auto
request that speculates this step, and per request whether it speculates at all. For a choice c:

  tokens(c) = sum over speculating requests of E_r(c)  +  1 per other request
  time(c)   = draft(n_s, c) + verify(B, width)                       tree, chain without overlap
            = max(verify(B, width), predraft(n_s, k)) + (1 - h) draft(n_s, k)    chain with overlap
              (verify + predraft in place of the max when drafter and verifier share a GPU or CPU:
              both then run on the same processor)

E_r(c) = 1 + sum_j prod_{i<=j} p_r[i] from the request's running acceptance per position
(gateway/auto/acceptance.py), at most the tokens the request has left; h the probability that an
overlap pre-draft is usable: the measured share of pre-drafts used after drafts of k once known
(a hedging drafter's hedges count), until then that of a whole chain accepted; and the costs are the services'
start-up profiles (gateway/auto/costs.py) times a calibration: measured / modelled step time per
choice and batch bucket, which carries what the profiles cannot see (gRPC and Python on three hops,
contention on a shared GPU), plus what the kind's steps (off, speculating) take over their clean
time per prompt they admit (StepOverheads) times the prompts the choice admits a step: a choice
that commits more tokens a request ends requests, and admits the next prompts, sooner (RequestLengths).
tokens(c) / time(c) is then scaled by the share of the batch c keeps filled where each ending leaves
its slot empty until the next admission (gateway/auto/occupancy.py), and by what its kind's steps
(off, speculating) delivered at this batch size against what their plans expected
(gateway/auto/realized.py): the parts' errors, summed, as the running service meets them. Coming
from off, a speculative choice is weighed net of the switch: the drafter's catch-up on the tokens
committed while it ran off, against the requests' remaining time (gateway/auto/switch_cost.py). A
request speculates only while its expected gain pays for its share of the draft step. Speculation
must beat off by `speculation_margin`: the best of several noisy estimates is more often
overestimated than not, and a speculative step has costs no step time shows (requests that end
at different steps leave small batches behind, prompts that arrive apart prefill apart); on the
H200 a tree scored within a few percent of off at a = 0.8, C = 32 was chosen on upward errors and
ran the closed loop at 0.80x of off. The policy keeps its current
choice unless another is `switch_margin` better, so it does not flap between near-equal choices.
A new drafter is first measured with cheap probes (one request drafts one token); when
speculation is off the policy still probes now and then (in a batch of one, with the speculative
choice rated best), the interval doubling while probes keep losing, so a rising acceptance is
noticed (counted per batch bucket: a wave's ramp, where speculation pays, does not restart the
count where off wins, and auto settles off there); and now and then a close rival runs one step: one from
another acceptance family (a tree against a chain), or a sibling of the current choice (chain k=4
against k=8) whose step time at this batch size rests on one or two steps of its own, or off
where its own step time there rests on fewer than three; the rival challenged longest ago first,
and (off aside) only one priced from steps at this batch size. So a family is not abandoned on a
few unlucky verdicts or on one slow step of a sibling, nor a sibling or off on one slow step of
its own (rivals are priced with per-position acceptance errors and
StepCalibration's optimistic figures). A rival whose one or two steps at this batch size ran well
above its kind's confirmed figures there runs again within two plans (StepCalibration.suspect).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from gateway.auto.acceptance import AcceptanceBook, TokenCalibration
from gateway.auto.costs import CostModel, RequestLengths, StepCalibration, StepOverheads, bucket
from gateway.auto.occupancy import Vacancies, occupancy
from gateway.auto.realized import RealizedRates
from gateway.auto.switch_cost import SwitchCost
from gateway.request import Mode
from specdec.cost_profile import AUTO_CHAIN_KS, AUTO_TREES, chain_shape, predraft_shape, tree_shape


@dataclass(frozen=True, eq=False)
class Choice:
    mode: Mode
    k: int = 0
    overlap: bool = False
    topk: int = 0
    depth: int = 0
    budget: int = 0

    # Equal by name (it names every field that matters): compared ~100 times a plan, where the
    # generated field-by-field comparison showed in the gateway's step time.
    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, Choice) and self.name == other.name)

    def __hash__(self) -> int:
        return hash(self.name)

    @cached_property
    def name(self) -> str:
        if self.mode == Mode.OFF:
            return "off"
        if self.mode == Mode.CHAIN:
            return f"chain k={self.k}" + (" overlap" if self.overlap else "")
        return f"tree {self.topk}/{self.depth}/{self.budget}"

    @cached_property
    def kind(self) -> str:
        """Choices whose step-time errors are alike (calibration borrows within a kind)."""
        if self.mode == Mode.CHAIN:
            return "chain overlap" if self.overlap else "chain"
        return self.mode.value

    @cached_property
    def family(self) -> str:
        """Which acceptance estimate prices it: all chains share one (a chain of k is a prefix of k+1)."""
        if self.mode == Mode.OFF:
            return "off"
        return "chain" if self.mode == Mode.CHAIN else tree_shape(self.topk, self.depth, self.budget)

    @cached_property
    def positions(self) -> int:
        return self.k if self.mode == Mode.CHAIN else self.depth

    @cached_property
    def width(self) -> int:
        return self.k + 1 if self.mode == Mode.CHAIN else self.budget + 1 if self.mode == Mode.TREE else 1

    @cached_property
    def draft_shape(self) -> str:
        return chain_shape(self.k) if self.mode == Mode.CHAIN else tree_shape(self.topk, self.depth, self.budget)


OFF = Choice(Mode.OFF)


def menu(costs: CostModel, max_draft_tokens: int, overlap_allowed: bool) -> list[Choice]:
    """The choices both profiles priced and the verifier accepts."""
    out = [OFF]
    for k in AUTO_CHAIN_KS:
        if k <= max_draft_tokens and costs.has_draft_shape(chain_shape(k)):
            out.append(Choice(Mode.CHAIN, k))
            if overlap_allowed and costs.has_draft_shape(predraft_shape(k)):
                out.append(Choice(Mode.CHAIN, k, overlap=True))
    for topk, depth, budget in AUTO_TREES:
        if (budget <= max_draft_tokens and costs.has_draft_shape(tree_shape(topk, depth, budget))
                and costs.covers_width(budget + 1)):
            out.append(Choice(Mode.TREE, topk=topk, depth=depth, budget=budget))
    return out


@dataclass
class Plan:
    choice: Choice
    speculating: list[str]          # seq ids that draft this step (the rest run as mode off)
    tokens_per_second: float
    probe: bool = False             # one step of speculation while off wins (not to be repeated)
    batch: int = 0
    model_seconds: float = 0.0      # the step time the cost model predicts, before calibration
    expected_tokens: float = 0.0    # tokens the batch is expected to commit
    seconds: float = 0.0            # the calibrated time of a clean step (one that admits no prompt)
    overhead: float = 0.0           # what its steps are expected to take over that (admissions x cost each)
    gains: dict[str, float] = dataclasses.field(default_factory=dict)   # speculating seq id -> its expected
    #                                 accepted drafts before the TokenCalibration (what that calibration measures)
    realized: float = 1.0           # the RealizedRates ratio its tokens_per_second was scaled by

    @property
    def expected_seconds(self) -> float:
        """The step time the choice was scored with."""
        return self.seconds + self.overhead


class AutoPolicy:
    def __init__(self, costs: CostModel, book: AcceptanceBook, choices: list[Choice], switch_margin: float = 0.03,
                 speculation_margin: float = 0.05,
                 probe_start: int = 16, probe_max: int = 1024, min_observations: int = 5,
                 challenge_every: int = 32, challenge_within: float = 0.25, min_measured: int = 3,
                 remeasure_every: int = 2) -> None:
        """probe_start, probe_max: steps off between probes, first and at most (each `plan` call
        counts its `steps`);
        min_observations: verdicts the drafter needs before a plan trusts its acceptance (until
        then each plan is a probe); every `challenge_every` plans a rival (another acceptance
        family's best, a sibling or off, as the module docstring says), if predicted within
        `challenge_within` of the best, runs one step, so a choice that looked worse after a few
        unlucky verdicts or one slow step is measured again; min_measured:
        measured steps that make a choice's step time at a batch size its own (not borrowed);
        remeasure_every: plans between the steps that measure again a rival whose one or two steps
        at this batch size ran slow against its kind's there (StepCalibration.suspect)."""
        self.costs, self.book, self.choices = costs, book, choices
        self.calibration = StepCalibration(plain_kind=OFF.kind)
        self.tokens = TokenCalibration()
        self.overheads = StepOverheads()
        self.lengths = RequestLengths()
        self.vacancies = Vacancies()
        self.realized = RealizedRates()
        self.switches = SwitchCost()
        self.min_observations, self.min_measured = min_observations, min_measured
        self.challenge_every, self.challenge_within = challenge_every, challenge_within
        self.plans_since_challenge = 0
        self.plans_since_remeasure = 0
        self.remeasure_every = remeasure_every
        self.challenges = 0
        self.last_challenged: dict[str, int] = {}   # _challenger(rival) -> the challenge that last ran it
        self.switch_margin, self.speculation_margin = switch_margin, speculation_margin
        self.current = OFF
        self.probe_start, self.probe_max = probe_start, probe_max
        # Probing while off is counted per batch bucket: the choice last planned there, the steps off
        # since its last probe and the interval to the next. Load comes in waves, and a wave's ramp
        # (small batches, where speculation pays) must not restart the count where off wins. With
        # one count, on the H100 at a = 0.8, C = 64 each wave's ramp reset it: auto ran off at batch
        # 64 without ever probing there, so it never settled, kept every request's hidden states
        # ready on the verifier (+1.2 ms a step, +6 ms a step that admits) and ran at 0.92x of off.
        self.bucket = 1                                    # the batch bucket of the last plan
        self._current_at: dict[int, Choice] = {}
        self._steps_off: dict[int, int] = {}
        self._intervals: dict[int, int] = {}
        self.last_off: Plan | None = None
        self.last_rival: Plan | None = None   # the best speculative plan besides the last choice (logged)

    def plan(self, seq_ids: list[str], others: int, other_width: int, other_tokens: float,
             explore: bool = True, remaining: np.ndarray | None = None, steps: int = 1, behind: int = 0) -> Plan:
        """seq_ids: the auto requests of this step; others: the step's other sequences (fixed
        modes), the widest draft among them and the tokens they are expected to commit.
        remaining: [len(seq_ids)] tokens each request may still generate (a draft cannot gain more
        than its request has left: near its end a request is worth less to speculate).
        explore=False (a step that also prefills, whose time is not measured): only off and the
        choices whose step time at this batch size rests on `min_measured` measurements of their
        own; no probe, no challenge, and the policy's state is left as it was. Else a choice tried
        there on a borrowed estimate would never be measured, and each wave's ramp would try it
        again (the H200 sweep: trees chosen while 32 prompts prefilled, 0.88x of off).
        steps: the steps since the last plan (a caller that keeps a plan for several steps); the
        intervals between probes count steps. behind: tokens the drafter has yet to take in for these
        requests (committed while they ran off): what a switch from off must first catch up."""
        b = bucket(len(seq_ids) + others)
        if b not in self._intervals:   # a bucket's first plan: its probe count goes on from the last bucket's
            self._intervals[b], self._steps_off[b] = self.probe_interval, self.steps_off
        self.bucket = b
        if not explore:
            return self._plan_measured(seq_ids, others, other_width, other_tokens, remaining, behind)
        probe = self._probe_choice()
        if seq_ids and probe is not None and self.book.drafter_observations("chain") < self.min_observations:
            return self._probe(probe, seq_ids, others)   # a new drafter: measure it cheaply first
        scored = self._scored(self.choices, seq_ids, others, other_width, other_tokens, remaining)
        best = self._best(scored, behind, remaining)
        self.current = self._current_at[self.bucket] = best.choice
        self.plans_since_challenge += 1
        self.plans_since_remeasure += 1
        batch = len(seq_ids) + others
        rival_choices, optimistic = [], True
        if self.plans_since_challenge >= self.challenge_every and best.choice != OFF:
            self.plans_since_challenge = 0
            # Rivals priced optimistically: a figure borrowed from a single step of a sibling (a
            # transient, perhaps) must not keep a whole kind from ever running here again. Only
            # rivals priced from steps at this batch size (their own or their kind's): one priced
            # from other sizes alone can cost many steps' time here (drafts that contend 65x at
            # batch 32, measured at 4); that is for the plans' own exploring.
            rival_choices = [c for c in self.choices if c not in (OFF, best.choice)
                             and self.calibration.measured_here(c.kind, c.name, batch)
                             and (c.family != best.choice.family
                                  or 0 < self.calibration.measured(c.name, batch) < self.min_measured)]
            # And off, where its step time here rests on fewer than `min_measured` steps of its
            # own: while speculation stands, off runs only in steps that prefill, which measure
            # nothing. On the H100 (a = 0.6, C = 32) off's one clean step at 17-32, the first after
            # a wave's prompts, took 11.8 ms where its steps take ~10.5; so priced, off lost to the
            # chains for the rest of the row, and auto ran at 0.82x of off.
            if self.calibration.measured(OFF.name, batch) < self.min_measured:
                rival_choices.append(OFF)
        elif self.plans_since_remeasure >= self.remeasure_every and best.choice != OFF:
            # A rival whose one or two steps at this batch size ran well above what its kind's
            # confirmed choices run there is measured again soon, not at the next challenge (32
            # plans on, ~250 steps): a batch size's first steps can run slow. On the H200 (a = 0.8,
            # C = 32) chain k=4's first two steps there took 20.9 and 25.8 ms, its later ones 18-19;
            # so priced, auto ran chain k=8 and tree 2/4/8 (28 and 25 ms a step for 10% more
            # tokens) for ~5 s, at 0.87x of chain k=4. (Priced as measured, not optimistically.)
            rival_choices = [c for c in self.choices
                             if c != best.choice and self.calibration.suspect(c.kind, c.name, batch)]
            if rival_choices:
                self.plans_since_remeasure, optimistic = 0, False
        if rival_choices:
            rivals = [p for p in self._scored(rival_choices, seq_ids, others, other_width, other_tokens, remaining,
                                              optimistic=optimistic)
                      if p.tokens_per_second >= (1 - self.challenge_within) * best.tokens_per_second]
            if rivals:   # one step, not kept (like a probe)
                # The rival challenged longest ago goes first, so each close one gets its turns
                # (the best rival alone, a sibling tree say, could keep a chain's unlucky start
                # from ever being corrected).
                def turn(p: Plan) -> str:
                    return _challenger(p.choice, best.choice)

                rival = max(rivals, key=lambda p: (-self.last_challenged.get(turn(p), -1), p.tokens_per_second))
                self.challenges += 1
                self.last_challenged[turn(rival)] = self.challenges
                return dataclasses.replace(rival, probe=True)
        if best.choice == OFF and seq_ids and len(self.choices) > 1:
            self._steps_off[self.bucket] = self.steps_off + steps
            if self.steps_off >= self.probe_interval and probe is not None:   # look again, cheaply
                self._steps_off[self.bucket] = 0
                self._intervals[self.bucket] = min(self.probe_interval * 2, self.probe_max)
                if batch == 1:
                    # A batch of one: the probe is the whole step whatever it drafts, so it runs the
                    # likeliest winner, whose family's estimate it then corrects. (chain k=1 alone
                    # measured only the chains' first position: a replay over recorded SmolLM2
                    # verdicts, the wide tree best at 1.17x of off, sank into off for good once tree
                    # 8/7/64's third position went 0.49 over its first 30 verdicts: 0.85 of the tree.)
                    probe = max((p for p in scored if p.choice != OFF), key=lambda p: p.tokens_per_second).choice
                return self._probe(probe, seq_ids, others)
        elif best.choice != OFF:
            self._steps_off[self.bucket], self._intervals[self.bucket] = 0, self.probe_start
        drafting = set(best.speculating)
        self.book.age_idle([s for s in seq_ids if s not in drafting], steps)
        return best

    def _plan_measured(self, seq_ids: list[str], others: int, other_width: int, other_tokens: float,
                       remaining: np.ndarray | None, behind: int = 0) -> Plan:
        batch = len(seq_ids) + others
        choices = [c for c in self.choices if self.measured(c, batch)]
        return self._best(self._scored(choices, seq_ids, others, other_width, other_tokens, remaining), behind,
                          remaining)

    def measured(self, c: Choice, batch: int) -> bool:
        """Off, or a choice whose step time at this batch size rests on measurements of its own."""
        return c == OFF or self.calibration.measured(c.name, batch) >= self.min_measured

    def _scored(self, choices: list[Choice], seq_ids: list[str], others: int, other_width: int,
                other_tokens: float, remaining: np.ndarray | None, optimistic: bool = False) -> list[Plan]:
        # Per family, once: [n, positions] cumulative products (P(positions 1..j all accepted)) and
        # their running sums (expected accepted drafts of a depth-j draft): each choice reads a column.
        prefix = {}
        for f in {c.family for c in choices if c != OFF}:
            accepted_through = np.cumprod(self.book.request_rates(seq_ids, f, optimistic), axis=1)
            gains = np.cumsum(accepted_through, axis=1)
            if remaining is not None:   # the step commits one token anyway; drafts add at most the rest
                gains = np.minimum(gains, np.maximum(remaining - 1, 0)[:, None])
            prefix[f] = (gains, accepted_through)
        return [self._score(c, seq_ids, others, other_width, other_tokens, prefix.get(c.family), optimistic)
                for c in choices]

    def _best(self, scored: list[Plan], behind: int = 0, remaining: np.ndarray | None = None) -> Plan:
        """The best plan among off and the speculative ones `speculation_margin` better than off, or
        the current choice's (if among them) unless the best is `switch_margin` better. Coming from
        off, a speculative plan is weighed net of the switch it needs (_switch_share); its expected
        rate itself stays as priced (RealizedRates compares steps with it)."""
        off = next((p for p in scored if p.choice == OFF), None)
        self.last_off = off   # (logged beside each new choice: what off was expected to give)
        worth = {id(p): p.tokens_per_second * self._switch_share(p, behind, remaining) for p in scored}
        candidates = scored
        if off is not None:
            bar = off.tokens_per_second * (1 + self.speculation_margin)
            # (the margin is for the estimates' noise, the switch a cost: a plan needs both)
            candidates = [p for p in scored if p.choice == OFF or (
                p.tokens_per_second >= bar and worth[id(p)] >= off.tokens_per_second)]
        best = max(candidates, key=lambda p: worth[id(p)])
        current = next((p for p in candidates if p.choice == self.current), None)
        if current is not None and worth[id(best)] <= worth[id(current)] * (1 + self.switch_margin):
            best = current
        # The best speculative plan besides the one chosen (logged with each measured step: what a
        # choice beat, so a log shows which sibling it was weighed against and at what price).
        self.last_rival = max((p for p in scored if p.choice not in (OFF, best.choice)),
                              key=lambda p: p.tokens_per_second, default=None)
        return best

    def _switch_share(self, p: Plan, behind: int, remaining: np.ndarray | None) -> float:
        """The share of a speculative plan's rate left once a switch from off is paid: its requests'
        remaining time at the plan's rate (their mean tokens left over each one's share of the rate),
        against that time plus the catch-up on `behind` tokens (SwitchCost). 1 where no switch is
        needed (speculation already runs) or its cost is not yet known."""
        if p.choice == OFF or self.current != OFF or remaining is None or not len(remaining):
            return 1.0
        switch = self.switches.seconds(behind)
        if switch <= 0 or p.tokens_per_second <= 0:
            return 1.0
        horizon = float(np.mean(remaining)) * max(1, p.batch) / p.tokens_per_second
        return horizon / (horizon + switch)

    def pays_for_a_batch(self, batch: int) -> bool:
        """Whether a batch of `batch` new requests, all able to draft at the drafter's acceptance
        (no running estimate of their own yet), would speculate rather than run off."""
        scored = self._scored(self.choices, [""] * batch, 0, 1, 0.0, None)
        off = next(p for p in scored if p.choice == OFF)
        return any(p.tokens_per_second >= off.tokens_per_second * (1 + self.speculation_margin)
                   for p in scored if p.choice != OFF)

    def probe_due(self) -> None:
        """The next full plan that chooses off probes (a scout was just admitted for it)."""
        self._steps_off[self.bucket] = max(self.steps_off, self.probe_interval)

    @property
    def probe_interval(self) -> int:
        """Steps off between probes at the last plan's batch bucket."""
        return self._intervals.get(self.bucket, self.probe_start)

    @property
    def steps_off(self) -> int:
        """Steps run off at the last plan's batch bucket since its last probe there."""
        return self._steps_off.get(self.bucket, 0)

    @property
    def settled_off(self) -> bool:
        """Settled at the last plan's batch bucket (settled_off_at)."""
        return self.settled_off_at(self.bucket)

    def settled_off_at(self, b: int) -> bool:
        """Off is the choice last planned at batch bucket b, and a probe there lost since it chose
        off (the probe interval there has grown). A bucket not planned for yet goes by the last
        plan's, as its first plan will."""
        return (self._current_at.get(b, self.current) == OFF
                and self._intervals.get(b, self.probe_interval) > self.probe_start)

    def observe_step(self, plan: Plan, seconds: float, bound: bool = False) -> None:
        """The measured wall time of a step without prompts that ran `plan` for the whole batch;
        bound: it also did one-off work (a drafter's catch-up), so it only bounds the choice's time."""
        c = plan.choice
        self.calibration.observe(c.kind, c.name, c.width, plan.batch, seconds, plan.model_seconds, bound)

    def observe_realized(self, plan: Plan, seconds: float, tokens: float) -> None:
        """A step (admissions and prefills included) that ran `plan` for the whole batch: `seconds`
        and the tokens it committed, against the rate the plan expected before RealizedRates scaled
        it. A probe or challenge (priced to be tried, not to be right) is left out, and so is a choice
        whose step time here is not yet its own: its first steps' errors are StepCalibration's to
        correct, and counted here they would hold every choice of the kind down (a tree tried
        once at three times its price held chains at 0.7 of theirs in a closed-loop simulation)."""
        if not plan.probe and self.measured(plan.choice, plan.batch):
            self.realized.observe(plan.choice != OFF, plan.batch, plan.tokens_per_second / plan.realized,
                                  seconds, tokens)

    def observe_tokens(self, plan: Plan, expected: float, accepted: float, verdicts: int) -> None:
        """The verdicts of `verdicts` requests that `plan` made speculate: the drafts it expected of them
        (Plan.gains) and those accepted. A probe or challenge (priced to be tried, not to be right) is
        left out."""
        if not plan.probe and verdicts:
            self.tokens.observe(expected, accepted, verdicts)

    def observe_overhead(self, plan: Plan | None, seconds: float, admitted: int, prefilling: bool, active: int,
                         carried: int = 0) -> None:
        """A step that ran `plan` (None: no request was running, the step only took in prompts, which cost
        either kind what it took), admitted `admitted` prompts (prefilling: it prefilled prompt chunks, of
        `carried` prompts admitted before it too) and left `active` requests in the batch: its excess over the
        clean step it was priced at, when that price rests on measurements of the choice's own (not a probe, not
        a borrowed figure), and for off only while off is auto's standing choice. While speculation stands, the
        steps that run off are mostly those that admit a prompt (such a step plans among measured choices only):
        as off's samples they priced off at ~1,800 tok/s where off ran ~2,800 (stand-ins with the H100's costs,
        C = 32), and auto speculated at 0.95x of off."""
        if plan is None:
            self.overheads.observe(None, active, seconds, admitted, prefilling, carried)
        elif ((plan.choice != OFF or self.current == OFF) and not plan.probe and plan.seconds > 0
              and self.measured(plan.choice, plan.batch)):
            self.overheads.observe(plan.choice != OFF, active, seconds - plan.seconds, admitted, prefilling, carried)
        else:
            self.overheads.skip(admitted)

    def _occupancy(self, batch: int, tokens: float) -> float:
        """The share of the batch a choice committing `tokens` a step keeps filled, where each request
        that ends leaves its slot empty until the next admission (gateway/auto/occupancy.py): the
        plans at one batch size are compared as each would run, not all at the batch in front of it."""
        return occupancy(tokens / max(1, batch), self.vacancies.steps(), self.lengths.length())

    def _overhead(self, speculating: bool, batch: int, tokens: float) -> float:
        """What a step committing `tokens` over `batch` requests is expected to take over its clean
        time: the prompts it will admit a step (RequestLengths) times its kind's cost per prompt."""
        return self.lengths.admissions(tokens) * self.overheads.per_admission(speculating, batch)

    def _probe_choice(self) -> Choice | None:
        """The narrowest speculative choice (chain k=1 without overlap)."""
        return min((c for c in self.choices if c != OFF), key=lambda c: (c.width, c.overlap), default=None)

    def _probe(self, c: Choice, seq_ids: list[str], others: int) -> Plan:
        """One request drafts one token: the batch's verify widens by one, the draft is tiny."""
        batch = len(seq_ids) + others
        return Plan(c, [seq_ids[0]], 0.0, probe=True, batch=batch,
                    model_seconds=self._seconds(c, batch, 1, c.width, np.zeros(1)))

    def _score(self, c: Choice, seq_ids: list[str], others: int, other_width: int, other_tokens: float,
               prefix: tuple[np.ndarray, np.ndarray] | None, optimistic: bool = False) -> Plan:
        """prefix: for c's family, the requests' expected accepted drafts by depth and their
        probabilities of accepting a whole draft of each depth ([n, positions] each); optimistic:
        c's step time as StepCalibration.ratio(optimistic=True) prices it."""
        batch = len(seq_ids) + others
        if c == OFF or not seq_ids:
            seconds = self.costs.verify(batch, max(1, other_width))
            calibrated = seconds * self.calibration.ratio(OFF.kind, OFF.name, OFF.width, batch)
            tokens = len(seq_ids) + other_tokens
            overhead = self._overhead(False, batch, tokens)
            realized = self.realized.ratio(False, batch)
            return Plan(OFF, [], tokens / (calibrated + overhead) * self._occupancy(batch, tokens) * realized,
                        batch=batch, model_seconds=seconds, expected_tokens=tokens, seconds=calibrated,
                        overhead=overhead, realized=realized)
        raw = prefix[0][:, c.positions - 1]                            # [n] E - 1
        gain = raw if optimistic else raw * self.tokens.ratio
        full = prefix[1][:, c.positions - 1]                           # [n]
        order = np.argsort(-gain)
        ratio = self.calibration.ratio(c.kind, c.name, c.width, batch, optimistic)
        # A speculative step does all that a plain one does and drafts besides, so it is never priced
        # below that (plus the draft, unless overlap hides it): a calibration resting on one lucky
        # fast step (a loaded machine) must not make speculation at zero acceptance look free.
        off = self.costs.verify(batch, max(1, other_width)) * self.calibration.ratio(OFF.kind, OFF.name, OFF.width,
                                                                                      batch)
        # Speculate the requests with the largest gains first; stop where the next one's gain no
        # longer pays for its draft (the best prefix of the sorted list).
        gained = np.cumsum(gain[order])                                # [n] gain of the first i + 1
        best = (-1.0, 0, 0.0, 0.0, 0.0, 0.0)   # (tokens/s, how many, model s, tokens, step s, overhead s)
        for n in _prefix_sizes(len(seq_ids)):
            seconds = self._seconds(c, batch, n, max(c.width, other_width), full[order[:n]] if c.overlap else None)
            tokens = len(seq_ids) + float(gained[n - 1]) + other_tokens
            floor = off + (0.0 if c.overlap else self.costs.draft(n, c.draft_shape))
            step = max(seconds * ratio, floor)
            overhead = self._overhead(True, batch, tokens)
            tps = tokens / (step + overhead) * self._occupancy(batch, tokens)
            if tps > best[0]:
                best = (tps, n, seconds, tokens, step, overhead)
        tps, n, seconds, tokens, step, overhead = best
        realized = self.realized.ratio(True, batch)
        return Plan(c, [seq_ids[i] for i in order[:n]], tps * realized, batch=batch, model_seconds=seconds,
                    expected_tokens=tokens, seconds=step, overhead=overhead,
                    gains={seq_ids[i]: float(raw[i]) for i in order[:n]}, realized=realized)

    def _seconds(self, c: Choice, batch: int, drafting: int, width: int, full_accept: np.ndarray | None) -> float:
        """The model's seconds for one step: the verify and what the step waits for drafting."""
        verify = self.costs.verify(batch, width)
        if c.mode == Mode.CHAIN and c.overlap:
            predraft = self.costs.draft(drafting, predraft_shape(c.k))
            # Requests whose pre-draft missed need a draft before the next verify: one draft step
            # (for the expected number of misses) whenever any of them missed. A pre-draft hits with
            # the measured rate once known, else when the whole draft passes.
            measured = self.book.predraft_hits.rate(c.k)
            hit = full_accept if measured is None else np.full(len(full_accept), measured)
            misses = float((1.0 - hit).sum())
            p_any_miss = 1.0 - float(np.prod(hit))
            sync = p_any_miss * self.costs.draft(max(1, round(misses)), c.draft_shape)
            beside = verify + predraft if self.costs.shared_accelerator else max(verify, predraft)
            return beside + sync
        return verify + self.costs.draft(drafting, c.draft_shape)


class CyclingPolicy:
    """Tests only (`--test-auto-cycle`): every choice of the menu in turn, one step each, with
    every request speculating, so each switch between shapes happens within a few steps."""

    def __init__(self, choices: list[Choice]) -> None:
        self.choices, self.step = choices, 0

    def plan(self, seq_ids: list[str], others: int, other_width: int, other_tokens: float,
             explore: bool = True, remaining: np.ndarray | None = None, steps: int = 1, behind: int = 0) -> Plan:
        choice = self.choices[self.step % len(self.choices)]
        self.step += 1
        return Plan(choice, [] if choice == OFF else list(seq_ids), 0.0)


def _challenger(c: Choice, best: Choice) -> str:
    """Whose turn a challenge by c takes: another family's as a whole (its acceptance is the
    question), a sibling of the best choice's own (its step time at this batch size is)."""
    return c.family if c.family != best.family else c.name


def _prefix_sizes(n: int) -> list[int]:
    """How many of the sorted requests to try speculating: all, and a few smaller prefixes."""
    sizes = {n, max(1, n // 2), max(1, n // 4), max(1, (3 * n) // 4)}
    return sorted(sizes, reverse=True)
